"""Prometheus metrics of the relay, the reconciler and the rows, in one registry of our own.

Labels are of low cardinality only: destination, state, job, outcome (never a key or a row id).
Served by :mod:`outbox.probes` on ``/metrics``.

From the database (``outbox_rows``, ``outbox_oldest_row_age_seconds``,
``outbox_destination_without_consumer``): read by the reconciler that holds the
``database_metrics`` job's advisory lock, once per reconcile interval, so N replicas do not all
query; the others export none of these series. A reading older than three intervals is dropped
rather than exported stale. Terminal states are not counted here: ``sent`` and ``cancelled`` rows
are purged, so their count is no measure of anything.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .ordering import BLOCKED_SUMMARY_SQL
from .store import counts as store_counts
from .store.sql import LIVE_DECLARATIONS_SQL

REGISTRY = CollectorRegistry(auto_describe=True)

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., None])
#: A metrics failure is logged at most this often (per process).
_FAILURE_LOG_EVERY_SECONDS = 60.0
_last_failure_log = 0.0


def never_raises(fn: _F) -> _F:
    """Counting is never worth a delivery: a metrics error (a full disk under the multiprocess
    directory, a bug) is logged, rate-limited, and the caller goes on."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        global _last_failure_log
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            now = time.monotonic()
            if now - _last_failure_log >= _FAILURE_LOG_EVERY_SECONDS:
                _last_failure_log = now
                logger.error(
                    "metrics not updated (%s: %s); deliveries go on",
                    type(exc).__name__,
                    exc,
                    extra={"error": type(exc).__name__},
                )

    return wrapper  # type: ignore[return-value]


# -- relay ---------------------------------------------------------------------------------------

RELAY_ROWS_PUBLISHED = Counter(
    "outbox_relay_rows_published",
    "Rows the relay published to the broker (pending -> dispatched).",
    ["destination"],
    registry=REGISTRY,
)
RELAY_ROWS_REFUSED = Counter(
    "outbox_relay_rows_refused",
    "Rows left pending because the broker refused their destination's commands.",
    ["destination"],
    registry=REGISTRY,
)
RELAY_BATCHES = Counter(
    "outbox_relay_batches",
    "Relay batches by result: published (committed with at least one row) or failed "
    "(PostgreSQL or Redis away; the rows stay pending).",
    ["result"],
    registry=REGISTRY,
)

# -- worker --------------------------------------------------------------------------------------
# Under `outbox worker --processes N` each child writes these to files in a directory the parent
# prepared (prometheus_client's multiprocess mode) and the parent serves their sum.

