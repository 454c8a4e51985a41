"""``outbox audit``: counts of attempts against confirmed sends are right, an empty database
passes, and each kind of violation (the evidence of a double call) fails it."""

from __future__ import annotations

import json
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
from outbox.ops.audit import AuditReport, audit, parse_since
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.settings import libpq_url


def write(engine, key: str, destination: str = "payments.charge") -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=destination, payload={"n": 1}).id


def connect(services) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(services.database_url), autocommit=True)


def claim(conn: psycopg.Connection[Any], row_id: int) -> store.delivery.Claimed:
    """A consumer's claim of the row, for the row's own destination."""
    [(destination,)] = conn.execute(
        "SELECT destination FROM outbox_message WHERE id = %s", (row_id,)
    ).fetchall()
    claimed = store.delivery.claim(conn, row_id=row_id, destination=destination, lease_seconds=30)
    assert claimed is not None
    return claimed


def settle(services, row_id: int, state: str, *outcomes: str, ref: str | None = None) -> None:
    """One claim per outcome, recorded as a consumer does: ``retry`` sends the row back to
    pending, due at once; the last outcome leaves it in ``state``."""
    errors = {"retry": "timeout", "failed": "card declined", "unknown": "ReadTimeout"}
    with connect(services) as conn:
        for outcome in outcomes:
            claimed = claim(conn, row_id)
            moved = store.delivery.record(
                conn,
                row_id=row_id,
                token=claimed.token,
                state="pending" if outcome == "retry" else state,
                outcome=outcome,
                ref=ref if outcome == "sent" else None,
                error=errors.get(outcome),
                delay_seconds=0 if outcome == "retry" else None,
            ).state
            assert moved == ("pending" if outcome == "retry" else state)


def forge(services, row_id: int, state: str, *outcomes: str, ref: str | None = None) -> None:
    """Put the row in ``state`` with one attempt row per outcome, written directly: evidence the
    guarded moves cannot produce (a double call, a confirmed call on an unsent row, an empty
    reference) and the audit must still find."""
    for attempt, outcome in enumerate(outcomes, start=1):
        sql(
            services,
            "INSERT INTO outbox_attempt (message_id, attempt, claim_token, outcome, finished_at) "
            "VALUES (%s, %s, %s, %s, now())",
            (row_id, attempt, uuid.uuid4(), outcome),
        )
    sql(
        services,
        "UPDATE outbox_message SET state = %s, attempts = %s, provider_ref = %s, "
        "completed_at = CASE WHEN %s IN ('sent', 'failed', 'cancelled') THEN now() END WHERE id = %s",
        (state, len(outcomes), ref, state, row_id),
    )


def run_audit(services, capsys, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["audit", "--json", "--database-url", services.database_url, *extra])
    return code, json.loads(capsys.readouterr().out)


def test_empty_database_passes(clean, capsys):
    code, data = run_audit(clean, capsys)
    assert code == 0
    assert data["ok"] is True and data["violation_count"] == 0
    assert data["destinations"] == {} and data["totals"]["messages"] == 0
    assert main(["audit", "--database-url", clean.database_url]) == 0
    assert "OK: no violation" in capsys.readouterr().out


def test_counts_attempts_against_confirmed_sends(clean, engine, capsys):
    sent = [write(engine, f"order:{i}") for i in range(3)]
    failed = write(engine, "order:failed")
    retried = write(engine, "order:retried")
    pending = write(engine, "order:pending")
    unknown = write(engine, "user:1", destination="mail.welcome")
    settle(clean, sent[0], "sent", "sent", ref="ch_0")
    settle(clean, sent[1], "sent", "sent", ref="ch_1")
    settle(clean, sent[2], "sent", "retry", "sent", ref="ch_2")
    settle(clean, failed, "failed", "retry", "retry", "failed")
    settle(clean, retried, "pending", "retry")
    settle(clean, unknown, "unknown", "unknown")
    assert pending  # never claimed: no attempt row

    code, data = run_audit(clean, capsys)
    assert code == 0, data["violations"]
    charge = data["destinations"]["payments.charge"]
    assert charge["by_state"] == {
        "pending": 2,
        "dispatched": 0,
        "in_flight": 0,
        "unknown": 0,
        "sent": 3,
        "failed": 1,
        "cancelled": 0,
    }
    assert (charge["messages"], charge["attempts"], charge["confirmed_calls"], charge["sent"]) == (6, 8, 3, 3)
    assert charge["claimed_more_than_once"] == 2 and charge["not_terminal"] == 2
    mail = data["destinations"]["mail.welcome"]
    assert (mail["messages"], mail["attempts"], mail["confirmed_calls"], mail["not_terminal"]) == (1, 1, 0, 1)
    assert data["totals"]["attempts"] == 9 and data["totals"]["messages"] == 7
    examples = data["claimed_more_than_once_examples"]
    assert [(e["key"], e["claims"]) for e in examples] == [("order:failed", 3), ("order:2", 2)]


