"""Job 3, ``redispatch``: `dispatched` rows whose message is lost go back to `pending`."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import psycopg
import redis

from outbox import settings, store, transport
from outbox.db import require_autocommit
from outbox.handlers import Handler
from outbox.schema import NOTIFY_CHANNEL

from .common import nonzero

logger = logging.getLogger(__name__)

#: A `dispatched` row younger than this is not examined: its publication may not be visible
#: everywhere yet, and it costs nothing to look again next run.
DEFAULT_REDISPATCH_GRACE_SECONDS = 5.0
DEFAULT_REDISPATCH_BATCH = 1000
DEFAULT_REDISPATCH_MAX_BATCHES = 50


# Keyset pagination, so that rows left alone (a healthy backlog) are not read again and again.
# A paused destination's rows are left alone (outbox.pauses), and those of a destination whose
# breaker is open (outbox.breaker): a worker acked their messages without a claim, and
# re-queueing them would only go round again; its first run after the pause ends (the breaker
# closes) re-queues them all. A half-open breaker gets one row (_PROBES).
_DISPATCHED = """
SELECT id, destination, dispatched_at,
       dispatched_at < now() - %(stale)s * interval '1 second' AS stale
FROM outbox_message m
WHERE state = 'dispatched'
  AND dispatched_at < now() - %(grace)s * interval '1 second'
  AND NOT EXISTS (SELECT 1 FROM outbox_destination p
                  WHERE p.destination = m.destination
                    AND (p.paused_until > now() OR p.breaker_opened_at IS NOT NULL))
  AND (CAST(%(after_at)s AS timestamptz) IS NULL
       OR (dispatched_at, id) > (CAST(%(after_at)s AS timestamptz), CAST(%(after_id)s AS bigint)))
ORDER BY dispatched_at, id
LIMIT %(limit)s
"""


# The probe of each half-open breaker with none under way (and no pause): the destination's
# oldest waiting row, re-queued if its message is gone (a worker acked it while the breaker was
# open). One row, not all: the rest would only be acked again while the probe is out.
_PROBES = """
SELECT DISTINCT ON (m.destination) m.id, m.destination, m.dispatched_at, false AS stale
FROM outbox_destination p
JOIN outbox_message m ON m.destination = p.destination AND m.state = 'dispatched'
WHERE p.breaker_opened_at IS NOT NULL AND p.breaker_open_until <= now()
  AND NOT COALESCE(p.breaker_probe_until > now(), false)
  AND NOT COALESCE(p.paused_until > now(), false)
  AND m.dispatched_at < now() - %(grace)s * interval '1 second'
ORDER BY m.destination, m.dispatched_at, m.id
"""


def redispatch(
    conn: psycopg.Connection[Any],
    redis_client: redis.Redis,
    handlers: Mapping[str, Handler],
    *,
    namespace: str,
    redispatch_after_seconds: float,
    module: str = "the handler module",
    grace_seconds: float = DEFAULT_REDISPATCH_GRACE_SECONDS,
    batch_size: int = DEFAULT_REDISPATCH_BATCH,
    max_batches: int = DEFAULT_REDISPATCH_MAX_BATCHES,
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Send `dispatched` rows whose message is gone, or whose message's fate cannot be known,
    back to `pending`, so the relay publishes them again; a re-publication replaces the old
    message, it never adds a copy.

    Where a row's message is, from Dramatiq's Redis layout (its id is deterministic):

    - no body in ``Q.msgs`` → gone (Redis flushed or restarted, dead-lettered): re-queued now
      (``missing``);
    - its id in the queue list ``Q`` → waiting: left alone whatever its age (``waiting``); a
      long queue, or a queue no worker consumes, is not a lost message, and the "no consumer"
      alert (:func:`no_consumer`) is what tells a human about the latter;
    - its body there but its id not in the list: a worker fetched it (it is in that worker's
      ack set) and has not acked it, or only the body survived. Fetched by a live worker
      (Dramatiq heartbeat within 60 s), or younger than ``redispatch_after_seconds`` → left
      alone (``waiting``). Older, and fetched by a dead worker or by none → unknowable: the
      message is removed from Redis (body, list, ack sets) and then the row is re-queued
      (``unacked``).

    A row whose destination has no handler in ``module`` is treated the same and only reported
    (``no_handler``): during a rolling deploy it may belong to a newer (or older) version's
    workers, and re-publishing calls no provider, while failing it would need a replay.
    A destination paused or behind an open breaker is left alone; a half-open breaker's oldest
    waiting row is re-queued to be its probe (``probe``).
    Counts: ``missing``, ``unacked``, ``waiting``, ``raced``, ``no_handler``, ``probe``.
    A Redis error raises: an unreachable Redis never means "the message is gone".
    """
    require_autocommit(conn, "redispatch")
    counts: Counter[str] = Counter()
    orphans: Counter[str] = Counter()
    after_at: datetime | None = None
    after_id = 0
    workers: dict[str, bool] | None = None
    for _ in range(max_batches):
        if stop is not None and stop.is_set():
            break
        rows = conn.execute(
            _DISPATCHED,
            {
                "stale": float(redispatch_after_seconds),
                "grace": float(grace_seconds),
                "after_at": after_at,
                "after_id": after_id,
                "limit": batch_size,
            },
        ).fetchall()
        if not rows:
            break
        after_at, after_id = rows[-1][2], rows[-1][0]

        orphans.update(destination for _, destination, _, _ in rows if destination not in handlers)
        missing, unacked, workers = _lost(redis_client, namespace, rows, workers)
        moved_missing = store.recovery.requeue(conn, missing)
        moved_unacked = store.recovery.requeue(conn, unacked)
        counts["missing"] += moved_missing
        counts["unacked"] += moved_unacked
        counts["waiting"] += len(rows) - len(missing) - len(unacked)
        counts["raced"] += len(missing) - moved_missing + len(unacked) - moved_unacked
        if len(rows) < batch_size:
            break
    probes = conn.execute(_PROBES, {"grace": float(grace_seconds)}).fetchall()
    if probes:
        missing, _, workers = _lost(redis_client, namespace, probes, workers)
        counts["probe"] += store.recovery.requeue(conn, missing)
    _report_orphans(orphans, module, counts)
    if counts["missing"] or counts["unacked"] or counts["probe"]:
        # The relay sleeps until NOTIFY or its poll interval; wake it for the re-queued rows.
        conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))
    return nonzero(counts)