DELIVERIES = Counter(
    "outbox_deliveries",
    "Deliveries by destination and outcome: sent, pending (a retry), unknown, failed, "
    "superseded (a newer claim owned the row), empty (nothing to claim), released (claimed, "
    "given back without a call), unhandled, halted, paused (not claimed: the destination is paused or "
    "its breaker open), unreachable (not claimed: PostgreSQL did not answer; the message is handed back).",
    ["destination", "outcome"],
    registry=REGISTRY,
)
PROVIDER_RESPONSES = Counter(
    "outbox_provider_responses",
    "Calls by the class of the provider's HTTP answer: 2xx, 3xx, 4xx, 5xx, or none (no answer: "
    "a timeout, a connection error, an exception before any response).",
    ["destination", "status_class"],
    registry=REGISTRY,
)
#: Seconds, from a few milliseconds (a local provider) to an hour (a backlog, a long backoff).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
WRITTEN_TO_PUBLISHED = Histogram(
    "outbox_written_to_published_seconds",
    "From the row's writing to the publication its first claim came from (database clock), "
    "observed at that claim: the relay's lag (a lost message's re-publication included). "
    "Written is the row's created_at (the start of the writing transaction, not its commit), "
    "or its available_at when written for later.",
    ["destination"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
PUBLISHED_TO_CLAIMED = Histogram(
    "outbox_published_to_claimed_seconds",
    "From the row's publication to its claim (database clock): the broker and the workers' wait.",
    ["destination"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
CLAIM_TO_CONFIRMED = Histogram(
    "outbox_claim_to_confirmed_seconds",
    "From the claim's commit to the provider's confirmed answer (the worker's clock): the call.",
    ["destination"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
WRITTEN_TO_CONFIRMED = Histogram(
    "outbox_written_to_confirmed_seconds",
    "From the row's writing to its confirmed answer, end to end, retries included. Written is "
    "the row's created_at (the start of the writing transaction, not its commit), or its "
    "available_at when it was written for later.",
    ["destination"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)


def status_class(status: int | None) -> str:
    return f"{status // 100}xx" if status is not None and 100 <= status < 600 else "none"


@dataclass
class Observed:
    """What one delivery learnt on its way, for :func:`count_delivery` once it is recorded."""

    since_published_seconds: float | None = None
    #: Set when a call was made: the provider's last HTTP status (None: no answer).
    called: bool = False
    http_status: int | None = None
    call_seconds: float | None = None
    since_written_seconds: float | None = None
    written_to_published_seconds: float | None = None


#: The labelled children count_delivery uses, per destination: a ``labels()`` lookup validates
#: and locks each time, six of them a delivery.
_delivery_children: dict[str, tuple[Any, Any, Any, Any]] = {}


def _children(destination: str) -> tuple[Any, Any, Any, Any]:
    found = _delivery_children.get(destination)
    if found is None:
        found = _delivery_children[destination] = (
            WRITTEN_TO_PUBLISHED.labels(destination=destination),
            PUBLISHED_TO_CLAIMED.labels(destination=destination),
            CLAIM_TO_CONFIRMED.labels(destination=destination),
            WRITTEN_TO_CONFIRMED.labels(destination=destination),
        )
    return found


@never_raises
def count_delivery(destination: str, outcome: str, observed: Observed) -> None:
    """One delivery, after its outcome is recorded (never between the call and the record)."""
    DELIVERIES.labels(destination=destination, outcome=outcome).inc()
    written_to_published, published_to_claimed, claim_to_confirmed, written_to_confirmed = _children(
        destination
    )
    if observed.written_to_published_seconds is not None:
        written_to_published.observe(max(0.0, observed.written_to_published_seconds))
    if observed.since_published_seconds is not None:
        published_to_claimed.observe(max(0.0, observed.since_published_seconds))
    if observed.called:
        PROVIDER_RESPONSES.labels(
            destination=destination, status_class=status_class(observed.http_status)
        ).inc()
    if outcome == "sent" and observed.call_seconds is not None:
        claim_to_confirmed.observe(observed.call_seconds)
        if observed.since_written_seconds is not None:
            written_to_confirmed.observe(max(0.0, observed.since_written_seconds) + observed.call_seconds)


# -- reconciler ----------------------------------------------------------------------------------

RECONCILER_JOB_RUNS = Counter(
    "outbox_reconciler_job_runs",
    "Reconciler job runs by result: ran (this process held the job's lock), skipped (another "
    "reconciler held it), error, halted (database identity changed: outbox failover).",
    ["job", "result"],
    registry=REGISTRY,
)
RECONCILER_ROWS = Counter(
    "outbox_reconciler_rows",
    "Rows a reconciler job acted on, by outcome: expire_leases/expired, resolve_unknown/sent, "
    "/pending, /failed, /lookup_failed, /needs_human …, redispatch/redispatched, purge/purged, "
    "alerts/alerted (the job's own counts, as its log line shows them).",
    ["job", "outcome"],
    registry=REGISTRY,
)

_RUN_RESULTS = {"skipped": "skipped", "error": "error", "halted_by_failover": "halted"}


@never_raises
def count_reconciler_job(job: str, counts: Mapping[str, int]) -> None:
    """One job run's counts (as ``Reconciler.run_job`` returns them)."""
    result = next((r for k, r in _RUN_RESULTS.items() if k in counts), "ran")
    RECONCILER_JOB_RUNS.labels(job=job, result=result).inc()
    if result == "ran":
        for outcome, n in counts.items():
            if n:
                RECONCILER_ROWS.labels(job=job, outcome=outcome).inc(n)


@never_raises
def count_relay_group(published: Mapping[str, int], refused: Mapping[str, int]) -> None:
    RELAY_BATCHES.labels(result="published").inc()
    for destination, n in published.items():
        RELAY_ROWS_PUBLISHED.labels(destination=destination).inc(n)
    for destination, n in refused.items():
        RELAY_ROWS_REFUSED.labels(destination=destination).inc(n)


@never_raises
def count_relay_failure() -> None:
    RELAY_BATCHES.labels(result="failed").inc()


# -- from the database -----------------------------------------------------------------------------

#: The states counted as gauges (the waiting ones) and those whose oldest row's age is exported:
#: the read model `outbox status` and the dashboard share (outbox.store.counts), exact, one
#: branch per state on its partial index: a table of millions of sent rows is not read.
GAUGE_STATES = store_counts.WAITING
AGE_STATES = store_counts.AGE_STATES
#: The statement :func:`read_database` counts with (bench/metrics.py times and explains it).
DATABASE_SQL = store_counts.exact_sql(GAUGE_STATES)

PAUSED_SQL = "SELECT destination FROM outbox_destination WHERE paused_until > now() ORDER BY 1"
BREAKERS_SQL = "SELECT destination FROM outbox_destination WHERE breaker_opened_at IS NOT NULL ORDER BY 1"
# The limits that hold (outbox.limits): the operator's, else the lowest live declaration.
LIMITS_SQL = f"""
WITH declared AS ({LIVE_DECLARATIONS_SQL})
SELECT COALESCE(o.destination, declared.destination), COALESCE(o.limit_in_flight, declared.n),
       COALESCE(o.limit_per_second, declared.rate)
FROM (SELECT destination, limit_in_flight, limit_per_second FROM outbox_destination
      WHERE limit_in_flight IS NOT NULL OR limit_per_second IS NOT NULL) AS o
FULL JOIN declared ON declared.destination = o.destination
ORDER BY 1
"""


@dataclass
class DatabaseReading:
    #: (destination, state) -> rows
    rows: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (destination, state) -> seconds (None: no due pending row)
    ages: dict[tuple[str, str], float | None] = field(default_factory=dict)
    #: destinations with rows waiting and no live worker
    no_consumer: list[str] = field(default_factory=list)
    #: destinations paused now (outbox pause)
    paused: list[str] = field(default_factory=list)
    #: destinations whose circuit breaker is open or half-open now (outbox.breaker)
    breakers: list[str] = field(default_factory=list)
    #: destination -> the in-flight limit that holds (outbox.limits)
    limits: dict[str, int] = field(default_factory=dict)
    #: destination -> the calls a second that hold (outbox.limits)
    rates: dict[str, float] = field(default_factory=dict)
    #: every destination to export, zeros included (the handlers' and the table's)
    destinations: list[str] = field(default_factory=list)
    #: ordering keys held back by their head, and for how long the longest (outbox.ops.ordering)
    blocked_keys: int = 0
    oldest_block_seconds: float | None = None
    taken_at: float = field(default_factory=time.monotonic)


def read_database(conn: Any) -> DatabaseReading:
    """One reading: the per-state query and the heartbeat's no-consumer query (psycopg
    connection)."""
    from . import heartbeat

    reading = DatabaseReading()
    rows = store_counts.rows_by_destination(conn, asked=GAUGE_STATES)
    for destination, by_state in rows.by_destination.items():
        for state, n in by_state.items():
            # Only the states a destination has rows in, as counted: the collector adds zeros.
            if n:
                reading.rows[(destination, state)] = n
    reading.ages = dict(rows.ages)
    gaps = heartbeat.no_consumer(conn.execute(heartbeat.NO_CONSUMER_SQL).fetchall())
    reading.no_consumer = sorted({g.destination for g in gaps})
    reading.paused = [r[0] for r in conn.execute(PAUSED_SQL).fetchall()]
    reading.breakers = [r[0] for r in conn.execute(BREAKERS_SQL).fetchall()]
    limit_rows = conn.execute(LIMITS_SQL).fetchall()
    reading.limits = {d: int(n) for d, n, _ in limit_rows if n is not None}
    reading.rates = {d: float(r) for d, _, r in limit_rows if r is not None}
    keys, oldest = conn.execute(BLOCKED_SUMMARY_SQL).fetchone()
    reading.blocked_keys = int(keys)
    reading.oldest_block_seconds = float(oldest) if oldest is not None else None
    return reading


def _destination_flags(
    name: str, help_text: str, destinations: list[str], flagged: list[str]
) -> GaugeMetricFamily:
    """A 0/1 gauge per destination: every known destination, and any flagged one besides."""
    return _destination_values(name, help_text, destinations, dict.fromkeys(flagged, 1.0))


def _destination_values(
    name: str, help_text: str, destinations: list[str], values: dict[str, float] | dict[str, int]
) -> GaugeMetricFamily:
    """A gauge per destination: every known destination (0 where it has no value), and any
    other with a value besides."""
    family = GaugeMetricFamily(name, help_text, labels=["destination"])
    for d in sorted(set(destinations) | set(values)):
        family.add_metric([d], float(values.get(d, 0)))
    return family


class _DatabaseCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading: DatabaseReading | None = None
        self._fresh_for_seconds = 0.0

    def update(self, reading: DatabaseReading, *, fresh_for_seconds: float) -> None:
        with self._lock:
            self._reading, self._fresh_for_seconds = reading, fresh_for_seconds

    def reading(self) -> DatabaseReading | None:
        with self._lock:
            reading = self._reading
            if reading is None or time.monotonic() - reading.taken_at > self._fresh_for_seconds:
                return None
            return reading

    def describe(self) -> list[Any]:
        return []  # series appear only in the process that reads the database

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reading = self.reading()
        if reading is None:
            return
        rows = GaugeMetricFamily(
            "outbox_rows",
            "Rows by destination and state (pending, dispatched, in_flight, unknown, failed).",
            labels=["destination", "state"],
        )
        # Zeros for a destination with nothing waiting: a series that vanished would read as
        # "no data" rather than 0, and rules and sums over it would go blank.
        destinations = sorted({d for d, _ in reading.rows} | set(reading.destinations))
        for d in destinations:
            for state in GAUGE_STATES:
                # Zeros included: a gauge that stopped being exported would look stuck.
                rows.add_metric([d, state], reading.rows.get((d, state), 0))
        yield rows
        ages = GaugeMetricFamily(
            "outbox_oldest_row_age_seconds",
            "Age of the oldest row by destination and state: pending from when it became due, "
            "dispatched from its publication, in_flight from its claim, unknown from when it "
            "became unknown; 0 when there is none.",
            labels=["destination", "state"],
        )
        for d in destinations:
            for state in AGE_STATES:
                ages.add_metric([d, state], reading.ages.get((d, state)) or 0.0)
        yield ages
        for name, help_text, flagged in (
            (
                "outbox_destination_without_consumer",
                "1 for a destination with rows waiting and no live worker heartbeat serving its queue.",
                reading.no_consumer,
            ),
            (
                "outbox_destination_paused",
                "1 for a destination an operator paused (outbox pause): its rows are not claimed.",
                reading.paused,
            ),
            (
                "outbox_destination_breaker_open",
                "1 for a destination whose circuit breaker is open or half-open: its rows wait, one "
                "probe at a time goes through.",
                reading.breakers,
            ),
        ):
            yield _destination_flags(name, help_text, destinations, flagged)
        yield _destination_values(
            "outbox_destination_in_flight_limit",
            "The most calls of a destination in flight at once over every worker (outbox limit, "
            "or the lowest max_in_flight live workers declare); 0 when none holds.",
            destinations,
            reading.limits,
        )
        yield _destination_values(
            "outbox_destination_calls_per_second_limit",
            "The most calls of a destination a second over every worker, their starts spaced "
            "evenly (outbox limit --per-second, or the lowest max_calls_per_second live workers "
            "declare); 0 when none holds.",
            destinations,
            reading.rates,
        )
        blocked = GaugeMetricFamily(
            "outbox_ordering_blocked_keys",
            "Ordering keys held back by their head (failed, unknown, in flight, or waiting for a "
            "retry) with rows waiting behind it: outbox ordering lists them.",
        )
        blocked.add_metric([], reading.blocked_keys)
        yield blocked
        oldest = GaugeMetricFamily(
            "outbox_ordering_oldest_block_seconds",
            "How long the longest-blocked ordering key has been blocked; 0 when none is.",
        )
        oldest.add_metric([], reading.oldest_block_seconds or 0.0)
        yield oldest
        taken = GaugeMetricFamily(
            "outbox_database_reading_age_seconds",
            "How old the database reading above is (it is taken once per reconcile interval).",
        )
        taken.add_metric([], time.monotonic() - reading.taken_at)
        yield taken


DATABASE = _DatabaseCollector()
REGISTRY.register(DATABASE)


def render() -> tuple[str, bytes]:
    """The Prometheus text exposition of the registry: (content type, body)."""
    return CONTENT_TYPE_LATEST, generate_latest(REGISTRY)


#: The variable prometheus_client reads, at import, to keep its values in files of a directory.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def check_environment() -> None:
    """At a process's start: a ``PROMETHEUS_MULTIPROC_DIR`` that is set must be a writable
    directory, or every count would fail (they would not stop deliveries, but would count
    nothing)."""
    from .exceptions import ConfigError

    directory = os.environ.get(MULTIPROCESS_ENV)
    if directory and not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
        raise ConfigError(
            f"{MULTIPROCESS_ENV}={directory!r} is not a writable directory; unset it "
            "(outbox worker --processes N sets its own for its children)"
        )


def multiprocess_renderer(directory: str) -> Any:
    """For the parent of ``outbox worker --processes N``: renders the sum of its children's
    files in ``directory`` (each child sets nothing up: it inherits the variable)."""
    from prometheus_client import multiprocess

    def render_children() -> tuple[str, bytes]:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        return CONTENT_TYPE_LATEST, generate_latest(registry)

    return render_children


def mark_process_dead(pid: int, directory: str) -> None:
    """A child died: its live gauges go (its counters stay: a counter never goes down)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, directory)
