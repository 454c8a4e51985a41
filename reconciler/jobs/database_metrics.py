"""Read the rows' counts and ages for the metrics, in the one reconciler holding this job's lock:
N replicas serving ``/metrics`` do not all query the table (:mod:`outbox.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox import metrics

#: A reading is exported for this many reconcile intervals, then dropped: a reconciler that lost
#: the lock (another took it) must not export numbers that no longer move.
FRESH_FOR_INTERVALS = 3


@dataclass
class DatabaseMetrics:
    interval_seconds: float
    #: The handlers' destinations: exported (with zeros) even when none of their rows waits.
    destinations: tuple[str, ...] = ()
    name: ClassVar[str] = "database_metrics"
    #: One reconciler reads for good (until it stops): the others skip, and export nothing.
    keep_lock: ClassVar[bool] = True

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        reading = metrics.read_database(conn)
        reading.destinations = sorted(set(self.destinations) | {d for d, _ in reading.rows})
        metrics.DATABASE.update(reading, fresh_for_seconds=FRESH_FOR_INTERVALS * self.interval_seconds)
        return {}  # quiet: a reading every interval is not news