def test_two_confirmed_attempts_for_one_message_is_a_violation(clean, engine, capsys):
    ok = write(engine, "order:1")
    double = write(engine, "order:2")
    settle(clean, ok, "sent", "sent", ref="ch_1")
    # A state the product cannot reach: two confirmed claims of one row.
    forge(clean, double, "sent", "sent", "sent", ref="ch_2")

    code, data = run_audit(clean, capsys)
    assert code == 1 and data["ok"] is False
    assert data["destinations"]["payments.charge"]["confirmed_more_than_once"] == 1
    [violation] = data["violations"]
    assert (violation["id"], violation["kind"]) == (double, "confirmed_more_than_once")

    assert main(["audit", "--database-url", clean.database_url]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 1 violation(s):" in out and f"#{double} order:2 charge" in out


def test_a_late_confirmation_that_lost_the_race_still_counts(clean, engine, capsys):
    # The first claim was taken over, then its call came back confirmed: the provider did it.
    row_id = write(engine, "order:1")
    with connect(clean) as conn:
        old = claim(conn, row_id)
        # Its lease runs out, the reconciler expires it, and an operator settles it as not sent.
        elapse(conn, 31, [row_id])
        assert expire_leases(conn) == 1
        assert main(["resolve", str(row_id), "--not-sent", "--database-url", clean.database_url]) == 0
        newer = claim(conn, row_id)
        assert store.delivery.record(
            conn, row_id=row_id, token=newer.token, state="sent", outcome="sent", ref="ch_1"
        ).state
        # The old worker's call was confirmed after all: a late, superseded recording.
        assert not store.delivery.record(
            conn, row_id=row_id, token=old.token, state="sent", outcome="sent", ref="ch_0"
        ).state
    capsys.readouterr()
    code, data = run_audit(clean, capsys)
    assert code == 1
    [violation] = data["violations"]
    assert violation["kind"] == "confirmed_more_than_once" and "taken over" in violation["detail"]


def test_confirmed_attempt_on_a_row_that_is_not_sent_is_a_violation(clean, engine, capsys):
    row_id = write(engine, "order:1")
    # A state the product cannot reach: a confirmed record moves a failed row to sent.
    forge(clean, row_id, "failed", "sent")
    code, data = run_audit(clean, capsys)
    assert code == 1
    [violation] = data["violations"]
    assert (violation["id"], violation["kind"], violation["state"]) == (
        row_id,
        "confirmed_attempt_on_unsent_row",
        "failed",
    )


def test_sent_without_provider_reference_is_a_violation(clean, engine, capsys):
    # The CHECK constraint forbids NULL; an empty reference slips through it but is no evidence.
    row_id = write(engine, "order:1")
    # A state the product cannot reach: Confirmed refuses an empty reference.
    forge(clean, row_id, "sent", "sent", ref="")
    code, data = run_audit(clean, capsys)
    assert code == 1
    assert data["totals"]["sent_without_provider_ref"] == 1
    assert [v["kind"] for v in data["violations"]] == ["sent_without_provider_ref"]


def test_since_limits_the_audit_to_recent_activity(clean, engine, capsys):
    old, old_but_claimed, recent = (write(engine, f"order:{i}") for i in range(3))
    # A state the product cannot reach: a double call, then ten days pass for it.
    forge(clean, old, "sent", "sent", "sent", ref="ch_old")
    elapse(clean, 10 * 24 * 3600, [old, old_but_claimed])
    settle(clean, old_but_claimed, "pending", "retry")  # written long ago, claimed today
    assert recent

    code, data = run_audit(clean, capsys, "--since", "24h")
    assert code == 0
    assert data["totals"]["messages"] == 2 and data["since"] is not None

    since = (datetime.now(UTC) - timedelta(days=30)).isoformat()
    code, data = run_audit(clean, capsys, "--since", since)
    assert code == 1 and data["totals"]["messages"] == 3

    assert main(["audit", "--since", "last tuesday", "--database-url", clean.database_url]) == 2
    assert "--since" in capsys.readouterr().err


def test_python_api_returns_a_report_the_cli_renders(clean, engine):
    from outbox.cli.render import render

    settle(clean, write(engine, "order:1"), "sent", "sent", ref="ch_1")
    with engine.connect() as conn:
        report = audit(conn)
        recent = audit(conn, since=timedelta(hours=1))
    assert isinstance(report, AuditReport) and report.ok
    assert report.destinations["payments.charge"].confirmed_calls == 1
    assert recent.totals.messages == 1
    text = render(report)
    assert "payments.charge" in text and "confirmed calls" in text and "OK: no violation" in text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("24h", datetime(2025, 1, 1, tzinfo=UTC)),
        ("2025-01-01T12:00:00+02:00", datetime(2025, 1, 1, 10, tzinfo=UTC)),
        ("2025-01-01T12:00:00", datetime(2025, 1, 1, 12, tzinfo=UTC)),
    ],
)
def test_parse_since(raw, expected):
    assert parse_since(raw, now=datetime(2025, 1, 2, tzinfo=UTC)) == expected
