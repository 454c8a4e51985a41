"""``outbox reconcile MODULE [--interval S] [--once]``: the scheduled reconciler process."""

from __future__ import annotations

import argparse
import logging
import os

from outbox.alerts import ALERT_HOOK_ENV

from .. import settings
from ..exceptions import ConfigError
from ..signals import stop_event_on_signals
from . import exits
from .common import add_module
from .handlers import load_handlers

logger = logging.getLogger(__name__)

_d = settings.describe_seconds
# The defaults, as the help text shows them (they live in outbox.settings).
_REDISPATCH = _d(settings.DEFAULT_REDISPATCH_AFTER_SECONDS)
_RETENTION = _d(settings.DEFAULT_RETENTION_SECONDS)
_HORIZON = _d(settings.DEFAULT_LEDGER_HORIZON_SECONDS)
_ALERT = _d(settings.DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS)
_CYCLES = settings.DEFAULT_NO_CONSUMER_CYCLES
_INTERVAL = _d(settings.DEFAULT_RECONCILE_INTERVAL_SECONDS)
_LOOKUPS = settings.DEFAULT_LOOKUP_CONCURRENCY

DESCRIPTION = f"""\
The reconciler: every interval it runs each job once, under a PostgreSQL advisory lock per job
(only one reconciler acts at a time; the others report "skipped").

  expire_leases    in_flight rows whose lease expired -> unknown (the worker died or overran);
                   their first lookup waits one time_limit of their destination
  resolve_unknown  asks the destination's @handler.lookup whether the call took effect
                   (up to OUTBOX_LOOKUP_CONCURRENCY lookups of a destination at once):
                   found -> sent; no record -> pending (retry) or failed (attempts/deadline
                   exhausted); lookup error -> stays unknown, asked again later. Without a
                   lookup: idempotent destinations are retried, others wait for a human
                   (outbox resolve). A row whose destination MODULE has no handler for stays
                   unknown, with the reason as its last error: never failed by the reconciler.
  redispatch       dispatched rows whose Redis message is gone -> pending, so the relay
                   publishes them again; a message a worker fetched and left unacked for longer
                   than OUTBOX_REDISPATCH_AFTER (default {_REDISPATCH}) is removed from Redis first, so
                   the new one replaces it. A message still waiting in its queue is never
                   re-published, whatever its age. Rows for a destination MODULE has no handler
                   for are re-dispatched alike and logged (count no_handler), never failed.
                   A paused destination's rows, and those behind an open circuit breaker, are
                   left alone; a half-open breaker gets its oldest waiting row (the probe).
  purge            moves sent/cancelled rows older than OUTBOX_RETENTION (default {_RETENTION}) into the
                   key ledger (key, step, destination, payload hash, final state, provider ref,
                   attempts) in the statement that deletes them, so writing the key again answers
                   as before the purge; drops ledger entries older than OUTBOX_LEDGER_HORIZON
                   (default {_HORIZON}, at least the retention), in batches by age. Finished
                   batches (outbox.batch) with no member left lose their then/catch payloads at
                   the retention and their names at the horizon. Needs a role
                   that is superuser or a member of pg_read_all_stats (or pg_monitor), to wait
                   for other roles' open transactions; without it the purge moves nothing and
                   logs "purge skipped" (count skipped_no_stats_privilege; outbox doctor fails).
  alerts           reports each failed row, and each row unknown for longer than
                   OUTBOX_UNKNOWN_ALERT_AFTER (default {_ALERT}), once, through the alert hook
                   (default: an ERROR log line naming key, step, destination and reason).
  no_consumer      destinations with rows waiting and no live worker heartbeat serving their
                   queue for OUTBOX_NO_CONSUMER_CYCLES (default {_CYCLES}) runs: reported once per
                   episode through the alert hook ("no consumer for D since T, K rows
                   waiting"); also deletes heartbeats older than a day.
  held_destinations a pause (outbox pause, a Retry-After hold) or an open circuit breaker that
                   lasts a minute: reported once per episode through the alert hook (state
                   paused / breaker_open), the mark cleared when it ends; waiting rows of such
                   a destination whose deadline passed -> failed (no call was made after it), or
                   -> unknown when an earlier call of it may have taken effect (the lookup decides).

Environment: OUTBOX_DATABASE_URL, OUTBOX_REDIS_URL (both required), OUTBOX_NAMESPACE,
OUTBOX_RECONCILE_INTERVAL (default {_INTERVAL}), OUTBOX_REDISPATCH_AFTER, OUTBOX_RETENTION,
OUTBOX_LEDGER_HORIZON (--ledger-horizon wins), OUTBOX_UNKNOWN_ALERT_AFTER,
OUTBOX_NO_CONSUMER_CYCLES, OUTBOX_LOOKUP_CONCURRENCY (default {_LOOKUPS}; --lookup-concurrency wins),
{ALERT_HOOK_ENV} (package.module:function; --alert-hook wins).
Durations accept 30, 30s, 15m, 12h, 7d. SIGTERM/SIGINT finish the jobs in hand and exit 0.
"""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_module(
        parser,
        "importable module declaring the @outbox.handler functions (and their lookups), e.g. myapp.handlers",
        required=True,
    )
    parser.add_argument(
        "--interval",
        metavar="S",
        help="seconds between two runs of each job, e.g. 10, 30s, 1m "
        f"(default: $OUTBOX_RECONCILE_INTERVAL or {settings.DEFAULT_RECONCILE_INTERVAL_SECONDS:g})",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="run every job a single time, print the counts and exit (1 if a job failed)",
    )
    parser.add_argument(
        "--ledger-horizon",
        metavar="DURATION",
        help="how long a purged key stays in the key ledger after its row completed, e.g. 90d; "
        "past it, writing the key again makes a new call "
        f"(default: $OUTBOX_LEDGER_HORIZON or {_d(settings.DEFAULT_LEDGER_HORIZON_SECONDS)}; "
        "at least the retention)",
    )
    parser.add_argument(
        "--lookup-concurrency",
        metavar="N",
        type=int,
        help="lookups of one destination in flight at once while settling unknown rows; each "
        "destination starts at one and doubles while its lookups answer "
        f"(default: $OUTBOX_LOOKUP_CONCURRENCY or {settings.DEFAULT_LOOKUP_CONCURRENCY})",
    )
    parser.add_argument(
        "--alert-hook",
        metavar="MODULE:FUNCTION",
        help=f"called with each outbox.alerts.AlertRow to report (default: ${ALERT_HOOK_ENV}, "
        "else an ERROR log line)",
    )


