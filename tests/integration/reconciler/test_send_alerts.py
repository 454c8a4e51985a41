"""``send_alerts`` (the ``alerts`` job) against real PostgreSQL."""

from __future__ import annotations

import logging

from helpers import elapse

from outbox import store
from outbox.alerts import MAX_REASON_CHARS, log_alert
from outbox.reconciler import AlertRow
from outbox.reconciler.jobs.send_alerts import send_alerts

from .support import (
    DEST,
    get,
    make_unknown,
    settle,
    write_rows,
)

# -- 5. alerts -------------------------------------------------------------------------------------


def test_alerts_report_failed_and_long_unknown_rows_once(clean, engine, db, caplog):
    ids = write_rows(engine, 4)
    for row_id in (ids[0], ids[3]):
        settle(db, row_id, "failed", error="card declined")
    assert store.recovery.mark_alerted(db, row_id=ids[3], state="failed")
    make_unknown(db, ids[1])
    make_unknown(db, ids[2])
    elapse(db, 7200, [ids[1]])

    seen: list[AlertRow] = []
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {"alerts": 2}
    assert [(a.id, a.key, a.step, a.destination, a.state) for a in seen] == [
        (ids[0], "order:0", "charge", DEST, "failed"),
        (ids[1], "order:1", "charge", DEST, "unknown"),
    ]
    assert seen[0].reason.startswith(
        "failed after 1 attempt(s), last attempt failed; its error text is withheld"
    )
    assert seen[1].reason.startswith("outcome unknown for 7200 s after 1 attempt(s), last attempt unknown; ")
    assert "card declined" not in seen[0].reason and "ReadTimeout" not in seen[1].reason
    assert all(a.age >= 0 for a in seen)
    assert get(db, ids[0])["alerted_at"] is not None
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {}
    assert len(seen) == 2

    # A broken hook loses nothing: the row is reported again once the hook works.
    # A state built directly, no product move leads back to it: ids[0] as if never reported.
    db.execute("UPDATE outbox_message SET alerted_at = NULL WHERE id = %s", (ids[0],))

    def broken(row: AlertRow) -> None:
        raise RuntimeError("pager down")

    with caplog.at_level(logging.ERROR, logger="outbox.reconciler"):
        assert send_alerts(db, broken, unknown_alert_after_seconds=3600) == {"hook_errors": 1}
        assert get(db, ids[0])["alerted_at"] is None
        # The default hook: one ERROR line naming the row, never the payload.
        assert send_alerts(db, unknown_alert_after_seconds=3600) == {"alerts": 1}
    line = [r for r in caplog.records if r.name == "outbox.alerts"][-1]
    assert line.levelno == logging.ERROR
    assert "order:0:charge on payments.charge is failed: failed after 1 attempt(s)" in line.getMessage()
    assert "4242" not in caplog.text and "amount_cents" not in caplog.text


def test_an_alert_keeps_the_class_and_the_status_never_the_providers_text(clean, engine, db, caplog):
    """A provider's answer often echoes the request: an alert (a chat room, a ticket) carries the
    row's state, attempts and last HTTP status, and points at `outbox show` for the text."""
    ids = write_rows(engine, 2)
    echoed = 'declined: {"email": "alice@example.com", "name": "Alice Liddell", "amount_cents": 1000}'
    claimed = store.delivery.claim(db, row_id=ids[0], destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db,
        row_id=ids[0],
        token=claimed.token,
        state="failed",
        outcome="failed",
        error=echoed,
        http_status=422,
    ).state
    claimed = store.delivery.claim(db, row_id=ids[1], destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db,
        row_id=ids[1],
        token=claimed.token,
        state="unknown",
        outcome="unknown",
        error=f"HTTP 502 from provider: upstream said {echoed}",
        http_status=502,
    ).state
    elapse(db, 7200, [ids[1]])

    seen: list[AlertRow] = []
    with caplog.at_level(logging.ERROR, logger="outbox.reconciler"):
        assert send_alerts(
            db, lambda a: (seen.append(a), log_alert(a)), unknown_alert_after_seconds=3600
        ) == {"alerts": 2}
    failed, unknown = seen
    assert (failed.state, failed.http_status) == ("failed", 422)
    assert failed.reason == (
        "failed after 1 attempt(s), last answer HTTP 422; its error text is withheld from alerts "
        f"(it may echo the payload): outbox show {ids[0]}"
    )
    assert (unknown.state, unknown.http_status) == ("unknown", 502)
    assert unknown.reason.startswith("outcome unknown for 7200 s after 1 attempt(s), last answer HTTP 502; ")
    for leaked in ("alice", "Alice", "Liddell", "declined", "amount_cents"):
        assert leaked not in failed.reason + unknown.reason
        assert leaked not in caplog.text
    # The text stays where access is the database's.
    assert get(db, ids[0])["last_error"] == echoed


def test_every_alert_reason_is_sanitised_and_capped():
    """Whoever builds the AlertRow (a job, a hook's test): card numbers masked, length bounded."""
    row = AlertRow(
        id=1,
        key="k",
        step="s",
        destination="d",
        state="failed",
        reason="card 4111 1111 1111 1111 " * 200,
        age=0,
    )
    assert len(row.reason) == MAX_REASON_CHARS
    assert "4111 1111 1111 1111" not in row.reason and "****1111" in row.reason
