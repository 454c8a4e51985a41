"""Operator commands that look (status, show, failed, unknown) and act (replay, resolve), run
through ``outbox.cli.main`` against real PostgreSQL: every action is guarded by the row's state,
a refused action leaves the row untouched, and a replayed row goes back through the claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.cli import main
from outbox.schema import NOTIFY_CHANNEL
from outbox.settings import libpq_url

PERSONAL = {"email": "alice@example.com", "amount_cents": 1000, "currency": "EUR"}


def write(
    engine,
    key: str,
    *,
    destination: str = "payments.charge",
    step: str = "charge",
    deadline: datetime | None = None,
) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step=step, destination=destination, payload=PERSONAL, deadline=deadline
        ).id


def connect(services) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(services.database_url), autocommit=True)


def claim(conn: psycopg.Connection[Any], row_id: int) -> store.delivery.Claimed:
    """A consumer's claim of the row, for the row's own destination."""
    [(destination,)] = conn.execute(
        "SELECT destination FROM outbox_message WHERE id = %s", (row_id,)
    ).fetchall()
    claimed = store.delivery.claim(conn, row_id=row_id, destination=destination, lease_seconds=60)
    assert claimed is not None
    return claimed


def make_failed(services, row_id: int, error: str = "card declined", *, ref: str | None = None) -> None:
    """A claim the provider refuses for good, then reported, as the consumer and reconciler do."""
    with connect(services) as conn:
        claimed = claim(conn, row_id)
        moved = store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="failed", outcome="failed", error=error, ref=ref
        ).state
        assert moved == "failed"
        assert store.recovery.mark_alerted(conn, row_id=row_id, state="failed")


def make_unknown(services, row_id: int, *, dispatched: bool = False) -> uuid.UUID:
    """A claim whose call timed out; ``dispatched``: the relay published the row first (it must
    be the only due row)."""
    with connect(services) as conn:
        if dispatched:
            assert [r[0] for r in store.relay.dispatch_due(conn, limit=1)] == [row_id]
        claimed = claim(conn, row_id)
        moved = store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="ReadTimeout"
        ).state
        assert moved == "unknown"
        return claimed.token


def make_sent(services, row_id: int, ref: str = "ch_1") -> None:
    with connect(services) as conn:
        claimed = claim(conn, row_id)
        moved = store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref=ref
        ).state
        assert moved == "sent"


def snapshot(services, row_id: int) -> tuple[Any, ...]:
    """The whole row as text plus xmin: even an UPDATE writing identical values changes xmin."""
    return sql(services, "SELECT xmin::text, m::text FROM outbox_message m WHERE id = %s", (row_id,))[0]


def row(services, row_id: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
        names = [c.name for c in cur.description]
        return dict(zip(names, cur.fetchone(), strict=True))


def run(services, capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def plan_of(services, capsys, *argv: str) -> str:
    """The fingerprint a bulk replay's preview prints (what --yes --plan must name)."""
    code, out, err = run(services, capsys, "replay", *argv, "--json")
    assert code == 0, err
    return str(json.loads(out)["preview"]["plan"])


# -- status ------------------------------------------------------------------------------------------


def test_status_counts_by_destination_and_state(clean, engine, capsys):
    ids = [write(engine, f"order:{i}") for i in range(5)]
    mail = write(engine, "user:1", destination="mail.welcome", step="welcome")
    make_failed(clean, ids[0])
    make_failed(clean, ids[1])
    make_unknown(clean, ids[2])
    make_sent(clean, mail)
    # One pending row due for two minutes: the oldest pending age must see it.
    elapse(clean, 120, [ids[3]])

    code, out, _ = run(clean, capsys, "status", "--json")
    assert code == 0
    data = json.loads(out)
    charge = data["destinations"]["payments.charge"]
    assert (charge["pending"], charge["failed"], charge["unknown"], charge["total"]) == (2, 2, 1, 5)
    assert data["destinations"]["mail.welcome"]["sent"] == 1
    assert (data["unknown"], data["failed"], data["total"]) == (1, 2, 6)
    assert 120 <= data["oldest_pending_age_seconds"] < 180
    assert data["destinations"]["mail.welcome"]["oldest_pending_age_seconds"] is None

    code, out, _ = run(clean, capsys, "status")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["destination", "pending", "dispatched"]
    total_line = next(line for line in lines if line.startswith("TOTAL"))
    assert total_line.split()[1:8] == ["2", "0", "0", "1", "1", "2", "0"]
    assert "unknown: 1   failed: 2   total: 6" in out


