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
    name: ClassVar[str] = "database_metrics"

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        metrics.DATABASE.update(
            metrics.read_database(conn), fresh_for_seconds=FRESH_FOR_INTERVALS * self.interval_seconds
        )
        return {}  # quiet: a reading every interval is not news
