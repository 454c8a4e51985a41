"""Take due `pending` rows in groups, publish them in one Redis pipeline, mark them `dispatched`.

The relay *takes* rows (:func:`outbox.store.relay.dispatch_due`); only a consumer *claims* one.

The UPDATE, the publish and the COMMIT happen in that order inside one transaction, so a row is
never `dispatched` unless its publish succeeded: a crash between publish and commit leaves it
`pending` and it is published again (consumers make that harmless); nothing is lost.
Several relays, and the connections of one relay draining a backlog, share the load through
``FOR UPDATE SKIP LOCKED``.

Waking: one NOTIFY per committed insert statement. A wake-up swallows every NOTIFY already
queued (one take serves them all), and one that comes less than ``gather_seconds`` after the
previous take waits out the rest of that window first: under a stream of one-row commits each
take then carries the rows of a window instead of one row per UPDATE + pipeline + COMMIT, while a
row committed after a quiet spell is taken at once (bench/relay.py (e) shows both sides).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import redis

from outbox import metrics, settings, store, transport, windows
from outbox.db import connect_raw
from outbox.failover import FailoverGuard
from outbox.logs import Tally, first_line
from outbox.probes import Liveness
from outbox.schema import NOTIFY_CHANNEL

logger = logging.getLogger(__name__)

#: Seconds before the rows of a destination Redis refused are tried again.
PUBLISH_RETRY_SECONDS = 10.0
#: One ERROR line per refused destination per this many seconds, however many groups fail.
PUBLISH_ERROR_LOG_SECONDS = 60.0

#: Under a stream of small groups, one INFO line per this many seconds sums them up (each group
#: is a DEBUG line): a line per one-row take cost the relay about 7% of its CPU at 300 rows/s.
PUBLISH_LOG_SECONDS = 10.0

_MAX_RECONNECT_DELAY_SECONDS = 10.0
_STOP_CHECK_SECONDS = 0.25


@dataclass
class GroupResult:
    published: int = 0
    by_destination: Counter[str] = field(default_factory=Counter)
    #: Rows left `pending` because Redis refused their destination's commands, by destination.
    refused: Counter[str] = field(default_factory=Counter)


class _RefusalLog:
    """Rate-limits the ERROR line of a destination whose publication keeps failing; shared by a
    relay and its helper connections."""

    def __init__(self, every_seconds: float = PUBLISH_ERROR_LOG_SECONDS) -> None:
        self.every_seconds = every_seconds
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def report(self, destination: str, rows: int, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(destination)
            if last is not None and now - last < self.every_seconds:
                self._quiet[destination] += rows
                return
            self._last[destination] = now
            quiet = self._quiet.pop(destination, 0)
        logger.error(
            "relay cannot publish to destination %s (%s: %s); its %s row(s) stay pending and are "
            "tried again in %g s, the other destinations are published%s",
            destination,
            type(error).__name__,
            first_line(error),
            rows,
            PUBLISH_RETRY_SECONDS,
            f" ({quiet} more row(s) refused since the last report)" if quiet else "",
            extra={
                "destination": destination,
                "rows": rows,
                "error": type(error).__name__,
                "_shown": ("rows",),
            },
        )


class _PublishLog:
    """The INFO lines of what a relay published (a :class:`outbox.logs.Tally`): a group after a
    quiet spell (nothing published for ``every_seconds``) is logged at once; the groups that
    follow it within the window are summed into one line when the window ends, or when the
    relay stops (``flush``)."""

    def __init__(self, every_seconds: float = PUBLISH_LOG_SECONDS) -> None:
        self._tally = Tally(_sum_published, every_seconds)

    def published(self, result: GroupResult) -> None:
        counts: dict[Hashable, int] = {_BATCHES: 1}
        counts.update(result.by_destination)
        if self._tally.add(counts):
            logger.info(
                "relay published %s rows",
                result.published,
                extra={
                    "published": result.published,
                    "by_destination": dict(result.by_destination),
                    "_shown": ("published",),
                },
            )
        else:
            logger.debug(
                "relay published %s rows",
                result.published,
                extra={"published": result.published, "_shown": ("published",)},
            )

    def tick(self) -> None:
        """Called while idle: a window that has ended is summed up."""
        self._tally.tick()

    def flush(self) -> None:
        self._tally.flush()


#: The key of a window's batch count beside its destinations' row counts (no destination's name).
_BATCHES = ("batches",)


def _sum_published(counts: Counter[Hashable], seconds: float) -> None:
    batches = counts.pop(_BATCHES, 0)
    by_destination = {str(d): n for d, n in counts.items()}
    rows = sum(by_destination.values())
    logger.info(
        "relay published %s rows in %s batches in the last %.1f s",
        rows,
        batches,
        seconds,
        extra={
            "published": rows,
            "batches": batches,
            "by_destination": by_destination,
            "_shown": ("published", "batches"),
        },
    )


def _read_notifies(listen: psycopg.Connection[Any]) -> int:
    """Read every NOTIFY that has arrived, without waiting; how many.

    Straight from libpq (one read of the socket, then its queue): psycopg's ``notifies(timeout=0)``
    waits with a zero timeout and raises and catches an exception to end it, which was a tenth
    of the relay's CPU at 300 one-row commits a second. Nothing but the LISTEN ever runs on this
    connection, and what arrived during that statement is read by :func:`_read_backlog`."""
    pgconn = listen.pgconn
    pgconn.consume_input()  # OperationalError on a broken connection, like psycopg's own read
    count = 0
    while pgconn.notifies() is not None:
        count += 1
    return count


def _read_backlog(listen: psycopg.Connection[Any]) -> int:
    """NOTIFYs psycopg set aside while a statement ran on ``listen`` (the LISTEN itself)."""
    count = 0
    for _ in listen.notifies(timeout=0):
        count += 1
    return count


class _Pace:
    """How fast a limited destination's window empties: the rows settled (published ones that
    left ``dispatched``/``in_flight``) between this relay's takes, over the last second. Settled,
    not taken: a window sized on what it took would grow by half each take while nothing
    settles."""

    def __init__(self) -> None:
        self._settled: deque[tuple[float, int]] = deque()
        #: The window's rows outstanding after this relay's last take (None: no take yet).
        self._after: int | None = None

    def took(self, now: float, *, outstanding: int, taken: int) -> None:
        if self._after is not None:
            # Another relay's take makes it look negative: nothing settled, as far as known.
            self._settled.append((now, max(0, self._after - outstanding)))
        self._after = outstanding + taken

    def settled_per_second(self, now: float) -> float:
        while self._settled and self._settled[0][0] < now - 1.0:
            self._settled.popleft()
        return float(sum(n for _, n in self._settled))


class Relay:
    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str,
        namespace: str = settings.DEFAULT_NAMESPACE,
        batch_size: int = settings.DEFAULT_RELAY_BATCH_SIZE,
        poll_interval_seconds: float = settings.DEFAULT_POLL_INTERVAL_SECONDS,
        gather_seconds: float = settings.DEFAULT_RELAY_GATHER_SECONDS,
        parallel: int = settings.DEFAULT_RELAY_CONNECTIONS,
        failover_guard: FailoverGuard | None = None,
        direct_database_url: str | None = None,
        pooled: bool = False,
    ) -> None:
        #: The takes' connections: through a pooler in transaction mode when ``pooled`` (a take
        #: is one transaction, Redis push included).
        self.database_url = database_url
        self.pooled = pooled
        #: LISTEN holds one backend for as long as the relay runs: PostgreSQL itself.
        self.direct_database_url = direct_database_url or database_url
        #: While it says ``halted`` (the database is on another history), nothing is published.
        self.failover_guard = failover_guard
        self.redis_url = redis_url
        self.namespace = namespace
        self.batch_size = batch_size
        self.poll_interval_seconds = poll_interval_seconds
        self.gather_seconds = max(0.0, gather_seconds)
        #: time.monotonic() when the last take began; the gathering window counts from it.
        self._last_take = float("-inf")
        #: Connections that drain a backlog together (see `drain`); 1 = strictly one group at a time.
        self.parallel = max(1, parallel)
        self._conn: psycopg.Connection[Any] | None = None
        self._listen: psycopg.Connection[Any] | None = None
        self._redis: redis.Redis | None = None
        self._helpers: list[Relay] = []
        #: The relay whose drain this one helps (None: a relay of its own).
        self.parent: Relay | None = None
        self._refusals = _RefusalLog()
        self._log = _PublishLog()
        #: Beaten by the loop (each group, each wait slice): ``/healthz`` (outbox.probes).
        self.liveness: Liveness | None = None
        #: Whether this relay fills the limited destinations' windows (outbox.windows); a
        #: drain's helpers do not (they leave those destinations' rows to it).
        self.fills_windows = True
        #: The limited destinations as last read, and when (time.monotonic()); re-read at every
        #: take while there are some, else once per windows.LIMITS_REFRESH_SECONDS.
        self._windowed: tuple[str, ...] = ()
        self._windowed_read_at = float("-inf")
        #: A window was found full, or filled to the brim, at the last take: rows may be waiting
        #: for room, and the loop comes back after windows.REFILL_SECONDS.
        self.windows_waiting = False
        #: The next take only refills the windows (the loop woke for them, not for a NOTIFY),
        #: unless the others' take is a poll interval old: the take of the other destinations
        #: reads past the limited destinations' due backlog, 10 times a second otherwise.
        self.refill_only = False
        self._others_taken_at = float("-inf")
        #: By limited destination: each priority's last fairness key visited (the next take
        #: starts after it), and how fast its window empties.
        self._cursors: dict[str, dict[int, str | None]] = {}
        self._paces: dict[str, _Pace] = {}

    # -- connections ---------------------------------------------------------------------------

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect_raw(self.database_url, pooled=self.pooled)
            if self.failover_guard is not None:
                # A new connection may be to a new server: check before the first group on it.
                self.failover_guard.check_now()
        return self._conn

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = transport.connect(self.redis_url, socket_timeout=10, socket_connect_timeout=5)
        return self._redis

    def close(self) -> None:
        self._log.flush()
        for helper in self._helpers:
            helper.close()
        self._helpers = []
        for conn in (self._conn, self._listen):
            if conn is not None and not conn.closed:
                conn.close()
        self._conn = self._listen = None
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    # -- one group -----------------------------------------------------------------------------

    def run_once(self) -> GroupResult:
        """Take, publish and commit one group (pending -> dispatched); returns what was published."""
        result = GroupResult()
        if self.liveness is not None:
            self.liveness.beat()
        self._last_take = time.monotonic()
        conn = self.conn
        if self.failover_guard is not None and self.failover_guard.halted:
            return result
        try:
            # One transaction (the connection is not autocommit: the take opens it), ended by
            # commit() or rollback() rather than psycopg's transaction() block, whose savepoint
            # bookkeeping showed in the profile of one-row takes.
            try:
                rows = self._take(conn)
                # Inside the transaction: if the publish raises, the move rolls back and the
                # rows stay pending.
                published = transport.publish_group(self.redis, self.namespace, rows)
                for destination, error in published.failed.items():
                    # Only the refused destinations' rows: the others were published and are
                    # marked dispatched by this same commit.
                    store.relay.undispatch(
                        conn,
                        ids=[r[0] for r in rows if r[1] == destination],
                        retry_after_seconds=PUBLISH_RETRY_SECONDS,
                        error=f"Redis refused the publication ({error}); published again later",
                    )
            except BaseException:
                if not conn.closed and not conn.broken:
                    conn.rollback()
                raise
            conn.commit()
        except psycopg.OperationalError:
            # Closed rather than dropped, so that no half-dead connection lingers until GC.
            conn.close()
            self._conn = None
            raise
        result.published = published.count
        result.by_destination.update(r[1] for r in rows if r[1] not in published.failed)
        result.refused.update(r[1] for r in rows if r[1] in published.failed)
        for destination, error in published.failed.items():
            self._refusals.report(destination, result.refused[destination], error)
        if rows:
            metrics.count_relay_group(result.by_destination, result.refused)
        return result

    def _take(self, conn: psycopg.Connection[Any]) -> list[Any]:
        """The take of one group: the due rows of the destinations without a limit, then, when
        this relay fills them, the limited destinations' windows (outbox.windows)."""
        now = time.monotonic()
        limited: list[Any] = []
        if self.fills_windows and (
            self._windowed or now - self._windowed_read_at >= windows.LIMITS_REFRESH_SECONDS
        ):
            limited = store.relay.limited_destinations(conn)
            self._windowed = tuple(r[0] for r in limited)
            self._windowed_read_at = now
        elif not self.fills_windows and self.parent is not None:
            self._windowed = self.parent._windowed
        rows: list[Any] = []
        if not (self.refill_only and limited) or now - self._others_taken_at >= self.poll_interval_seconds:
            rows = store.relay.dispatch_due(conn, limit=self.batch_size, windowed=self._windowed)
            self._others_taken_at = now
        self.refill_only = False
        waiting = False
        for destination, in_flight, per_second, ours in limited:
            pace = self._paces.setdefault(destination, _Pace())
            size = windows.window_size(in_flight, per_second, pace.settled_per_second(now))
            if not ours or size is None:
                continue
            cursors = self._cursors.setdefault(destination, {})
            window = store.relay.dispatch_window(conn, destination=destination, size=size, cursors=cursors)
            rows.extend(window.rows)
            pace.took(now, outstanding=size - window.room, taken=len(window.rows))
            cursors.update(window.cursors)
            # Full, filled to the brim, or more keys than one take visits: rows may be waiting.
            waiting = waiting or len(window.rows) >= window.room or window.more_keys
        self.windows_waiting = waiting
        for gone in set(self._cursors) - set(self._windowed):
            del self._cursors[gone]
            self._paces.pop(gone, None)
        return rows

    def drain(self, stop: threading.Event | None = None) -> int:
        """Publish groups while they come back full; returns how many rows went out.

        When the first group comes back full there is a backlog, and ``parallel`` connections
        (this relay and helpers with connections of their own, in threads) drain it together:
        a group spends most of its time waiting on PostgreSQL, and another connection's Python and
        Redis work fits in that wait: two connections drain a backlog nearly twice as fast as
        one (docs/decisions/hot-path-costs.md).
        SKIP LOCKED keeps their groups disjoint. A wake-up for a few rows stays one group on
        this thread, so latency is not affected.
        """
        published, claimed = self._publish_group()
        if claimed < self.batch_size or (stop is not None and stop.is_set()):
            return published
        if self.parallel == 1:
            return published + self._drain_alone(stop)
        return published + self._drain_together(stop)

    def _publish_group(self) -> tuple[int, int]:
        """(rows published, rows claimed): a full claim means more may be due, even when some
        of its rows were refused."""
        result = self.run_once()
        if result.published:
            self._log.published(result)
        else:
            self._log.tick()
        return result.published, result.published + sum(result.refused.values())

    def _drain_alone(self, stop: threading.Event | None) -> int:
        total = 0
        while True:
            published, claimed = self._publish_group()
            total += published
            if claimed < self.batch_size or (stop is not None and stop.is_set()):
                return total

    def _drain_together(self, stop: threading.Event | None) -> int:
        while len(self._helpers) < self.parallel - 1:
            self._helpers.append(
                Relay(
                    database_url=self.database_url,
                    redis_url=self.redis_url,
                    namespace=self.namespace,
                    batch_size=self.batch_size,
                    parallel=1,
                    failover_guard=self.failover_guard,
                    direct_database_url=self.direct_database_url,
                    pooled=self.pooled,
                )
            )
            self._helpers[-1]._refusals = self._refusals
            self._helpers[-1].fills_windows = False
            self._helpers[-1].parent = self
        totals: list[int] = []
        errors: list[BaseException] = []

        def work(relay: Relay) -> None:
            try:
                totals.append(relay._drain_alone(stop))
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors.append(exc)

        threads = [
            threading.Thread(target=work, args=(helper,), name=f"relay-drain-{i + 2}", daemon=True)
            for i, helper in enumerate(self._helpers)
        ]
        for thread in threads:
            thread.start()
        work(self)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return sum(totals)

    # -- the loop ------------------------------------------------------------------------------

    def _ensure_listening(self) -> psycopg.Connection[Any]:
        if self._listen is None or self._listen.closed:
            self._listen = connect_raw(self.direct_database_url, autocommit=True)
            self._listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
            # Those came after the LISTEN, so the drain that follows takes their rows.
            _read_backlog(self._listen)
        return self._listen

    def _wait_for_notify(self, timeout_seconds: float, stop: threading.Event | None = None) -> bool:
        """Return on the first NOTIFY (True), after ``timeout_seconds`` or soon after ``stop`` is
        set (False).

        The wait is cut in short slices because a signal handler that sets ``stop`` does not
        interrupt a wait: with one long wait, SIGTERM took up to a whole poll interval. It is a
        ``select`` on the socket rather than psycopg's timed wait, which polls in whole
        milliseconds, truncated, and spins on ``poll(0)`` through the last one.
        """
        listen = self._ensure_listening()
        deadline = time.monotonic() + timeout_seconds
        while stop is None or not stop.is_set():
            if self.liveness is not None:
                self.liveness.beat()
            if _read_notifies(listen):
                self._gather(stop)
                _read_notifies(listen)
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            select.select([listen.fileno()], [], [], min(remaining, _STOP_CHECK_SECONDS))
        return False

    def _gather(self, stop: threading.Event | None) -> None:
        """When the previous take began less than ``gather_seconds`` ago, sleep out the rest of
        that window; the caller then reads every NOTIFY that came meanwhile, for one take.

        Nothing is lost by swallowing NOTIFYs: one is sent at its commit, so the take that
        follows sees every row whose NOTIFY was read before it; one that comes after stays in
        the socket and wakes the next wait.
        """
        while stop is None or not stop.is_set():
            remaining = self._last_take + self.gather_seconds - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(remaining, _STOP_CHECK_SECONDS))

    def run_forever(self, stop: threading.Event) -> None:
        """Drain, then sleep until NOTIFY or the poll interval; survive outages with backoff."""
        outage_started: float | None = None
        delay = 0.5
        while not stop.is_set():
            try:
                # LISTEN before draining: a row committed between the drain and the LISTEN
                # would otherwise wait a whole poll interval.
                self._ensure_listening()
                self.drain(stop)
                if outage_started is not None:
                    logger.warning(
                        "relay reconnected after %.1f s",
                        time.monotonic() - outage_started,
                        extra={
                            "outage_seconds": round(time.monotonic() - outage_started, 1),
                            "_shown": ("outage_seconds",),
                        },
                    )
                    outage_started, delay = None, 0.5
                if stop.is_set():
                    break
                refill = self.windows_waiting
                notified = self._wait_for_notify(
                    min(self.poll_interval_seconds, windows.REFILL_SECONDS)
                    if refill
                    else self.poll_interval_seconds,
                    stop,
                )
                # A refill's tick, with no row written since: the windows only (below).
                self.refill_only = refill and not notified
            except (psycopg.Error, redis.RedisError, OSError) as exc:
                metrics.count_relay_failure()
                if self.liveness is not None:
                    self.liveness.beat()  # alive: waiting out an outage is the loop's job
                if outage_started is None:
                    # One line per outage, not one per retry: the backoff may retry for hours.
                    outage_started = time.monotonic()
                    logger.error(
                        "relay cannot reach %s (%s: %s); rows stay pending, retrying with backoff",
                        "Redis" if isinstance(exc, redis.RedisError) else "PostgreSQL",
                        type(exc).__name__,
                        first_line(exc),
                        extra={"error": type(exc).__name__},
                    )
                self.close()
                stop.wait(delay)
                delay = min(delay * 2, _MAX_RECONNECT_DELAY_SECONDS)
        self.close()