def test_status_of_an_empty_database(clean, capsys):
    code, out, _ = run(clean, capsys, "status", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["total"] == 0 and data["destinations"] == {} and data["oldest_pending_age_seconds"] is None
    assert run(clean, capsys, "status")[1].strip() == "no outbox rows"


def test_status_as_a_real_subprocess(clean, engine):
    write(engine, "order:1")
    result = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--json"],
        env=clean.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["destinations"]["payments.charge"]["pending"] == 1


def test_status_without_a_database_url_is_a_config_error(capsys, monkeypatch):
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    assert main(["status"]) == 2
    assert "OUTBOX_DATABASE_URL" in capsys.readouterr().err


# -- show --------------------------------------------------------------------------------------------


def test_show_hides_the_payload_unless_asked(clean, engine, capsys):
    row_id = write(engine, "order:7")
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=60)
        assert claimed is not None
        store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="boom"
        )

    code, out, _ = run(clean, capsys, "show", str(row_id))
    assert code == 0
    assert "alice@example.com" not in out
    assert "payload_keys" in out and '["amount_cents", "currency", "email"]' in out
    assert str(claimed.token) in out and "boom" in out

    code, out, _ = run(clean, capsys, "show", "order:7", "charge", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["row"]["id"] == row_id and data["row"]["state"] == "unknown"
    assert "payload" not in data["row"] and "alice" not in out
    assert data["row"]["payload_keys"] == ["amount_cents", "currency", "email"]
    assert data["row"]["payload_bytes"] == len(json.dumps(PERSONAL).encode())
    [attempt] = data["attempts"]
    assert (attempt["attempt"], attempt["claim_token"], attempt["outcome"]) == (
        1,
        str(claimed.token),
        "unknown",
    )
    assert data["history"] == []

    code, out, _ = run(clean, capsys, "show", str(row_id), "--payload", "--json")
    assert code == 0 and json.loads(out)["row"]["payload"] == PERSONAL


def test_show_unknown_row(clean, capsys):
    code, out, err = run(clean, capsys, "show", "42")
    assert code == 1 and out == ""
    assert err.strip() == "outbox: no outbox row with id 42"
    code, _, err = run(clean, capsys, "show", "order:42", "charge")
    assert code == 1 and "no outbox row with key 'order:42' and step 'charge'" in err
    code, _, err = run(clean, capsys, "show", "not-a-number")
    assert code == 1 and "no outbox row with key 'not-a-number' (nor in the key ledger)" in err


# -- failed / unknown lists --------------------------------------------------------------------------


def test_failed_and_unknown_lists(clean, engine, capsys):
    ids = [write(engine, f"order:{i}") for i in range(4)]
    mail = write(engine, "user:1", destination="mail.welcome", step="welcome")
    make_failed(clean, ids[0], "card declined")
    make_failed(clean, ids[1], "gave up after 3 attempts")
    make_failed(clean, mail, "mailbox full")
    make_unknown(clean, ids[2])
    elapse(clean, 2 * 3600, [ids[0]])

    code, out, _ = run(clean, capsys, "failed", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["matching"] == 3
    # Longest failed first: the one failed two hours ago leads.
    assert [r["id"] for r in data["rows"]] == [ids[0], ids[1], mail]
    assert data["rows"][0]["age_seconds"] >= 7200 and data["rows"][0]["last_error"] == "card declined"

    code, out, _ = run(clean, capsys, "failed", "--destination", "mail.welcome", "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)["rows"]] == [mail]

    code, out, _ = run(clean, capsys, "failed", "--limit", "1")
    assert code == 0
    assert "order:0" in out and "2h00m" in out and "order:1" not in out
    assert "showing 1 of 3" in out

    code, out, _ = run(clean, capsys, "unknown", "--json")
    assert code == 0
    [only] = json.loads(out)["rows"]
    assert (only["id"], only["key"], only["attempts"], only["last_error"]) == (
        ids[2],
        "order:2",
        1,
        "ReadTimeout",
    )

    code, out, _ = run(clean, capsys, "unknown", "--destination", "mail.welcome")
    assert code == 0 and "no unknown rows for destination mail.welcome" in out


def test_lists_refuse_an_unknown_destination(clean, engine, capsys):
    write(engine, "order:1")
    code, out, err = run(clean, capsys, "failed", "--destination", "payments.chrage")
    assert code == 1 and out == ""
    assert "no outbox rows for destination 'payments.chrage' (known: payments.charge)" in err


# -- replay ------------------------------------------------------------------------------------------


def test_replay_moves_failed_to_pending_and_wakes_the_relay(clean, engine, capsys):
    row_id = write(engine, "order:1")
    make_failed(clean, row_id, ref="ch_partial")
    before = row(clean, row_id)

    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        code, out, err = run(
            clean, capsys, "replay", str(row_id), "--reason", "card updated", "--by", "alice"
        )
        notified = list(listener.notifies(timeout=5, stop_after=1))
    assert code == 0, err
    assert out.strip() == f"row {row_id} replayed: failed -> pending"
    assert [n.channel for n in notified] == [NOTIFY_CHANNEL]

    after = row(clean, row_id)
    assert (after["state"], after["attempts"]) == ("pending", 0)
    assert after["dispatched_at"] is after["completed_at"] is after["alerted_at"] is None
    assert after["available_at"] > before["available_at"]
    # Evidence of the earlier attempts is kept.
    assert after["claim_token"] == before["claim_token"] and after["provider_ref"] == "ch_partial"
    assert after["last_error"] == "card declined"
    [entry] = after["history"]
    assert {k: entry[k] for k in ("by", "action", "reason", "from", "to")} == {
        "by": "alice",
        "action": "replay",
        "reason": "card updated",
        "from": "failed",
        "to": "pending",
    }
    assert entry["at"]


def test_replay_by_defaults_to_the_user(clean, engine, capsys, monkeypatch):
    monkeypatch.setenv("USER", "oncall-bob")
    row_id = write(engine, "order:1")
    make_failed(clean, row_id)
    assert run(clean, capsys, "replay", str(row_id), "--json")[0] == 0
    [entry] = row(clean, row_id)["history"]
    assert entry["by"] == "oncall-bob" and entry["reason"] is None


def test_replay_refuses_rows_that_are_not_failed_and_leaves_them_untouched(clean, engine, capsys):
    failed, sent, unknown = (write(engine, f"order:{i}") for i in range(3))
    make_failed(clean, failed)
    make_sent(clean, sent)
    make_unknown(clean, unknown)
    before_sent, before_unknown = snapshot(clean, sent), snapshot(clean, unknown)

    bulk = [str(failed), str(sent), str(unknown), "999"]
    code, out, err = run(clean, capsys, "replay", *bulk, "--yes", "--plan", plan_of(clean, capsys, *bulk))
    assert code == 1
    assert f"row {failed} replayed" in out
    assert f"row {sent} is sent, only failed rows can be replayed" in err
    assert f"row {unknown} is unknown, only failed rows can be replayed" in err
    assert "no outbox row with id 999" in err
    assert snapshot(clean, sent) == before_sent
    assert snapshot(clean, unknown) == before_unknown
    assert row(clean, failed)["state"] == "pending"

    code, out, _ = run(clean, capsys, "replay", str(sent), "--json")
    assert code == 1
    data = json.loads(out)
    assert (data["replayed"], data["refused"]) == (0, 1)
    assert data["results"][0]["message"] == f"row {sent} is sent, only failed rows can be replayed"
    assert snapshot(clean, sent) == before_sent


def test_replayed_row_goes_through_the_claim_and_a_sent_row_never_comes_back(clean, engine, capsys):
    row_id = write(engine, "order:1")
    make_failed(clean, row_id)
    assert run(clean, capsys, "replay", str(row_id))[0] == 0

    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=60)
        assert claimed is not None and claimed.attempt == 1
        assert store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref="ch_9"
        ).state
        # A second delivery of the same message claims nothing.
        assert (
            store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=60) is None
        )

    before = snapshot(clean, row_id)
    code, _, err = run(clean, capsys, "replay", str(row_id))
    assert code == 1 and f"row {row_id} is sent, only failed rows can be replayed" in err
    assert snapshot(clean, row_id) == before
    # One attempt row per claim: the failed run's and the replayed one's; the refused claim added none.
    assert sql(clean, "SELECT count(*) FROM outbox_attempt WHERE message_id = %s", (row_id,)) == [(2,)]


