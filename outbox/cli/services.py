"""The services: ``outbox migrate``, ``outbox relay`` and ``outbox worker``."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading

from .. import settings
from ..exceptions import ConfigError
from ..probes import (
    CHILD_BEATS_ENV,
    LIVENESS_FLOOR_SECONDS,
    FileBeat,
    Liveness,
    check_metrics_environment,
    serve,
)
from ..signals import stop_event_on_signals
from . import exits
from .common import add_module
from .flags import duration
from .handlers import load_handlers

logger = logging.getLogger(__name__)


#: As the help text shows it (the default lives in outbox.settings).
_HEARTBEAT = settings.describe_seconds(settings.DEFAULT_HEARTBEAT_INTERVAL_SECONDS)


def migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Create or upgrade the outbox tables. Safe to run twice, and concurrently."
    p.add_argument(
        "--wait",
        type=duration("--wait"),
        default=0.0,
        metavar="DURATION",
        help="wait up to this long (e.g. 60s, 2m) for a PostgreSQL that is not accepting "
        "connections yet, as a fresh database container (default: 0, fail at once)",
    )


def relay_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "The relay sidecar: takes due pending rows in batches (SKIP LOCKED, so several "
        "relays may run), publishes them to Dramatiq queues in one Redis pipeline per batch, "
        "marks them dispatched. Wakes on NOTIFY, polls every OUTBOX_POLL_INTERVAL seconds as "
        "a fallback. SIGTERM finishes the batch and exits 0. Refuses to start on a Redis "
        "that may evict keys."
    )
    p.add_argument("--once", action="store_true", help="drain what is due now, then exit")
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"rows per batch (default $OUTBOX_RELAY_BATCH_SIZE or {settings.DEFAULT_RELAY_BATCH_SIZE})",
    )
    p.add_argument(
        "--connections",
        type=int,
        help="connections taking batches at once during a backlog "
        f"(default $OUTBOX_RELAY_CONNECTIONS or {settings.DEFAULT_RELAY_CONNECTIONS})",
    )


def worker_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Dramatiq worker for the @outbox.handler functions declared in MODULE: one queue per "
        "destination. Each message is claimed, handled, recorded and only then acked. "
        "Each process records a heartbeat (queues served, its clock) in the database every "
        f"OUTBOX_HEARTBEAT_INTERVAL (default {_HEARTBEAT}), read by `outbox status`, `outbox doctor` "
        "and the reconciler's no-consumer alert. SIGTERM or Ctrl-C finishes the messages in hand "
        "(for up to the longest lease of MODULE's handlers) and exits 0; a second Ctrl-C exits at "
        "once (130), leaving their rows claimed until their leases expire."
    )
    add_module(p, "importable module declaring the handlers, e.g. myapp.handlers", required=True)
    p.add_argument("--processes", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--concurrency",
        type=int,
        help="calls in flight per process: threads for sync handlers, tasks for async ones; claims "
        "and records share a few database connections whatever the number "
        f"(default $OUTBOX_WORKER_CONCURRENCY or {settings.DEFAULT_WORKER_CONCURRENCY})",
    )
    p.add_argument("--threads", type=int, help="deprecated: the former name of --concurrency")
    p.add_argument(
        "--slots-per-destination",
        type=int,
        metavar="N",
        help="deliveries one destination may hold at once in a process, so a slow provider "
        "leaves slots to the others (default $OUTBOX_WORKER_SLOTS_PER_DESTINATION, else all of "
        "--concurrency when the worker serves one destination, three quarters with several)",
    )
    p.add_argument("--queues", nargs="+", metavar="DESTINATION", help="only these destinations")


def migrate(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..db import make_engine
    from ..migrate import upgrade, upgrade_when_accepting

    engine = make_engine(cfg.require_database_url())
    try:
        before, after = (
            upgrade_when_accepting(engine, wait_seconds=args.wait) if args.wait else upgrade(engine)
        )
    finally:
        engine.dispose()
    if before == after:
        print(f"outbox schema already at revision {after}; nothing to do")
    else:
        print(f"outbox schema migrated from {before or 'empty'} to revision {after}")
    return exits.OK


def relay(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from outbox.relay import Relay

    from .. import transport
    from ..failover import FailoverGuard
    from ..heartbeat import Heartbeat
    from ..migrate import check_database

    # First, so that a SIGTERM during the start-up checks is a clean stop, not a kill.
    stop = stop_event_on_signals()
    database_url = cfg.require_database_url()
    hot_database_url = cfg.require_hot_database_url()
    redis_url = cfg.require_redis_url()
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.connections is not None and args.connections < 1:
        raise ConfigError(f"--connections must be at least 1, got {args.connections}")
    check_metrics_environment()
    check_database(database_url)
    transport.check_at_start(redis_url, cfg.namespace, allow_evicting=cfg.allow_evicting_redis)
    # Checked now and every OUTBOX_FAILOVER_CHECK_INTERVAL s: on another database history the
    # relay publishes nothing until `outbox failover --accept` (outbox.failover).
    guard = FailoverGuard(database_url, process="relay").start()
    relay = Relay(
        database_url=hot_database_url,
        direct_database_url=database_url,
        pooled=cfg.pooled,
        redis_url=redis_url,
        namespace=cfg.namespace,
        batch_size=args.batch_size or cfg.relay_batch_size,
        parallel=args.connections or cfg.relay_connections,
        poll_interval_seconds=cfg.poll_interval_seconds,
        gather_seconds=cfg.relay_gather_seconds,
        failover_guard=guard,
    )
    if args.once:
        try:
            total = relay.drain(stop)
        finally:
            relay.close()
            guard.stop()
        if guard.halted:
            print(
                "relay published nothing: the database identity changed or could not be checked "
                "(see `outbox failover`)"
            )
            return exits.FAILED
        stopped = "; stopped by a signal before the backlog was drained" if stop.is_set() else ""
        print(f"relay published {total} rows{stopped}")
        return exits.OK
    liveness = Liveness(stale_after_seconds=max(LIVENESS_FLOOR_SECONDS, 3 * cfg.poll_interval_seconds))
    relay.liveness = liveness
    probes = serve(
        cfg.metrics_port, process="relay", liveness=liveness, database_url=database_url, redis_url=redis_url
    )
    logger.info(
        "relay started: namespace=%s batch_size=%s connections=%s poll_interval=%ss gather=%ss",
        cfg.namespace,
        relay.batch_size,
        relay.parallel,
        cfg.poll_interval_seconds,
        relay.gather_seconds,
        extra={
            "namespace": cfg.namespace,
            "batch_size": relay.batch_size,
            "connections": relay.parallel,
            "poll_interval_seconds": cfg.poll_interval_seconds,
            "gather_seconds": relay.gather_seconds,
            "_shown": ("poll_interval_seconds", "gather_seconds"),
        },
    )
    # Beats with the schema range of this code: `outbox features enable` waits for older relays.
    heartbeat = Heartbeat(
        hot_database_url, kind="relay", interval_seconds=cfg.heartbeat_interval_seconds, pooled=cfg.pooled
    ).start()
    try:
        relay.run_forever(stop)
    finally:
        heartbeat.stop()
        guard.stop()
        if probes is not None:
            probes.stop()
    logger.info("relay stopped")
    return exits.OK


def worker(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from .. import transport
    from ..migrate import check_database
    from ..worker import force_before_start, run_worker, supervise

    # First, so that a SIGTERM during the start-up checks is a clean stop, not a kill; and a
    # second one exits at once, whatever a check waits for.
    stop = stop_event_on_signals()
    force_before_start(stop)
    force_before_start(stop)
    database_url = cfg.require_database_url()
    hot_database_url = cfg.require_hot_database_url()
    redis_url = cfg.require_redis_url()
    concurrency = worker_concurrency(args, cfg)
    slots = args.slots_per_destination or cfg.worker_slots_per_destination
    if args.slots_per_destination is not None and args.slots_per_destination < 1:
        raise ConfigError(f"--slots-per-destination must be at least 1, got {args.slots_per_destination}")
    if args.processes < 1:
        raise ConfigError(f"--processes must be at least 1, got {args.processes}")
    check_metrics_environment()
    check_database(database_url)
    handlers = load_handlers(args.module)
    transport.check_at_start(redis_url, cfg.namespace, allow_evicting=cfg.allow_evicting_redis)
    if args.processes > 1:
        # The children log at the parent's level (from a flag or $OUTBOX_LOG_LEVEL alike).
        child_argv = [
            "--log-level",
            args.log_level,
            "worker",
            args.module,
            "--processes",
            "1",
            "--concurrency",
            str(concurrency),
        ]
        if slots is not None:
            child_argv += ["--slots-per-destination", str(slots)]
        if args.queues:
            child_argv += ["--queues", *args.queues]
        # The children read the resolved settings from their environment, flags included.
        os.environ.update(
            OUTBOX_DATABASE_URL=hot_database_url, OUTBOX_REDIS_URL=redis_url, OUTBOX_NAMESPACE=cfg.namespace
        )
        if cfg.pooled:
            os.environ.update(
                OUTBOX_DATABASE_POOLER=settings.POOLER_TRANSACTION, OUTBOX_DIRECT_DATABASE_URL=database_url
            )
        # The parent serves the endpoints; a child binding the same port would fail to start.
        os.environ.pop("OUTBOX_METRICS_PORT", None)
    beats = os.environ.get(CHILD_BEATS_ENV) if args.processes == 1 else None
    liveness = (
        FileBeat(beats, LIVENESS_FLOOR_SECONDS)
        if beats
        else Liveness(stale_after_seconds=LIVENESS_FLOOR_SECONDS)
    )
    if args.processes > 1 and cfg.metrics_port is not None:
        return _supervise_with_metrics(
            child_argv, args.processes, stop, liveness, cfg.metrics_port, database_url, redis_url
        )
    probes = serve(
        cfg.metrics_port, process="worker", liveness=liveness, database_url=database_url, redis_url=redis_url
    )
    try:
        if args.processes > 1:
            return supervise(child_argv, args.processes, stop, liveness)
        # What start-up built (modules, handlers) lives as long as the process: out of the
        # collector's sight, a full collection walks only what deliveries make. An async
        # worker's longest pauses (every thread stopped) went from ~100 ms to ~50 ms.
        gc.collect()
        gc.freeze()
        return run_worker(
            database_url=hot_database_url,
            direct_database_url=database_url,
            pooled=cfg.pooled,
            redis_url=redis_url,
            namespace=cfg.namespace,
            handlers=handlers,
            queues=args.queues,
            concurrency=concurrency,
            slots_per_destination=slots,
            stop=stop,
            heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
            liveness=liveness,
        )
    finally:
        if probes is not None:
            probes.stop()


def worker_concurrency(args: argparse.Namespace, cfg: settings.Settings) -> int:
    """``--concurrency``, else ``--threads`` (its former name, accepted with a warning for one
    release), else the setting."""
    if args.concurrency is not None and args.threads is not None:
        raise ConfigError("--threads is the former name of --concurrency: give one of them")
    if args.threads is not None:
        print(
            "outbox worker: --threads is deprecated, use --concurrency (same meaning); "
            "--threads will be removed in the next release",
            file=sys.stderr,
        )
    concurrency = args.concurrency if args.concurrency is not None else args.threads
    if concurrency is None:
        concurrency = cfg.worker_concurrency
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    return int(concurrency)


def _supervise_with_metrics(
    child_argv: list[str],
    processes: int,
    stop: threading.Event,
    liveness: Liveness,
    port: int,
    database_url: str,
    redis_url: str,
) -> int:
    """The children count into files of a directory made for this run (prometheus_client's
    multiprocess mode: the variable is read when a child imports it); the parent serves their
    sum, and drops the directory when they have all stopped."""
    from .. import metrics
    from ..probes import CHILD_BEATS_ENV, ChildrenLiveness, ProbeServer, Readiness
    from ..worker import supervise

    directory = tempfile.mkdtemp(prefix="outbox-worker-metrics-")
    try:
        os.environ[metrics.MULTIPROCESS_ENV] = directory
        # The children beat into files here; /healthz is stale when any of them stops beating.
        beats = os.path.join(directory, "beats")
        os.mkdir(beats)
        os.environ[CHILD_BEATS_ENV] = beats
        children = ChildrenLiveness(beats, liveness.stale_after_seconds)

        def ended(pid: int) -> None:
            children.child_ended(pid)
            metrics.mark_process_dead(pid, directory)

        probes = ProbeServer(
            port,
            process="worker",
            liveness=children,
            readiness=Readiness(database_url, redis_url),
            render_metrics=metrics.multiprocess_renderer(directory),
        ).start()
        try:
            return supervise(
                child_argv, processes, stop, children, on_exit=ended, on_start=children.child_started
            )
        finally:
            probes.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
