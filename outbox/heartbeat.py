"""Process heartbeats in the database, and what they tell: which destinations no live process
consumes, and how far each process's clock is from the database's.

Workers, relays and reconcilers beat every ``OUTBOX_HEARTBEAT_INTERVAL`` seconds (default 5)
on a thread and a connection of their own: one upsert that records the queues a worker serves,
the schema range the process's code accepts (``outbox features enable`` reads it), the database clock
(``last_seen_at``) and its own clock at that moment (``process_clock``). Skew is
``process_clock - last_seen_at``; the process's clock is read just before the statement is sent,
so the estimate is low by the one-way latency to the database (well under the 2 s that
``outbox doctor`` warns at). A clean stop marks the row ``stopped_at``; a killed process's row
goes stale. Operator commands read all of it from the database alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from . import store
from .db import connect_raw
from .exceptions import OutboxError
from .logs import first_line
from .settings import DEFAULT_HEARTBEAT_INTERVAL_SECONDS

logger = logging.getLogger(__name__)

#: A process is live while it was heard from within ``LIVE_INTERVALS`` of its own interval plus
#: ``LIVE_SLACK_SECONDS`` (outbox.store.processes, whose beat reads it too).
LIVE_INTERVALS = store.processes.LIVE_INTERVALS
LIVE_SLACK_SECONDS = store.processes.LIVE_SLACK_SECONDS
#: A worker whose handlers declare in-flight limits tries its first beat this many times, a second
#: apart, before it gives up starting (outbox.limits).
FIRST_BEAT_TRIES = 30
#: Rows of processes not heard from for this long are deleted by the reconciler.
HEARTBEAT_RETENTION_SECONDS = 86400

#: SQL condition on ``outbox_process``: the process is running and was heard from recently.
LIVE = store.processes.LIVE

# Rows waiting (pending or dispatched) per destination that no live worker serves. `since` is
# when a worker serving it was last heard from, else when its oldest waiting row was written.
NO_CONSUMER_SQL = f"""
WITH waiting AS (
    -- One branch per state, each on that state's partial index: `state IN (…)` read the whole
    -- table (a parallel sequential scan, 250 ms at a million rows).
    SELECT destination, sum(n)::bigint AS n, min(oldest) AS oldest, min(first_id) AS first_id
    FROM (
        SELECT destination, count(*) AS n, min(created_at) AS oldest, min(id) AS first_id
        FROM outbox_message WHERE state = 'pending' GROUP BY destination
        UNION ALL
        SELECT destination, count(*), min(created_at), min(id)
        FROM outbox_message WHERE state = 'dispatched' GROUP BY destination
    ) by_state
    GROUP BY destination
), served AS (
    SELECT q AS destination, bool_or({LIVE}) AS live,
           max(COALESCE(stopped_at, last_seen_at)) AS last_seen
    FROM outbox_process, unnest(queues) AS q
    WHERE kind = 'worker'
    GROUP BY q
)
SELECT w.destination, w.n, COALESCE(s.last_seen, w.oldest) AS since, w.first_id
FROM waiting w LEFT JOIN served s ON s.destination = w.destination
WHERE s.live IS NOT TRUE
ORDER BY w.destination
"""

LIVE_PROCESSES_SQL = f"""
SELECT id, kind, hostname, pid, queues, started_at, last_seen_at,
       EXTRACT(EPOCH FROM process_clock - last_seen_at) AS skew_seconds
FROM outbox_process
WHERE {LIVE}
ORDER BY kind, hostname, pid
"""


@dataclass(frozen=True)
class NoConsumer:
    """A destination with rows waiting and no live process consuming its queue."""

    destination: str
    rows_waiting: int
    #: Since when (database clock): the last beat of a worker serving it, else its oldest row.
    since: datetime
    #: Its oldest waiting row (for alerts, which name a row).
    first_id: int

    def describe(self) -> str:
        # "T" and "Z" are letters: they end a digit run, so the card-number masking that alert
        # and log text goes through never reads date, time and count as one number.
        at = self.since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"no consumer for {self.destination} since {at}, {self.rows_waiting} rows waiting"

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "rows_waiting": self.rows_waiting,
            "since": self.since.isoformat(),
            "message": self.describe(),
        }


@dataclass(frozen=True)
class LiveProcess:
    id: uuid.UUID
    kind: str
    hostname: str
    pid: int
    queues: list[str]
    started_at: datetime
    last_seen_at: datetime
    #: The process's clock minus the database's, at its last beat.
    skew_seconds: float

    @property
    def name(self) -> str:
        return f"{self.kind} {self.hostname}:{self.pid}"


def no_consumer(rows: Any) -> list[NoConsumer]:
    """:data:`NO_CONSUMER_SQL`'s rows (psycopg or SQLAlchemy) as :class:`NoConsumer`."""
    return [NoConsumer(str(r[0]), int(r[1]), r[2], int(r[3])) for r in rows]


