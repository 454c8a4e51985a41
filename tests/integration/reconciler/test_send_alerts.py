"""``send_alerts`` (the ``alerts`` job) against real PostgreSQL."""

from __future__ import annotations

import logging

from helpers import elapse

from outbox import transitions
from reconciler import AlertRow
from reconciler.jobs.send_alerts import send_alerts

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
    assert transitions.mark_alerted(db, row_id=ids[3], state="failed")
    make_unknown(db, ids[1])
    make_unknown(db, ids[2])
    elapse(db, 7200, [ids[1]])

    seen: list[AlertRow] = []
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {"alerts": 2}
    assert [(a.id, a.key, a.step, a.destination, a.state) for a in seen] == [
        (ids[0], "order:0", "charge", DEST, "failed"),
        (ids[1], "order:1", "charge", DEST, "unknown"),
    ]
    assert seen[0].reason == "card declined"
    assert seen[1].reason.startswith("outcome unknown for 7200 s: ReadTimeout")
    assert all(a.age >= 0 for a in seen)
    assert get(db, ids[0])["alerted_at"] is not None
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {}
    assert len(seen) == 2

    # A broken hook loses nothing: the row is reported again once the hook works.
    # A state built directly, no product move leads back to it: ids[0] as if never reported.
    db.execute("UPDATE outbox_message SET alerted_at = NULL WHERE id = %s", (ids[0],))

    def broken(row: AlertRow) -> None:
        raise RuntimeError("pager down")

    with caplog.at_level(logging.ERROR, logger="reconciler"):
        assert send_alerts(db, broken, unknown_alert_after_seconds=3600) == {"hook_errors": 1}
        assert get(db, ids[0])["alerted_at"] is None
        # The default hook: one ERROR line naming the row, never the payload.
        assert send_alerts(db, unknown_alert_after_seconds=3600) == {"alerts": 1}
    line = [r for r in caplog.records if r.name == "reconciler.alerts"][-1]
    assert line.levelno == logging.ERROR
    assert "order:0:charge on payments.charge is failed: card declined" in line.getMessage()
    assert "4242" not in caplog.text and "amount_cents" not in caplog.text
