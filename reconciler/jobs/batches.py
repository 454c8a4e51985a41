"""Job 9, ``batches``: every open batch whose members are all terminal is finished, its ``then``
row (no member failed) or ``catch`` row (any failed) written by the same guarded statement
(:func:`outbox.store.recovery.finish_batch`; :mod:`outbox.batches`).

A sweep rather than a counter bumped by each member's settling statement: the members' own
statements (record, lookup, resolve, cancel, …) stay as they are, and two last members that
settle at the same moment cannot each see the other still open and leave the finishing to
nobody: the next run sees both. The pre-selection reads the batch index of 0015 (a few probes a
batch, whatever its size); the finishing statement re-checks everything under its locks. Pages
of batches follow each other within a run until one comes back short or the time budget is
spent, so a steady stream of batches is not capped at one page per interval.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psycopg

from outbox import alerts, store
from outbox.alerts import AlertHook, AlertRow, log_alert
from outbox.db import require_autocommit
from outbox.handlers import Handler
from outbox.settings import DEFAULT_TIME_LIMIT_SECONDS, default_lease_seconds

from .common import nonzero

logger = logging.getLogger(__name__)

#: The alert state of a batch that finished without the row it declares (its key and step existed).
BATCH_BROKEN = "batch_broken"

DEFAULT_BATCHES_PAGE = 100
DEFAULT_BATCHES_BUDGET_SECONDS = 5.0

# Held batches (a failed member within its late-record wait) are left out of the page: tried
# again first at every run, they would starve the finishable ones behind them.
_DONE = f"""
SELECT b.id, b.name FROM outbox_batch b
WHERE b.finished_at IS NULL AND b.id > %(after)s
  AND NOT EXISTS (SELECT 1 FROM outbox_message m
                  WHERE m.batch_id = b.id AND m.state IN ('pending', 'dispatched', 'in_flight', 'unknown'))
  AND NOT EXISTS ({store.recovery.LATE_RECORD_SQL})
ORDER BY b.id
LIMIT %(limit)s
"""


def late_record_seconds(handlers: Mapping[str, Handler]) -> dict[str, float]:
    """How long after its claim a worker may still record a row's answer, per destination: its
    lease and its time_limit."""
    return {d: h.lease_seconds + h.time_limit for d, h in handlers.items()}


def late_record_default_seconds(handlers: Mapping[str, Handler]) -> float:
    """The same for a destination the module does not know: the longest of the module's, and
    never less than a default handler's."""
    default = default_lease_seconds(DEFAULT_TIME_LIMIT_SECONDS) + DEFAULT_TIME_LIMIT_SECONDS
    return max([default, *late_record_seconds(handlers).values()])


def finish_batches(
    conn: psycopg.Connection[Any],
    *,
    page_size: int = DEFAULT_BATCHES_PAGE,
    time_budget_seconds: float = DEFAULT_BATCHES_BUDGET_SECONDS,
    late_record_after_seconds: Mapping[str, float] | None = None,
    late_record_default_seconds: float = 0.0,
    alert_hook: AlertHook | None = None,
) -> dict[str, int]:
    """Finish the batches whose members are all terminal, page after page within the budget; a
    batch with a failed member claimed less than its destination's ``late_record_after_seconds``
    (else ``late_record_default_seconds``) ago waits (its worker may still record a late answer)
    and is not selected. Counts: ``then``, ``catch`` (batches finished each way), ``written``
    (then/catch rows written), ``problems`` (finished, its row not written: its key and step
    exist; alerted once through ``alert_hook``, default :func:`~outbox.alerts.log_alert`, as
    state ``batch_broken``: ``alerts``), ``raced`` (finished by someone else meanwhile, or a
    member re-opened)."""
    require_autocommit(conn, "batches")
    counts: Counter[str] = Counter()
    started = time.monotonic()
    after = 0
    late = {
        "late_record": json.dumps(dict(late_record_after_seconds or {})),
        "late_record_default": late_record_default_seconds,
    }
    while True:
        page = conn.execute(_DONE, {"limit": page_size, "after": after, **late}).fetchall()
        for batch_id, name in page:
            after = batch_id
            done = store.recovery.finish_batch(
                conn,
                batch_id=batch_id,
                late_record_seconds=late_record_after_seconds,
                late_record_default_seconds=late_record_default_seconds,
            )
            if done is None:
                counts["raced"] += 1
                continue
            outcome, written, problem = done.outcome, done.written_id, done.problem
            counts[outcome] += 1
            counts["written"] += written is not None
            if problem:
                counts["problems"] += 1
                # Once: the batch finishes once. A hook that raises is logged (alerts.send).
                alert = AlertRow(
                    id=batch_id,
                    key=name,
                    step=done.step or "",
                    destination=done.destination or "",
                    state=BATCH_BROKEN,
                    reason=f"batch finished {outcome}, but {problem}",
                    age=done.age,
                )
                if alerts.send(
                    alert_hook or log_alert, alert, about=f"batch {name}", extra={"outbox_batch": name}
                ):
                    counts["alerts"] += 1
            else:
                logger.info(
                    "outbox batch %s finished: %s%s",
                    name,
                    outcome,
                    f", row {written} written" if written is not None else "",
                    extra={"outbox_batch": name, "outcome": outcome},
                )
        if len(page) < page_size or time.monotonic() - started > time_budget_seconds:
            return nonzero(counts)


@dataclass(frozen=True)
class BatchesConfig:
    page_size: int = DEFAULT_BATCHES_PAGE
    time_budget_seconds: float = DEFAULT_BATCHES_BUDGET_SECONDS


@dataclass(frozen=True)
class Batches:
    name: ClassVar[str] = "batches"
    config: BatchesConfig
    handlers: Mapping[str, Handler] = field(default_factory=dict)
    alert: AlertHook = log_alert

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return finish_batches(
            conn,
            page_size=self.config.page_size,
            time_budget_seconds=self.config.time_budget_seconds,
            late_record_after_seconds=late_record_seconds(self.handlers),
            late_record_default_seconds=late_record_default_seconds(self.handlers),
            alert_hook=self.alert,
        )
