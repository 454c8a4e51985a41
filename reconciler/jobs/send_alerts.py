"""Job 5, ``alerts``: each `failed` row, each row `unknown` for too long, and each `sent` row whose
next steps were not all written (outbox.chains), is reported once.

Named ``send_alerts`` beside ``reconciler.alerts``, which defines the hook the alerts go to.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox import chains, settings, transitions
from reconciler import alerts
from reconciler.alerts import AlertHook, AlertRow, log_alert

from ._common import _nonzero, _require_autocommit

logger = logging.getLogger(__name__)

DEFAULT_ALERT_BATCH = 100

#: The alert state of a confirmed row whose next steps were not all written (outbox.chains).
CHAIN_BROKEN = "chain_broken"

# A sent row whose next steps were not all written (outbox.chains) is alerted once too, found by
# its own partial index (outbox_message_chain_problem_idx).
_ALERTABLE = """
(SELECT id, key, step, destination, state, last_error,
        EXTRACT(EPOCH FROM now() - created_at) AS age,
        EXTRACT(EPOCH FROM now() - unknown_since) AS unknown_for, chain_problem
 FROM outbox_message
 WHERE alerted_at IS NULL
   AND (state = 'failed'
        OR (state = 'unknown' AND unknown_since < now() - %(after)s * interval '1 second')))
UNION ALL
(SELECT id, key, step, destination, state, last_error,
        EXTRACT(EPOCH FROM now() - created_at), NULL, chain_problem
 FROM outbox_message
 WHERE chain_problem IS NOT NULL AND alerted_at IS NULL AND state = 'sent'
   -- The `chains` job computes those (outbox.chains.NOT_COMPUTED).
   AND chain_problem <> %(uncomputed)s)
ORDER BY id
LIMIT %(limit)s
"""


def send_alerts(
    conn: psycopg.Connection[Any],
    hook: AlertHook = log_alert,
    *,
    unknown_alert_after_seconds: float,
    batch_size: int = DEFAULT_ALERT_BATCH,
) -> dict[str, int]:
    """Report each newly `failed` row, and each row `unknown` for longer than
    ``unknown_alert_after_seconds``, once, through ``hook``; then mark it ``alerted_at``.

    The hook runs before the mark: a crash in between repeats an alert rather than losing it.
    A hook that raises leaves the row unmarked, so it is reported again next run.
    Counts: ``alerts``, ``hook_errors``, ``raced``.
    """
    _require_autocommit(conn, "alerts")
    counts: Counter[str] = Counter()
    rows = conn.execute(
        _ALERTABLE,
        {"after": float(unknown_alert_after_seconds), "limit": batch_size, "uncomputed": chains.NOT_COMPUTED},
    ).fetchall()
    for row_id, key, step, destination, state, last_error, age, unknown_for, chain_problem in rows:
        reason = last_error or "no reason recorded"
        if state == "unknown":
            reason = f"outcome unknown for {float(unknown_for):.0f} s: {reason}"
        if state == "sent":
            reason = f"confirmed, but its next steps were not all written: {chain_problem}"
        elif chain_problem:
            reason = f"{reason}; its compensation was not all written: {chain_problem}"
        alert = AlertRow(
            id=row_id,
            key=key,
            step=step,
            destination=destination,
            state=CHAIN_BROKEN if state == "sent" else state,
            reason=reason,
            age=float(age),
        )
        sent = alerts.send(
            hook, alert, about=f"outbox row {row_id}", extra={"outbox_id": row_id, "destination": destination}
        )
        if not sent:
            counts["hook_errors"] += 1
            continue
        marked = transitions.mark_alerted(conn, row_id=row_id, state=state)
        counts["alerts" if marked else "raced"] += 1
    return _nonzero(counts)


@dataclass(frozen=True)
class SendAlertsConfig:
    unknown_alert_after_seconds: float = settings.DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS
    batch_size: int = DEFAULT_ALERT_BATCH


@dataclass(frozen=True)
class SendAlerts:
    name: ClassVar[str] = "alerts"
    config: SendAlertsConfig
    hook: AlertHook = log_alert

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return send_alerts(
            conn,
            self.hook,
            unknown_alert_after_seconds=self.config.unknown_alert_after_seconds,
            batch_size=self.config.batch_size,
        )