def _lost(
    redis_client: redis.Redis, namespace: str, rows: list[Any], workers: dict[str, bool] | None
) -> tuple[list[tuple[int, datetime]], list[tuple[int, datetime]], dict[str, bool] | None]:
    """A batch's rows whose message is gone (``missing``) and those whose message's fate cannot be
    known (``unacked``, removed from Redis here), with the broker's workers once they were read
    (read at most once per run)."""
    mids = [transport.message_id(row_id, at) for row_id, _, at, _ in rows]
    present = transport.messages_present(
        redis_client, namespace, ((r[1], mid) for r, mid in zip(rows, mids, strict=True))
    )
    missing = [(r[0], r[2]) for r, p in zip(rows, present, strict=True) if not p]
    # Old enough to ask where its message is: is it still in its queue list?
    old: dict[str, list[tuple[int, datetime, str]]] = {}
    for r, mid, p in zip(rows, mids, present, strict=True):
        if p and r[3]:
            old.setdefault(r[1], []).append((r[0], r[2], mid))
    unacked: list[tuple[int, datetime]] = []
    if old:
        if workers is None:
            workers = transport.broker_workers(redis_client, namespace)
        unacked = _unacked(redis_client, namespace, old, workers)
    return missing, unacked, workers


def _unacked(
    redis_client: redis.Redis,
    namespace: str,
    old: dict[str, list[tuple[int, datetime, str]]],
    workers: dict[str, bool],
) -> list[tuple[int, datetime]]:
    unacked: list[tuple[int, datetime]] = []
    fetched = transport.fetched_ids(redis_client, namespace, old, workers)
    for destination, candidates in old.items():
        held = fetched[destination]
        # Fetched by a live worker: it will run it (its claim fences a duplicate anyway).
        not_fetched = {mid for _, _, mid in candidates if mid not in held}
        absent = (
            transport.queued_ids(redis_client, namespace, destination, not_fetched)[1]
            if not_fetched
            else set()
        )
        gone = [
            c for c in candidates if (c[2] in held and not workers.get(held[c[2]], False)) or c[2] in absent
        ]
        transport.remove_messages(redis_client, namespace, destination, [mid for _, _, mid in gone], workers)
        unacked += [(row_id, at) for row_id, at, _ in gone]
    return unacked


def _report_orphans(orphans: Counter[str], module: str, counts: Counter[str]) -> None:
    for destination, count in sorted(orphans.items()):
        counts["no_handler"] += count
        logger.warning(
            "%s dispatched outbox rows of destination %s: no handler in %s; deploy one (or a worker "
            "for it) — they wait in their queue, never failed by this reconciler",
            count,
            destination,
            module,
            extra={
                "destination": destination,
                "rows": count,
                "handlers_module": module,
                "_shown": ("rows", "handlers_module"),
            },
        )


@dataclass(frozen=True)
class RedispatchConfig:
    #: A `dispatched` row whose message a worker fetched and never acked is re-queued after this.
    redispatch_after_seconds: float = settings.DEFAULT_REDISPATCH_AFTER_SECONDS
    grace_seconds: float = DEFAULT_REDISPATCH_GRACE_SECONDS
    batch_size: int = DEFAULT_REDISPATCH_BATCH
    max_batches: int = DEFAULT_REDISPATCH_MAX_BATCHES


@dataclass(frozen=True)
class Redispatch:
    name: ClassVar[str] = "redispatch"
    config: RedispatchConfig
    #: Called at each run: the reconciler opens its Redis client on first use.
    redis_client: Callable[[], redis.Redis]
    handlers: Mapping[str, Handler]
    namespace: str
    module: str
    stop: threading.Event | None = None

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return redispatch(
            conn,
            self.redis_client(),
            self.handlers,
            namespace=self.namespace,
            redispatch_after_seconds=self.config.redispatch_after_seconds,
            module=self.module,
            grace_seconds=self.config.grace_seconds,
            batch_size=self.config.batch_size,
            max_batches=self.config.max_batches,
            stop=self.stop,
        )
