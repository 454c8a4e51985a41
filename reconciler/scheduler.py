"""The ``Reconciler``: runs every job under its own advisory lock, once or on a schedule.

Each job has a dedicated connection that holds both its session-level advisory lock and its
statements: if that connection dies, the lock and the work stop together, so a reconciler can
never keep acting after another one has taken the lock over. Only one reconciler acts per job
at a time; the guarded statements make even an overlap harmless, the lock makes it rare and
keeps two reconcilers from asking a provider the same question.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import redis
from apscheduler.events import EVENT_SCHEDULER_STARTED
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers import SchedulerNotRunningError
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.interval import IntervalTrigger

from outbox import metrics, settings, transport
from outbox.alerts import AlertHook, log_alert
from outbox.db import connect_raw, tolerate_unloadable
from outbox.failover import FailoverGuard
from outbox.handlers import Handler
from outbox.migrate import head_revision
from outbox.probes import Liveness
from outbox.settings import DEFAULT_NAMESPACE, DEFAULT_NO_CONSUMER_CYCLES, Settings
from outbox.settlement import LookupClients

from .jobs.batches import Batches, BatchesConfig
from .jobs.chains import Chains, ChainsConfig
from .jobs.common import MaintenanceJob
from .jobs.database_metrics import DatabaseMetrics
from .jobs.expire_leases import ExpireLeases, ExpireLeasesConfig
from .jobs.held_destinations import HeldDestinations, HeldDestinationsConfig
from .jobs.no_consumer import NoConsumer, NoConsumerConfig
from .jobs.purge import Purge, PurgeConfig
from .jobs.redispatch import DEFAULT_REDISPATCH_GRACE_SECONDS, Redispatch, RedispatchConfig
from .jobs.resolve_unknown import ResolveUnknown, ResolveUnknownConfig
from .jobs.send_alerts import SendAlerts, SendAlertsConfig

logger = logging.getLogger(__name__)

#: First key of every reconciler advisory lock (``pg_locks.classid``): "ob" for outbox.
LOCK_CLASS = 0x6F62

#: An idle run logs at DEBUG; one INFO line this often says the reconciler is still there.
IDLE_HEARTBEAT_SECONDS = 600.0

JobFn = Callable[[psycopg.Connection[Any]], dict[str, int]]


@dataclass(frozen=True)
class Job:
    """A named job; ``lock_id`` is its second advisory lock key (``pg_locks.objid``)."""

    name: str
    lock_id: int
    run: JobFn
    #: Keep the lock once taken (until this reconciler's connection ends): a job that one
    #: reconciler should do for good, not each in turn (database_metrics).
    keep_lock: bool = False


#: Job names in the order ``run_once`` runs them, with their lock ids. A row whose lease expires
#: is looked up one time_limit later, by a later run.
JOB_LOCK_IDS: dict[str, int] = {
    "expire_leases": 1,
    "resolve_unknown": 2,
    "redispatch": 3,
    "purge": 4,
    "alerts": 5,
    # Not 6: a distinctive id, so that another job added beside it cannot share its lock.
    "no_consumer": 47,
    # Pauses and breaker trips, alerted once per episode.
    "held_destinations": 49,
    # Next steps of rows resolved sent without the handler module.
    "chains": 50,
    # Batches whose members are all terminal get their then/catch row.
    "batches": 51,
    # Only with a metrics port (outbox.metrics): one reconciler reads the rows for everyone.
    "database_metrics": 48,
}


class Reconciler:
    """Runs the reconciler jobs for the handlers of one deploy.

    ``run_once()`` runs every job a single time and returns ``{job: counts}``; a job another
    reconciler holds reports ``{"skipped": 1}``, one that raised reports ``{"error": 1}`` (and
    is logged). ``run_forever(stop, interval_seconds)`` runs them on an APScheduler schedule.
    """

    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str,
        handlers: Mapping[str, Handler],
        module: str,
        namespace: str = DEFAULT_NAMESPACE,
        redispatch_after_seconds: float = settings.DEFAULT_REDISPATCH_AFTER_SECONDS,
        retention_seconds: float = settings.DEFAULT_RETENTION_SECONDS,
        ledger_horizon_seconds: float = settings.DEFAULT_LEDGER_HORIZON_SECONDS,
        unknown_alert_after_seconds: float = settings.DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS,
        lookup_concurrency: int = settings.DEFAULT_LOOKUP_CONCURRENCY,
        alert_hook: AlertHook = log_alert,
        redispatch_grace_seconds: float = DEFAULT_REDISPATCH_GRACE_SECONDS,
        name: str | None = None,
        no_consumer_cycles: int = DEFAULT_NO_CONSUMER_CYCLES,
        failover_guard: FailoverGuard | None = None,
        database_metrics_interval_seconds: float | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.database_url = database_url
        #: Set: the ``database_metrics`` job runs, fresh for three of these intervals.
        self.database_metrics_interval_seconds = database_metrics_interval_seconds
        #: Beaten after every job run: ``/healthz`` (outbox.probes) says the scheduler is alive.
        self.liveness = liveness
        #: While it says ``halted`` (the database is on another history), no job runs.
        self.failover_guard = failover_guard
        self.redis_url = redis_url
        self.handlers = dict(handlers)
        self.module = module
        self.namespace = namespace
        self.redispatch_after_seconds = redispatch_after_seconds
        self.retention_seconds = retention_seconds
        self.ledger_horizon_seconds = ledger_horizon_seconds
        self.unknown_alert_after_seconds = unknown_alert_after_seconds
        #: Lookups of one destination in flight at once (resolve_unknown).
        self.lookup_concurrency = lookup_concurrency
        self.alert_hook = alert_hook
        self.redispatch_grace_seconds = redispatch_grace_seconds
        self.no_consumer_cycles = no_consumer_cycles
        #: Names this process in the log lines, so an operator sees which reconciler acted.
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._lookup_clients = LookupClients()
        self._redis: redis.Redis | None = None
        self._redis_lock = threading.Lock()
        self._conns: dict[str, psycopg.Connection[Any]] = {}
        # The connection on which this reconciler holds a kept lock, by job (Job.keep_lock).
        self._kept: dict[str, psycopg.Connection[Any]] = {}
        # Set on shutdown: long jobs stop between rows instead of holding the exit up.
        self._stopping = threading.Event()
        # Session-level advisory locks are re-entrant within a session: this keeps two threads
        # of this reconciler from both "acquiring" the same job on its one connection.
        self._running = {n: threading.Lock() for n in JOB_LOCK_IDS}
        # When this reconciler last logged at INFO, and the idle runs since (see _log_counts).
        self._quiet_lock = threading.Lock()
        self._last_info = time.monotonic()
        self._idle_runs = 0
        #: The jobs, by name, in the order ``run_once`` runs them.
        self.jobs: dict[str, Job] = {
            job.name: Job(job.name, JOB_LOCK_IDS[job.name], job.run_once, getattr(job, "keep_lock", False))
            for job in self._build_jobs()
        }

    @classmethod
    def from_settings(
        cls,
        cfg: Settings,
        *,
        handlers: Mapping[str, Handler],
        module: str,
        alert_hook: AlertHook = log_alert,
        name: str | None = None,
        database_metrics_interval_seconds: float | None = None,
        liveness: Liveness | None = None,
    ) -> Reconciler:
        """Raises ``ConfigError`` when the database or Redis URL is missing: the production
        process never falls back to embedded servers."""
        return cls(
            database_url=cfg.require_database_url(),
            redis_url=cfg.require_redis_url(),
            handlers=handlers,
            module=module,
            namespace=cfg.namespace,
            redispatch_after_seconds=cfg.redispatch_after_seconds,
            retention_seconds=cfg.retention_seconds,
            ledger_horizon_seconds=cfg.ledger_horizon_seconds,
            unknown_alert_after_seconds=cfg.unknown_alert_after_seconds,
            lookup_concurrency=cfg.lookup_concurrency,
            alert_hook=alert_hook,
            name=name,
            no_consumer_cycles=cfg.no_consumer_cycles,
            database_metrics_interval_seconds=database_metrics_interval_seconds,
            liveness=liveness,
        )

    # -- resources -----------------------------------------------------------------------------

    def _conn(self, job: str) -> psycopg.Connection[Any]:
        conn = self._conns.get(job)
        if conn is None or conn.closed:
            conn = self._conns[job] = tolerate_unloadable(
                connect_raw(
                    self.database_url,
                    autocommit=True,
                    # The revision tells this code from a release before 0022 (outbox.features).
                    application_name=f"outbox-reconcile-{job}/{head_revision()}",
                )
            )
            if self.failover_guard is not None:
                # A new connection may be to a new server: check before a job acts on it.
                self.failover_guard.check_now()
        return conn

    def _drop(self, job: str) -> None:
        conn = self._conns.pop(job, None)
        if conn is not None and not conn.closed:
            conn.close()

    @property
    def redis(self) -> redis.Redis:
        with self._redis_lock:
            if self._redis is None:
                self._redis = transport.connect(self.redis_url, socket_timeout=10, socket_connect_timeout=5)
            return self._redis

    def close(self) -> None:
        """Close every connection and client this reconciler opened. Call once jobs stopped."""
        for job in list(self._conns):
            self._drop(job)
        with self._redis_lock:
            if self._redis is not None:
                self._redis.close()
                self._redis = None
        self._lookup_clients.close()

    def __enter__(self) -> Reconciler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the jobs ------------------------------------------------------------------------------

    def _build_jobs(self) -> tuple[MaintenanceJob, ...]:
        """The jobs in the order ``run_once`` runs them: a row whose lease expires is looked up one
        time_limit later, by a later run."""
        return (
            ExpireLeases(ExpireLeasesConfig(handlers=self.handlers)),
            ResolveUnknown(
                ResolveUnknownConfig(lookup_concurrency=self.lookup_concurrency),
                handlers=self.handlers,
                module=self.module,
                clients=self._lookup_clients,
                stop=self._stopping,
                alert=self.alert_hook,
            ),
            Redispatch(
                RedispatchConfig(
                    redispatch_after_seconds=self.redispatch_after_seconds,
                    grace_seconds=self.redispatch_grace_seconds,
                ),
                # Opened on first use: a reconciler whose jobs never reach Redis never connects.
                redis_client=lambda: self.redis,
                handlers=self.handlers,
                namespace=self.namespace,
                module=self.module,
                stop=self._stopping,
            ),
            Purge(
                PurgeConfig(
                    retention_seconds=self.retention_seconds,
                    ledger_horizon_seconds=self.ledger_horizon_seconds,
                )
            ),
            SendAlerts(
                SendAlertsConfig(unknown_alert_after_seconds=self.unknown_alert_after_seconds),
                self.alert_hook,
            ),
            NoConsumer(NoConsumerConfig(cycles_before_alert=self.no_consumer_cycles), self.alert_hook),
            HeldDestinations(
                HeldDestinationsConfig(),
                self.alert_hook,
                frozenset(d for d, h in self.handlers.items() if h.on_failed_head == "skip"),
            ),
            Chains(ChainsConfig(), self.handlers, self.module),
            Batches(BatchesConfig(), self.handlers, self.alert_hook),
        ) + (
            (DatabaseMetrics(self.database_metrics_interval_seconds, tuple(self.handlers)),)
            if self.database_metrics_interval_seconds is not None
            else ()
        )

    # -- running -------------------------------------------------------------------------------

    def run_job(self, name: str) -> dict[str, int]:
        """Run one job if this reconciler gets its lock; log and return its counts."""
        job = self.jobs[name]
        running = self._running.setdefault(name, threading.Lock())
        counts: dict[str, int]
        if self.failover_guard is not None and self.failover_guard.halted:
            counts = {"halted_by_failover": 1}
        elif not running.acquire(blocking=False):
            counts = {"skipped": 1}
        else:
            try:
                counts = self._locked(job)
            except Exception as exc:
                # A job that fails (database or Redis away) must not stop the others; its
                # connection is dropped so that the next run starts from a fresh one.
                self._drop(name)
                counts = {"error": 1}
                logger.error(
                    "reconciler job %s failed: %s: %s",
                    name,
                    type(exc).__name__,
                    exc,
                    exc_info=not isinstance(exc, psycopg.OperationalError | redis.ConnectionError),
                    extra={"job": name, "reconciler": self.name, "error": type(exc).__name__},
                )
            finally:
                running.release()
        self._log_counts(name, counts)
        metrics.count_reconciler_job(name, counts)
        if self.liveness is not None:
            self.liveness.beat()
        return counts

    def _log_counts(self, name: str, counts: dict[str, int]) -> None:
        # An idle reconciler (nothing to do, or another one holds the job) would fill the log with
        # one line per job every interval: those runs log at DEBUG, and one INFO line every
        # IDLE_HEARTBEAT_SECONDS says the reconciler is alive. A run that acted, failed or was
        # halted logs at INFO (its error, if any, is already logged at ERROR).
        idle = not counts or counts == {"skipped": 1}
        extra = {"job": name, "reconciler": self.name, **counts}
        shown = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "nothing to do"
        with self._quiet_lock:
            now = time.monotonic()
            if not idle:
                self._last_info, self._idle_runs = now, 0
            elif now - self._last_info >= IDLE_HEARTBEAT_SECONDS:
                quiet_seconds, idle_runs = now - self._last_info, self._idle_runs + 1
                self._last_info, self._idle_runs = now, 0
                logger.info(
                    "reconciler idle: %s job runs with nothing to do in the last %.0f s",
                    idle_runs,
                    quiet_seconds,
                    extra={"reconciler": self.name, "idle_runs": idle_runs, "_shown": ("idle_runs",)},
                )
            else:
                self._idle_runs += 1
        logger.log(logging.DEBUG if idle else logging.INFO, "reconciler %s: %s", name, shown, extra=extra)

    def _locked(self, job: Job) -> dict[str, int]:
        conn = self._conn(job.name)
        if self.failover_guard is not None and self.failover_guard.halted:
            return {"halted_by_failover": 1}
        if job.keep_lock and self._kept.get(job.name) is conn:
            return job.run(conn)
        got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (LOCK_CLASS, job.lock_id)).fetchone()
        if not (got and got[0]):
            return {"skipped": 1}
        if job.keep_lock:
            # Released with the connection: when this reconciler stops or loses it, another
            # one takes the job over at its next run.
            self._kept[job.name] = conn
            return job.run(conn)
        try:
            return job.run(conn)
        finally:
            if not conn.closed and not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_CLASS, job.lock_id))

    def run_once(self) -> dict[str, dict[str, int]]:
        """Run every job once, in order; returns ``{job: counts}``."""
        return {name: self.run_job(name) for name in self.jobs}

    def run_forever(self, stop: threading.Event, *, interval_seconds: float) -> None:
        """Run every job every ``interval_seconds`` until ``stop`` is set, then finish the jobs
        in hand and return. A job still running when its next turn comes is not doubled
        (``max_instances=1``) and missed turns collapse into one (``coalesce``)."""
        scheduler = BlockingScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=len(self.jobs))},
            timezone=UTC,
        )
        start = datetime.now(UTC)
        for name in self.jobs:
            scheduler.add_job(
                self.run_job,
                IntervalTrigger(seconds=interval_seconds, timezone=UTC),
                args=[name],
                id=name,
                name=f"reconciler {name}",
                coalesce=True,
                max_instances=1,
                misfire_grace_time=None,
                next_run_time=start,
            )

        def shutdown_on_stop() -> None:
            stop.wait()
            self._stopping.set()
            # wait=True: the jobs in hand finish before the process exits.
            with contextlib.suppress(SchedulerNotRunningError):
                scheduler.shutdown(wait=True)

        watcher = threading.Thread(target=shutdown_on_stop, name="reconciler-stop", daemon=True)
        # Started once the scheduler runs: a shutdown() before that would be refused and lost.
        scheduler.add_listener(lambda _event: watcher.start(), EVENT_SCHEDULER_STARTED)
        logger.info(
            "reconciler started: module=%s interval=%ss jobs=%s",
            self.module,
            interval_seconds,
            ",".join(self.jobs),
            extra={
                "reconciler": self.name,
                "handlers_module": self.module,
                "interval_seconds": interval_seconds,
                "jobs": list(self.jobs),
                "_shown": ("interval_seconds",),
            },
        )
        try:
            scheduler.start()
        finally:
            stop.set()
            if watcher.ident is not None:
                watcher.join()
            self._stopping.clear()
        logger.info("reconciler stopped", extra={"reconciler": self.name})
