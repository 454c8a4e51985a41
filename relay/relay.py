"""Claim due `pending` rows in batches, publish them in one Redis pipeline, mark them `dispatched`.

The UPDATE, the publish and the COMMIT happen in that order inside one transaction, so a row is
never `dispatched` unless its publish succeeded: a crash between publish and commit leaves it
`pending` and it is published again (consumers make that harmless); nothing is lost.
Several relays share the load through ``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

from outbox import transport
from outbox.db import connect_raw
from outbox.schema import NOTIFY_CHANNEL

logger = logging.getLogger(__name__)

_CLAIM_BATCH = """
WITH due AS (
    SELECT id FROM outbox_message
    WHERE state = 'pending' AND available_at <= now()
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_message m
SET state = 'dispatched', dispatched_at = now()
FROM due
WHERE m.id = due.id
RETURNING m.id, m.destination, m.dispatched_at
"""

_MAX_RECONNECT_DELAY_SECONDS = 10.0


@dataclass
class BatchResult:
    published: int = 0
    by_destination: Counter[str] = field(default_factory=Counter)


class Relay:
    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str,
        namespace: str = "outbox",
        batch_size: int = 1000,
        poll_interval_seconds: float = 1.0,
    ) -> None:
        self.database_url = database_url
        self.redis_url = redis_url
        self.namespace = namespace
        self.batch_size = batch_size
        self.poll_interval_seconds = poll_interval_seconds
        self._conn: psycopg.Connection[Any] | None = None
        self._listen: psycopg.Connection[Any] | None = None
        self._redis: redis.Redis | None = None

    # -- connections ---------------------------------------------------------------------------

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect_raw(self.database_url)
        return self._conn

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = transport.connect(self.redis_url, socket_timeout=10, socket_connect_timeout=5)
        return self._redis

    def close(self) -> None:
        for conn in (self._conn, self._listen):
            if conn is not None and not conn.closed:
                conn.close()
        self._conn = self._listen = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    # -- one batch -----------------------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Claim, publish and commit one batch; returns what was published."""
        conn = self.conn
        result = BatchResult()
        try:
            with conn.transaction():
                rows = conn.execute(_CLAIM_BATCH, {"limit": self.batch_size}).fetchall()
                if rows:
                    transport.publish(
                        self.redis,
                        self.namespace,
                        [transport.Publication(r[0], r[1], r[2]) for r in rows],
                    )
        except psycopg.OperationalError:
            self._conn = None  # reconnect next time
            raise
        result.published = len(rows)
        result.by_destination.update(r[1] for r in rows)
        return result

    def drain(self, stop: threading.Event | None = None) -> int:
        """Publish batches while they come back full; returns how many rows went out."""
        total = 0
        while True:
            result = self.run_once()
            total += result.published
            if result.published:
                logger.info(
                    "relay published %s rows",
                    result.published,
                    extra={"published": result.published, "by_destination": dict(result.by_destination)},
                )
            if result.published < self.batch_size or (stop is not None and stop.is_set()):
                return total

    # -- the loop ------------------------------------------------------------------------------

    def _wait_for_notify(self, timeout_seconds: float) -> None:
        if self._listen is None or self._listen.closed:
            self._listen = connect_raw(self.database_url, autocommit=True)
            self._listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
        for _ in self._listen.notifies(timeout=timeout_seconds, stop_after=1):
            pass

    def run_forever(self, stop: threading.Event) -> None:
        """Drain, then sleep until NOTIFY or the poll interval; survive outages with backoff."""
        outage_started: float | None = None
        delay = 0.5
        while not stop.is_set():
            try:
                self.drain(stop)
                if stop.is_set():
                    break
                self._wait_for_notify(self.poll_interval_seconds)
                if outage_started is not None:
                    logger.warning(
                        "relay reconnected after %.1f s",
                        time.monotonic() - outage_started,
                        extra={"outage_seconds": time.monotonic() - outage_started},
                    )
                    outage_started, delay = None, 0.5
            except (psycopg.Error, redis.RedisError, OSError) as exc:
                if outage_started is None:
                    outage_started = time.monotonic()
                    logger.error(
                        "relay cannot reach %s (%s); rows stay pending, retrying with backoff",
                        "Redis" if isinstance(exc, redis.RedisError) else "PostgreSQL",
                        type(exc).__name__,
                        extra={"error": type(exc).__name__},
                    )
                self.close()
                stop.wait(delay)
                delay = min(delay * 2, _MAX_RECONNECT_DELAY_SECONDS)
        self.close()
