"""Job 9, ``batches``: every open batch whose members are all terminal is finished, its ``then``
row (no member failed) or ``catch`` row (any failed) written by the same guarded statement
(:func:`outbox.transitions.finish_batch`; issue 14, :mod:`outbox.batches`).

A sweep rather than a counter bumped by each member's settling statement: the members' own
statements (record, lookup, resolve, cancel, …) stay as they are, and two last members that
settle at the same moment cannot each see the other still open and leave the finishing to
nobody: the next run sees both. The pre-selection reads the batch index of 0015 (a few probes a
batch, whatever its size); the finishing statement re-checks everything under its locks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox import transitions

from ._common import _nonzero, _require_autocommit

logger = logging.getLogger(__name__)

DEFAULT_BATCHES_BATCH = 100

_DONE = """
SELECT b.id, b.name FROM outbox_batch b
WHERE b.finished_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM outbox_message m
                  WHERE m.batch_id = b.id AND m.state IN ('pending', 'dispatched', 'in_flight', 'unknown'))
ORDER BY b.id
LIMIT %(limit)s
"""


def finish_batches(
    conn: psycopg.Connection[Any], *, batch_size: int = DEFAULT_BATCHES_BATCH
) -> dict[str, int]:
    """Finish up to ``batch_size`` batches whose members are all terminal. Counts: ``then``,
    ``catch`` (batches finished each way), ``written`` (then/catch rows written), ``raced``
    (finished by someone else meanwhile, or a member re-opened)."""
    _require_autocommit(conn, "batches")
    counts: Counter[str] = Counter()
    for batch_id, name in conn.execute(_DONE, {"limit": batch_size}).fetchall():
        done = transitions.finish_batch(conn, batch_id=batch_id)
        if done is None:
            counts["raced"] += 1
            continue
        outcome, written = done
        counts[outcome] += 1
        counts["written"] += written is not None
        logger.info(
            "outbox batch %s finished: %s%s",
            name,
            outcome,
            f", row {written} written" if written is not None else "",
            extra={"outbox_batch": name, "outcome": outcome},
        )
    return _nonzero(counts)


@dataclass(frozen=True)
class BatchesConfig:
    batch_size: int = DEFAULT_BATCHES_BATCH


@dataclass(frozen=True)
class Batches:
    name: ClassVar[str] = "batches"
    config: BatchesConfig

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return finish_batches(conn, batch_size=self.config.batch_size)
