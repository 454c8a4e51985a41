"""What the operator looks at, as a new user found it: ``show`` telling a replayed row's attempt rows
apart, ``status --watch``, and ``list`` by state, destination and key prefix (``failed`` and
``unknown`` its shortcuts). Run through ``outbox.cli.main`` against real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
from helpers import sql
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.cli import main, watch
from outbox.ops.inspect import key_like
from outbox.settings import libpq_url


def write(engine, key: str, *, destination: str = "payments.charge", step: str = "charge") -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step=step, destination=destination, payload={"n": 1}).id


def run(services, capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def fail_once(services, row_id: int, *, status: int, error: str) -> None:
    """One claim of the row, which the provider refuses for good (a permanent error)."""
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=60)
        assert claimed is not None
        moved = store.delivery.record(
            conn,
            row_id=row_id,
            token=claimed.token,
            state="failed",
            outcome="failed",
            error=error,
            http_status=status,
        ).state
        assert moved == "failed"


# -- show --------------------------------------------------------------------------------------------


def test_show_key_lists_every_step_with_its_milestones_and_where_it_stopped(clean, engine, capsys):
    """A chain of three steps under one key (invoice -> export -> notify, the user-land pattern
    of examples/invoicing): the first confirmed, the second refused for good, the third never
    written; `outbox show KEY` says where the work stopped and why."""
    first = write(engine, "invoice:7", step="issue")
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=first, destination="payments.charge", lease_seconds=60)
        assert claimed is not None
        moved = store.delivery.record(
            conn, row_id=first, token=claimed.token, state="sent", outcome="sent", ref="inv_1"
        ).state
        assert moved == "sent"
    second = write(engine, "invoice:7", step="export")
    fail_once(clean, second, status=422, error="accounting refused: unknown ledger account")
    write(engine, "invoice:8", step="issue")  # another key: not listed

    code, out, err = run(clean, capsys, "show", "invoice:7")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["step", "by", "destination", "state", "attempts"]
    assert [line.split()[0] for line in lines[2:4]] == ["issue", "export"]
    assert "inv_1" in lines[2] and "sent" in lines[2]
    assert "invoice:7: stopped at step export (failed): accounting refused" in out
    assert "invoice:8" not in out

    code, out, _ = run(clean, capsys, "show", "invoice:7", "--json")
    data = json.loads(out)
    assert [s["step"] for s in data["steps"]] == ["issue", "export"]
    issued = data["steps"][0]
    assert (
        issued["confirmed"] is not None
        and issued["claimed"] is not None
        and issued["provider_ref"] == "inv_1"
    )
    assert data["stopped"] == {
        "step": "export",
        "state": "failed",
        "why": "accounting refused: unknown ledger account",
        "waiting": False,
    }

    code, out, _ = run(clean, capsys, "show", "invoice:8")
    assert code == 0 and "invoice:8: under way at step issue (pending)" in out

    # The confirmed step purged: the key ledger still tells it.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_message SET completed_at = completed_at - interval '1 hour' WHERE id = %s",
            (first,),
        )
        assert store.recovery.purge(conn, retention_seconds=60, limit=10).count == 1
    code, out, _ = run(clean, capsys, "show", "invoice:7", "--json")
    purged = json.loads(out)["steps"][0]
    assert purged["step"] == "issue" and purged["purged"] and purged["provider_ref"] == "inv_1"
    assert json.loads(out)["stopped"]["step"] == "export"


def test_show_tells_apart_the_fence_rows_of_a_replayed_row(clean, engine, capsys):
    row_id = write(engine, "order:1")
    fail_once(clean, row_id, status=402, error="card declined")
    code, _, err = run(clean, capsys, "replay", str(row_id), "--by", "ana", "--reason", "card updated")
    assert code == 0, err
    fail_once(clean, row_id, status=422, error="card expired")

    code, out, _ = run(clean, capsys, "show", str(row_id), "--json")
    assert code == 0
    data = json.loads(out)
    # The replay reset `attempts`: both runs' claims are attempt 1; `number` tells them apart.
    assert [(a["number"], a["run"], a["attempt"]) for a in data["attempts"]] == [(1, 1, 1), (2, 2, 1)]
    # The HTTP status of a permanent error is kept on its attempt row.
    assert [(a["outcome"], a["http_status"]) for a in data["attempts"]] == [("failed", 402), ("failed", 422)]
    [replayed] = data["history"]
    assert (replayed["action"], replayed["by"], replayed["after_attempt"]) == ("replay", "ana", 1)

    code, out, _ = run(clean, capsys, "show", str(row_id))
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "attempt", "claim_token"])
    first, mark, second = lines[header + 2 : header + 5]
    assert first.split()[:2] == ["1", "1"] and "402" in first.split() and "card declined" in first
    assert mark.strip().startswith("-- replay by ana at ")
    assert "failed -> pending: card updated" in mark
    assert second.split()[:2] == ["2", "1"] and "422" in second.split() and "card expired" in second
    # The history table itself does not grow an after_attempt column.
    assert "after_attempt" not in out


def test_show_places_history_before_any_claim(clean, engine, capsys):
    row_id = write(engine, "order:1")
    # A state the product cannot reach: unknown with no claim at all, so the entry precedes every attempt.
    sql(clean, "UPDATE outbox_message SET state = 'unknown', unknown_since = now() WHERE id = %s", (row_id,))
    code, _, err = run(clean, capsys, "resolve", str(row_id), "--failed", "cannot tell", "--by", "bo")
    assert code == 0, err
    code, out, _ = run(clean, capsys, "show", str(row_id), "--json")
    [entry] = json.loads(out)["history"]
    assert entry["after_attempt"] == 0 and json.loads(out)["attempts"] == []


# -- list ----------------------------------------------------------------------------------------------


def test_list_by_state_destination_and_key_prefix(clean, engine, capsys):
    a = write(engine, "order:1")
    b = write(engine, "order:12")
    c = write(engine, "order_1")  # `_` is a LIKE wildcard: the prefix must take it literally
    d = write(engine, "user:1", destination="mail.welcome", step="welcome")
    fail_once(clean, b, status=402, error="card declined")

    code, out, _ = run(clean, capsys, "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["matching"] == 4 and data["state"] is None
    assert sorted(r["id"] for r in data["rows"]) == sorted([a, b, c, d])

    code, out, _ = run(clean, capsys, "list", "--key-prefix", "order:1", "--json")
    assert sorted(r["id"] for r in json.loads(out)["rows"]) == sorted([a, b])
    code, out, _ = run(clean, capsys, "list", "--key-prefix", "order_", "--json")
    assert [r["id"] for r in json.loads(out)["rows"]] == [c]
    code, out, _ = run(clean, capsys, "list", "--key-prefix", "%", "--json")
    assert json.loads(out)["rows"] == []

    pending = ("--state", "pending", "--destination", "payments.charge")
    code, out, _ = run(clean, capsys, "list", *pending, "--json")
    data = json.loads(out)
    assert (data["state"], data["states"], data["destination"]) == ("pending", ["pending"], "payments.charge")
    assert sorted(r["id"] for r in data["rows"]) == sorted([a, c])

    # Several states: repeated or in one go; the text table then names each row's state.
    both = ("--state", "failed", "--state", "pending")
    code, out, _ = run(clean, capsys, "list", *both, "--key-prefix", "order:")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "key", "step", "destination", "state", "attempts", "age", "last_error"]
    assert {line.split()[4] for line in lines[2:]} == {"failed", "pending"}

    # `failed` is `list --state failed`, prefix and all.
    code, out, _ = run(clean, capsys, "failed", "--key-prefix", "order:", "--json")
    via_shortcut = json.loads(out)
    code, out, _ = run(clean, capsys, "list", "--state", "failed", "--key-prefix", "order:", "--json")
    via_list = json.loads(out)
    for listed in (via_shortcut, via_list):
        for r in listed["rows"]:
            r.pop("age_seconds")  # the clock moved between the two
    assert via_list == via_shortcut and [r["id"] for r in via_shortcut["rows"]] == [b]

    code, out, _ = run(clean, capsys, "list", "--state", "unknown", "--key-prefix", "order:")
    assert code == 0 and out.strip() == "no unknown rows with a key starting 'order:'"


def test_list_refuses_an_unknown_state_in_one_line(clean, capsys):
    code, out, err = run(clean, capsys, "list", "--state", "pending", "--state", "lost")
    assert code == 2 and out == ""
    assert err.strip() == (
        "outbox: unknown state 'lost'; states are "
        "pending, dispatched, in_flight, unknown, sent, failed, cancelled"
    )
    code, out, _ = run(clean, capsys, "list", "--state", "lost", "--json")
    assert code == 2 and json.loads(out)["error"]["exit_code"] == 2


def test_key_prefix_is_a_left_anchored_like_with_its_wildcards_escaped():
    from outbox.ops.inspect import _LIST

    assert key_like("order:1") == "order:1%"
    assert key_like("a_b%c\\d") == "a\\_b\\%c\\\\d%"
    # What the planner is given: a LIKE anchored at the start, which an index on key can serve.
    assert "key LIKE CAST(:key_like AS text) ESCAPE" in str(_LIST)


# -- status --watch ----------------------------------------------------------------------------------


def test_status_watch_without_a_terminal_prints_each_refresh(clean, engine, capsys, monkeypatch):
    write(engine, "order:1")
    waits: list[float] = []
    monkeypatch.setattr(watch, "_sleep", waits.append)
    code, out, _ = run(clean, capsys, "status", "--watch", "--interval", "0.5", "--count", "3")
    assert code == 0
    assert out.count("outbox status at ") == 3 and out.count("TOTAL") == 3
    assert "\x1b[" not in out  # no redraw into a pipe
    assert waits == [0.5, 0.5]

    code, out, _ = run(clean, capsys, "status", "--watch", "--count", "2", "--json")
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 2 and all(d["by_state"]["pending"] == 1 for d in docs)


def test_status_watch_ends_with_exit_0_on_ctrl_c(clean, capsys, monkeypatch):
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch, "_sleep", interrupt)
    code, out, err = run(clean, capsys, "status", "--watch")
    assert code == 0 and out.count("outbox status at ") == 1 and err == ""


def test_status_watch_flags_are_checked(clean, capsys):
    code, _, err = run(clean, capsys, "status", "--interval", "1")
    assert code == 2 and "--interval and --count go with --watch" in err
    code, _, err = run(clean, capsys, "status", "--watch", "--interval", "0")
    assert code == 2 and "--interval must be above 0" in err
    code, _, err = run(clean, capsys, "status", "--watch", "--interval", "soon")
    assert code == 2 and "not a duration" in err


def test_status_watch_in_a_real_pipe_stops_after_count(clean):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--watch", "--interval", "0.1", "--count", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "OUTBOX_DATABASE_URL": clean.database_url},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("outbox status at ") == 2