def test_replay_a_whole_destination(clean, engine, capsys):
    charges = [write(engine, f"order:{i}") for i in range(3)]
    ok = write(engine, "order:ok")
    mail = write(engine, "user:1", destination="mail.welcome", step="welcome")
    for row_id in (*charges, mail):
        make_failed(clean, row_id)
    make_sent(clean, ok)

    code, out, _ = run(
        clean,
        capsys,
        "replay",
        "--destination",
        "payments.charge",
        "--reason",
        "provider fixed",
        "--yes",
        "--plan",
        plan_of(clean, capsys, "--destination", "payments.charge"),
    )
    assert code == 0
    assert "replayed 3 failed row(s) of payments.charge" in out
    assert [row(clean, i)["state"] for i in charges] == ["pending"] * 3
    assert row(clean, mail)["state"] == "failed" and row(clean, ok)["state"] == "sent"

    plan = plan_of(clean, capsys, "--destination", "payments.charge")
    code, out, _ = run(
        clean, capsys, "replay", "--destination", "payments.charge", "--json", "--yes", "--plan", plan
    )
    assert code == 0 and json.loads(out)["replayed"] == 0
    # F7: a bulk --yes acts only on a preview someone reviewed, named by its fingerprint.
    make_failed(clean, charges[0])
    code, _, err = run(clean, capsys, "replay", "--destination", "payments.charge", "--yes")
    assert code == 2 and "--yes needs the preview's --plan PLAN" in err
    code, _, err = run(clean, capsys, "replay", str(charges[0]), str(mail), "--yes")
    assert code == 2 and "--yes needs the preview's --plan PLAN" in err
    assert row(clean, charges[0])["state"] == "failed" and row(clean, mail)["state"] == "failed"

    code, _, err = run(clean, capsys, "replay", "--destination", "nope")
    assert code == 1 and "no outbox rows for destination 'nope'" in err
    code, _, err = run(clean, capsys, "replay", "1", "--destination", "payments.charge")
    assert code == 2 and "not both" in err