def live_processes(rows: Any) -> list[LiveProcess]:
    """:data:`LIVE_PROCESSES_SQL`'s rows as :class:`LiveProcess`."""
    return [
        LiveProcess(r[0], str(r[1]), str(r[2]), int(r[3]), list(r[4] or []), r[5], r[6], float(r[7]))
        for r in rows
    ]


class Heartbeat:
    """Beats for one process on a daemon thread until :meth:`stop`."""

    def __init__(
        self,
        database_url: str,
        *,
        kind: str,
        queues: Sequence[str] = (),
        interval_seconds: float = DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        pooled: bool = False,
        declared_in_flight: Mapping[str, int] | None = None,
        declared_per_second: Mapping[str, float] | None = None,
    ) -> None:
        self.database_url = database_url
        #: The in-flight limits this process's handlers declare, by destination (outbox.limits).
        self.declared_in_flight = dict(declared_in_flight or {})
        #: The calls a second this process's handlers declare, by destination (outbox.limits).
        self.declared_per_second = dict(declared_per_second or {})
        #: Through a pooler in transaction mode: each beat is one statement.
        self.pooled = pooled
        self.id = uuid.uuid4()
        self.kind = kind
        self.queues = list(queues)
        self.interval_seconds = float(interval_seconds)
        #: The process's clock; a parameter so that a test can give a process a skewed one.
        self.clock = clock
        #: The schema range this code accepts: what ``outbox features enable`` holds a feature to.
        from .migrate import SCHEMA_OLDEST, head_revision

        self.schema_oldest = SCHEMA_OLDEST
        self.schema_newest = head_revision()
        self._conn: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        #: This process's clock at its last beat that committed (None: none yet).
        self.last_beat_at: float | None = None
        #: A worker's: the destinations with an in-flight limit, read at each beat (outbox.wakes).
        self.in_flight_limited: frozenset[str] = frozenset()

    def declarations_fresh(self) -> bool:
        """Whether this process's last committed beat is recent enough that every claim trigger
        still counts it live (its declared in-flight limits hold): two of its intervals, well
        inside the LIVE_INTERVALS + LIVE_SLACK_SECONDS the database allows."""
        last = self.last_beat_at
        return last is not None and time.monotonic() - last < 2 * self.interval_seconds

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect_raw(
                self.database_url,
                autocommit=True,
                pooled=self.pooled,
                application_name=f"outbox-{self.kind}/{self.schema_newest}",
            )
        return self._conn

    def beat(self) -> None:
        """One beat; raises psycopg errors (the thread logs them)."""
        sent_at = time.monotonic()
        store.processes.beat(
            self._connection(),
            {
                "id": self.id,
                "kind": self.kind,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "queues": self.queues,
                "interval": self.interval_seconds,
                "clock": self.clock(),
                "schema_oldest": self.schema_oldest,
                "schema_newest": self.schema_newest,
                "declared": Jsonb(self.declared_in_flight) if self.declared_in_flight else None,
                "declared_rates": Jsonb(self.declared_per_second) if self.declared_per_second else None,
            },
        )
        self.last_beat_at = sent_at
        if self.kind == "worker":
            self.in_flight_limited = store.processes.in_flight_limited(self._connection())

    def _run(self) -> None:
        while True:
            try:
                self.beat()
                if self._failing:
                    logger.warning("heartbeat recorded again", extra={"process_id": str(self.id)})
                self._failing = False
            except psycopg.Error as exc:
                if not self._failing:
                    # Once per outage: the consumer's own connections report the rest.
                    logger.warning(
                        "cannot record the heartbeat (%s: %s); retrying every %g s",
                        type(exc).__name__,
                        first_line(exc),
                        self.interval_seconds,
                        extra={"process_id": str(self.id), "error": type(exc).__name__},
                    )
                self._failing = True
                self._close()
            if self._stop.wait(self.interval_seconds):
                return

    def start(self) -> Heartbeat:
        if self.declared_in_flight or self.declared_per_second:
            # A declared limit holds from this process's first claim: no claim before the first
            # beat that writes it has committed.
            for attempt in range(FIRST_BEAT_TRIES):
                try:
                    self.beat()
                    break
                except psycopg.Error as exc:
                    self._close()
                    if attempt + 1 == FIRST_BEAT_TRIES:
                        raise OutboxError(
                            f"cannot record the in-flight limits this worker's handlers declare "
                            f"({type(exc).__name__}: {first_line(exc)}); not starting without them"
                        ) from exc
                    logger.warning(
                        "cannot record the declared in-flight limits yet (%s); trying again in 1 s",
                        first_line(exc),
                    )
                    self._stop.wait(1.0)
        self._thread = threading.Thread(target=self._run, name=f"outbox-heartbeat-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and mark the process stopped, so that nobody waits for it to go stale."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        try:
            store.processes.stopped(self._connection(), process_id=self.id, clock=self.clock())
        except psycopg.Error as exc:
            logger.warning(
                "cannot mark the process stopped (%s); it goes stale instead",
                type(exc).__name__,
                extra={"process_id": str(self.id)},
            )
        finally:
            self._close()

    def _close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None
