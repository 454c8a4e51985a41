"""Job 5, ``alerts``: each `failed` row, each row `unknown` for too long, and each `sent` row whose
next steps were not all written (outbox.chains), is reported once.

Named ``send_alerts`` beside ``outbox.alerts``, which defines the hook the alerts go to.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox import alerts, chains, settings, store
from outbox.alerts import AlertHook, AlertRow, log_alert
from outbox.db import require_autocommit

from .common import nonzero

logger = logging.getLogger(__name__)

DEFAULT_ALERT_BATCH = 100

#: The alert state of a confirmed row whose next steps were not all written (outbox.chains).
CHAIN_BROKEN = "chain_broken"

# A sent row whose next steps were not all written (outbox.chains) is alerted once too, found by
# its own partial index (outbox_message_chain_problem_idx). The alert says what the outbox knows
# of the row (its last attempt's outcome and HTTP status, a passed deadline), never the
# provider's text (outbox.alerts): last_error only when the reconciler wrote it.
_ALERTABLE = """
(SELECT m.id, m.key, m.step, m.destination, m.state, m.attempts, m.last_error,
        EXTRACT(EPOCH FROM now() - m.created_at) AS age,
        EXTRACT(EPOCH FROM now() - m.unknown_since) AS unknown_for, m.chain_problem,
        m.deadline IS NOT NULL AND m.deadline <= COALESCE(m.completed_at, now()) AS past_deadline
 FROM outbox_message m
 WHERE m.alerted_at IS NULL
   AND (m.state = 'failed'
        OR (m.state = 'unknown' AND m.unknown_since < now() - %(after)s * interval '1 second')))
UNION ALL
(SELECT m.id, m.key, m.step, m.destination, m.state, m.attempts, NULL,
        EXTRACT(EPOCH FROM now() - m.created_at), NULL, m.chain_problem, false
 FROM outbox_message m
 WHERE m.chain_problem IS NOT NULL AND m.alerted_at IS NULL AND m.state = 'sent'
   -- The `chains` job computes those (outbox.chains.NOT_COMPUTED).
   AND m.chain_problem <> %(uncomputed)s)
ORDER BY id
LIMIT %(limit)s
"""

# The last attempt that recorded an outcome, and the last HTTP status the provider answered.
_LAST_ATTEMPT = """
SELECT (SELECT outcome FROM outbox_attempt WHERE message_id = %(id)s AND outcome IS NOT NULL
        ORDER BY attempt DESC, id DESC LIMIT 1),
       (SELECT http_status FROM outbox_attempt WHERE message_id = %(id)s AND http_status IS NOT NULL
        ORDER BY attempt DESC, id DESC LIMIT 1)
"""


#: The reasons the reconciler parks an unknown row with (outbox.settlement): its
#: own words, names and numbers, which an alert repeats whole. Any other last_error is a
#: provider's or a handler's text.
OWN_REASONS = ("needs a human:", "lookup answer could not be recorded")


def _reason(
    row_id: int,
    state: str,
    attempts: int,
    last_error: str | None,
    *,
    unknown_for: float | None,
    past_deadline: bool,
    outcome: str | None,
    http_status: int | None,
) -> str:
    """What the alert says of a failed or unknown row, in the outbox's own words."""
    what = "failed" if state == "failed" else f"outcome unknown for {float(unknown_for or 0):.0f} s"
    said = [f"{what} after {attempts} attempt(s)"]
    if past_deadline:
        said.append("its deadline passed")
    if http_status is not None:
        said.append(f"last answer HTTP {http_status}")
    elif outcome:
        said.append(f"last attempt {outcome}")
    if last_error and last_error.startswith(OWN_REASONS):
        return f"{', '.join(said)}; {last_error}"
    return f"{', '.join(said)}; {alerts.WITHHELD}: outbox show {row_id}"


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
    require_autocommit(conn, "alerts")
    counts: Counter[str] = Counter()
    rows = conn.execute(
        _ALERTABLE,
        {"after": float(unknown_alert_after_seconds), "limit": batch_size, "uncomputed": chains.NOT_COMPUTED},
    ).fetchall()
    for (
        row_id,
        key,
        step,
        destination,
        state,
        attempts,
        last_error,
        age,
        unknown_for,
        chain_problem,
        past,
    ) in rows:
        outcome, http_status = conn.execute(_LAST_ATTEMPT, {"id": row_id}).fetchone() or (None, None)
        if state == "sent":
            reason = f"confirmed, but its next steps were not all written: {chain_problem}"
        else:
            reason = _reason(
                row_id,
                state,
                attempts,
                last_error,
                unknown_for=unknown_for,
                past_deadline=past,
                outcome=outcome,
                http_status=http_status,
            )
            if chain_problem:
                # The chain's problem is the outbox's own account (which step, which function).
                reason = f"{reason}; its compensation was not all written: {chain_problem}"
        alert = AlertRow(
            id=row_id,
            key=key,
            step=step,
            destination=destination,
            state=CHAIN_BROKEN if state == "sent" else state,
            reason=reason,
            age=float(age),
            http_status=http_status,
        )
        sent = alerts.send(
            hook, alert, about=f"outbox row {row_id}", extra={"outbox_id": row_id, "destination": destination}
        )
        if not sent:
            counts["hook_errors"] += 1
            continue
        marked = store.recovery.mark_alerted(conn, row_id=row_id, state=state)
        counts["alerts" if marked else "raced"] += 1
    return nonzero(counts)


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
