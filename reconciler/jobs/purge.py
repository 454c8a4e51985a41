"""Job 4, ``purge``: old `sent` and `cancelled` rows move into the key ledger; old ledger entries
are dropped; finished batches lose their then/catch payloads at the retention and their rows at
the ledger horizon."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal

import psycopg

from outbox import settings, store
from outbox.db import can_see_all_transactions, require_autocommit

logger = logging.getLogger(__name__)

#: `DELETE … LIMIT` batches: each one is a short transaction that holds few row locks.
PURGE_BATCH = 1000
DEFAULT_PURGE_MAX_BATCHES = 20

#: The purge's count when it refused to run for want of the privilege above.
PURGE_SKIPPED_NO_PRIVILEGE = "skipped_no_stats_privilege"


#: Ledger entries dropped per statement (narrow rows: a larger batch than the purge's).
LEDGER_DROP_BATCH = 5000
#: Finished batches (``outbox.batch``) thinned or dropped per statement: as many as rows purged.
BATCH_PURGE_PAGE = PURGE_BATCH


#: Seconds a reconciler resumes its purge and ledger drop where its previous statements ended
#: before it starts once more from the oldest row: the longest a row left behind (its chain
#: repaired, its batch finished after newer rows went) waits past its retention or horizon.
FLOOR_RESET_SECONDS = 600.0


@dataclass
class Floors:
    """Where this process's purge and ledger drop resume: the newest ``completed_at`` each has
    removed. Deleted rows stay in the ``completed_at`` indexes as dead entries until a vacuum, and
    an oldest-first scan from the start steps over every one of them: on a ledger vacuumed at
    autovacuum's default 20 %, millions a statement. A floor only narrows a statement, so a row
    it leaves out goes at the next reset, never early; every ``FLOOR_RESET_SECONDS`` the floors
    go back to the oldest row."""

    message: datetime | None = None
    ledger: datetime | None = None
    reset_at: float = field(default_factory=lambda: time.monotonic() + FLOOR_RESET_SECONDS)

    def sweep(
        self,
        which: Literal["message", "ledger"],
        statement: Callable[[datetime | None], store.recovery.Swept],
    ) -> int:
        """Run ``statement`` from floor ``which`` and move that floor to the newest row it removed:
        how many it removed."""
        swept = statement(getattr(self, which))
        if swept.newest is not None:
            setattr(self, which, swept.newest)
        return swept.count

    def expire(self, now: float | None = None) -> None:
        """Back to the oldest row once ``FLOOR_RESET_SECONDS`` have passed since the last reset."""
        now = time.monotonic() if now is None else now
        if now >= self.reset_at:
            self.message = self.ledger = None
            self.reset_at = now + FLOOR_RESET_SECONDS


def _sweep(
    floors: Floors | None,
    which: Literal["message", "ledger"],
    statement: Callable[[datetime | None], store.recovery.Swept],
) -> int:
    """``statement`` from the floor when there are floors, else from the oldest row."""
    return floors.sweep(which, statement) if floors is not None else statement(None).count


def _batches(run: Callable[[], int], max_batches: int, batch: int) -> tuple[int, int]:
    total = batches = 0
    for _ in range(max_batches):
        done = run()
        if done <= 0:
            break
        batches += 1
        total += done
        if done < batch:
            break
    return total, batches


def purge(
    conn: psycopg.Connection[Any],
    *,
    retention_seconds: float,
    ledger_horizon_seconds: float | None = None,
    max_batches: int = DEFAULT_PURGE_MAX_BATCHES,
    floors: Floors | None = None,
) -> dict[str, int]:
    """Move `sent` and `cancelled` rows completed more than ``retention_seconds`` ago into the key
    ledger (their attempt rows cascade), at most ``max_batches`` batches of 1000 per run; `failed`
    rows stay until a human replays them. Then drop ledger entries completed more than
    ``ledger_horizon_seconds`` ago (None: keep them). Finished batches (``outbox.batch``) with no
    member left go the same way: their then/catch payloads at the retention, their rows at the
    horizon (never with None). Counts: ``purged``, ``batches`` (statements that moved rows),
    ``ledger_dropped``, ``batches_stripped``, ``batches_dropped``.

    A role that is neither superuser nor a member of ``pg_read_all_stats`` (or ``pg_monitor``)
    cannot see other roles' open transactions, so it cannot hold rows back for them: the purge
    then moves nothing, logs an error and counts ``skipped_no_stats_privilege``.

    ``floors``: where the previous run's statements ended (:class:`Floors`), kept by the caller
    between runs; None starts from the oldest row every time."""
    require_autocommit(conn, "purge")
    if floors is not None:
        floors.expire()

    def move() -> int:
        return _sweep(
            floors,
            "message",
            lambda after: store.recovery.purge(
                conn, retention_seconds=retention_seconds, limit=PURGE_BATCH, after=after
            ),
        )

    counts: dict[str, int] = {}
    if can_see_all_transactions(conn):
        purged, batches = _batches(move, max_batches, PURGE_BATCH)
        if purged:
            counts = {"purged": purged, "batches": batches}
    else:
        role = conn.execute("SELECT current_user").fetchone()
        logger.error(
            "purge skipped: role %s can see neither other roles' open transactions nor whether an "
            "old REPEATABLE READ snapshot could write a purged key again; run "
            "GRANT pg_read_all_stats TO %s (or pg_monitor), or run the reconciler as a superuser",
            role[0] if role else "?",
            role[0] if role else "?",
            extra={"job": "purge", "error": PURGE_SKIPPED_NO_PRIVILEGE},
        )
        counts[PURGE_SKIPPED_NO_PRIVILEGE] = 1
    # No privilege needed: a snapshot older than the statement finds the batch as it was, and a
    # name freed at the horizon is new by definition.
    stripped, _ = _batches(
        lambda: store.recovery.strip_batches(
            conn, retention_seconds=retention_seconds, limit=BATCH_PURGE_PAGE
        ),
        max_batches,
        BATCH_PURGE_PAGE,
    )
    if stripped:
        counts["batches_stripped"] = stripped
    if ledger_horizon_seconds is not None:
        # Never shorter than the retention: an entry must outlive the row it stands for.
        horizon = max(float(ledger_horizon_seconds), float(retention_seconds))

        def drop_ledger(resume: bool) -> int:
            dropped, _ = _batches(
                lambda: _sweep(
                    floors if resume else None,
                    "ledger",
                    lambda after: store.recovery.drop_ledger(
                        conn, horizon_seconds=horizon, limit=LEDGER_DROP_BATCH, after=after
                    ),
                ),
                max_batches,
                LEDGER_DROP_BATCH,
            )
            return dropped

        dropped = drop_ledger(resume=True)
        # After the ledger: a batch waits for its then/catch row's entry to go; its members'
        # entries, held by it, go right after it, from the oldest: they may lie behind the floor.
        gone, _ = _batches(
            lambda: store.recovery.drop_batches(conn, horizon_seconds=horizon, limit=BATCH_PURGE_PAGE),
            max_batches,
            BATCH_PURGE_PAGE,
        )
        if gone:
            counts["batches_dropped"] = gone
            dropped += drop_ledger(resume=False)
        if dropped:
            counts["ledger_dropped"] = dropped
    return counts


@dataclass(frozen=True)
class PurgeConfig:
    retention_seconds: float = settings.DEFAULT_RETENTION_SECONDS
    #: None keeps ledger entries for ever.
    ledger_horizon_seconds: float | None = settings.DEFAULT_LEDGER_HORIZON_SECONDS
    max_batches: int = DEFAULT_PURGE_MAX_BATCHES


@dataclass(frozen=True)
class Purge:
    name: ClassVar[str] = "purge"
    config: PurgeConfig
    floors: Floors = field(default_factory=Floors, compare=False)

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return purge(
            conn,
            retention_seconds=self.config.retention_seconds,
            ledger_horizon_seconds=self.config.ledger_horizon_seconds,
            max_batches=self.config.max_batches,
            floors=self.floors,
        )