def _interval(args: argparse.Namespace, cfg: settings.Settings) -> float:
    if args.interval is None:
        return cfg.reconcile_interval_seconds
    seconds = settings.parse_seconds(args.interval, "--interval")
    if seconds <= 0:
        raise ConfigError(f"--interval {args.interval!r} must be greater than zero")
    return seconds


def _ledger_horizon(args: argparse.Namespace, cfg: settings.Settings) -> float:
    if args.ledger_horizon is None:
        return cfg.ledger_horizon_seconds
    seconds = settings.parse_seconds(args.ledger_horizon, "--ledger-horizon")
    if seconds < cfg.retention_seconds:
        raise ConfigError(
            f"--ledger-horizon {args.ledger_horizon!r} must be at least OUTBOX_RETENTION "
            f"({cfg.retention_seconds:g} s): the ledger would forget keys as soon as they are purged"
        )
    return seconds


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from outbox.alerts import load_alert_hook
    from outbox.reconciler.scheduler import Reconciler

    from .. import transport
    from ..failover import FailoverGuard
    from ..heartbeat import Heartbeat
    from ..migrate import check_database
    from ..probes import LIVENESS_FLOOR_SECONDS, Liveness, check_metrics_environment, serve

    # Checked before anything else: a missing URL is one clear line, never an embedded server.
    database_url = cfg.require_database_url()
    redis_url = cfg.require_redis_url()
    interval = _interval(args, cfg)
    check_metrics_environment()
    if args.lookup_concurrency is not None and args.lookup_concurrency < 1:
        raise ConfigError(f"--lookup-concurrency must be at least 1, got {args.lookup_concurrency}")
    cfg = cfg.replace(
        ledger_horizon_seconds=_ledger_horizon(args, cfg), lookup_concurrency=args.lookup_concurrency
    )
    hook = load_alert_hook(args.alert_hook or os.environ.get(ALERT_HOOK_ENV))
    check_database(database_url)
    # An evicting Redis loses messages on its own; the redispatch job is the remedy, but the
    # deployment is still wrong, and every process says so the same way.
    transport.check_at_start(redis_url, cfg.namespace, allow_evicting=cfg.allow_evicting_redis)
    handlers = load_handlers(args.module)
    serving = cfg.metrics_port is not None and not args.once
    liveness = Liveness(stale_after_seconds=max(LIVENESS_FLOOR_SECONDS, 3 * interval))
    reconciler = Reconciler.from_settings(
        cfg,
        handlers=handlers,
        module=args.module,
        alert_hook=hook,
        database_metrics_interval_seconds=interval if serving else None,
        liveness=liveness,
    )
    # Checked now and every OUTBOX_FAILOVER_CHECK_INTERVAL s: on another database history the
    # jobs stop until `outbox failover --accept` (outbox.failover).
    reconciler.failover_guard = FailoverGuard(database_url, process="reconciler").start()
    try:
        if args.once:
            results = reconciler.run_once()
            for job, counts in results.items():
                shown = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "nothing to do"
                print(f"{job}: {shown}")
            # A job that raised (database or Redis away) is already logged; cron should see it.
            return exits.FAILED if any(counts.get("error") for counts in results.values()) else exits.OK
        stop = stop_event_on_signals()
        probes = serve(
            cfg.metrics_port if serving else None,
            process="reconciler",
            liveness=liveness,
            database_url=database_url,
            redis_url=redis_url,
        )
        # Beats with the schema range of this code: `outbox features enable` waits for older ones.
        heartbeat = Heartbeat(
            database_url, kind="reconciler", interval_seconds=cfg.heartbeat_interval_seconds
        ).start()
        try:
            reconciler.run_forever(stop, interval_seconds=interval)
        finally:
            heartbeat.stop()
            if probes is not None:
                probes.stop()
        return exits.OK
    finally:
        reconciler.failover_guard.stop()
        reconciler.close()