def test_replay_warns_when_the_deadline_has_passed(clean, engine, capsys):
    row_id = write(engine, "order:1", deadline=datetime.now(UTC) + timedelta(minutes=1))
    make_failed(clean, row_id)
    elapse(clean, 3600 + 60, [row_id])  # the deadline passed an hour ago
    code, out, _ = run(clean, capsys, "replay", str(row_id))
    assert code == 0 and "deadline has passed" in out


# -- resolve -----------------------------------------------------------------------------------------


def test_resolve_sent(clean, engine, capsys):
    row_id = write(engine, "order:1")
    token = make_unknown(clean, row_id)
    code, out, _ = run(
        clean,
        capsys,
        "resolve",
        str(row_id),
        "--sent",
        "ch_42",
        "--reason",
        "seen in dashboard",
        "--by",
        "alice",
    )
    assert code == 0 and out.strip().startswith(f"row {row_id} resolved: unknown -> sent; without MODULE")
    after = row(clean, row_id)
    assert (after["state"], after["provider_ref"], after["claim_token"]) == ("sent", "ch_42", token)
    assert after["completed_at"] is not None and after["unknown_since"] is None
    [entry] = after["history"]
    assert (entry["action"], entry["from"], entry["to"], entry["by"], entry["provider_ref"]) == (
        "resolve",
        "unknown",
        "sent",
        "alice",
        "ch_42",
    )


def test_resolve_not_sent_retries_and_wakes_the_relay(clean, engine, capsys):
    row_id = write(engine, "order:1")
    make_unknown(clean, row_id, dispatched=True)
    assert row(clean, row_id)["dispatched_at"] is not None
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        code, out, _ = run(clean, capsys, "resolve", str(row_id), "--not-sent", "--json")
        notified = list(listener.notifies(timeout=5, stop_after=1))
    assert code == 0 and json.loads(out)["done"] is True
    assert len(notified) == 1
    after = row(clean, row_id)
    assert (after["state"], after["attempts"], after["dispatched_at"]) == ("pending", 1, None)
    # Claimable at once, through the normal claim.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=60)
    assert claimed is not None and claimed.attempt == 2


def test_resolve_failed(clean, engine, capsys):
    row_id = write(engine, "order:1")
    make_unknown(clean, row_id)
    code, _, _ = run(
        clean, capsys, "resolve", str(row_id), "--failed", "provider has no record, order cancelled"
    )
    assert code == 0
    after = row(clean, row_id)
    assert (after["state"], after["last_error"]) == ("failed", "provider has no record, order cancelled")
    assert after["history"][0]["to"] == "failed"


def test_resolve_refuses_rows_that_are_not_unknown(clean, engine, capsys):
    pending, sent = write(engine, "order:1"), write(engine, "order:2")
    make_sent(clean, sent)
    before_pending, before_sent = snapshot(clean, pending), snapshot(clean, sent)

    code, out, err = run(clean, capsys, "resolve", str(pending), "--sent", "ch_x")
    assert code == 1 and out == ""
    assert err.strip() == f"outbox: row {pending} is pending, only unknown rows can be resolved"
    code, _, err = run(clean, capsys, "resolve", str(sent), "--not-sent")
    assert code == 1 and f"row {sent} is sent, only unknown rows can be resolved" in err
    assert snapshot(clean, pending) == before_pending
    assert snapshot(clean, sent) == before_sent

    code, _, err = run(clean, capsys, "resolve", "4242", "--failed", "x")
    assert code == 1 and "no outbox row with id 4242" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["resolve", str(pending), "--sent", "a", "--not-sent"])
    assert exit_info.value.code == 2


def test_every_command_explains_itself(capsys):
    for command, phrase in [
        ("status", "oldest pending age"),
        ("show", "personal data"),
        ("failed", "outbox replay"),
        ("unknown", "outbox resolve"),
        ("replay", "Only failed rows move"),
        ("resolve", "--not-sent"),
        ("doctor", "migration head"),
        ("audit", "more than one attempt confirmed"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert exit_info.value.code == 0
        assert phrase in out, command
        assert "--database-url" in out and "--json" in out, command


def test_commands_use_the_environment_database_url(clean, engine, capsys, monkeypatch):
    write(engine, "order:1")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
    assert os.environ["OUTBOX_DATABASE_URL"] == clean.database_url
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 1
