"""``outbox reconcile MODULE [--interval S] [--once]``: the scheduled reconciler process."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

from outbox import settings
from outbox.exceptions import ConfigError

from .alerts import ALERT_HOOK_ENV, load_alert_hook

logger = logging.getLogger(__name__)

HELP = "expire leases, resolve unknown rows, re-queue lost messages, purge, alert"

DESCRIPTION = f"""\
The reconciler: every interval it runs each job once, under a PostgreSQL advisory lock per job
(only one reconciler acts at a time; the others report "skipped").

  expire_leases    in_flight rows whose lease expired -> unknown (the worker died or overran);
                   their first lookup waits one time_limit of their destination
  resolve_unknown  asks the destination's @handler.lookup whether the call took effect:
                   found -> sent; no record -> pending (retry) or failed (attempts/deadline
                   exhausted); lookup error -> stays unknown, asked again later. Without a
                   lookup: idempotent destinations are retried, others wait for a human
                   (outbox resolve).
  redispatch       dispatched rows whose Redis message is gone, or unclaimed for longer than
                   OUTBOX_REDISPATCH_AFTER (default 300 s) -> pending, so the relay publishes
                   them again; a message still waiting in a long queue is left alone. Rows for
                   a destination MODULE has no handler for -> failed.
  purge            deletes sent/cancelled rows older than OUTBOX_RETENTION (default 7d).
  alerts           reports each failed row, and each row unknown for longer than
                   OUTBOX_UNKNOWN_ALERT_AFTER (default 1h), once, through the alert hook
                   (default: an ERROR log line naming key, step, destination and reason).

Environment: OUTBOX_DATABASE_URL, OUTBOX_REDIS_URL (both required), OUTBOX_NAMESPACE,
OUTBOX_RECONCILE_INTERVAL (default 10 s), OUTBOX_REDISPATCH_AFTER, OUTBOX_RETENTION,
OUTBOX_UNKNOWN_ALERT_AFTER, {ALERT_HOOK_ENV} (package.module:function; --alert-hook wins).
Durations accept 30, 30s, 15m, 12h, 7d. SIGTERM/SIGINT finish the jobs in hand and exit 0.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--database-url", help="PostgreSQL URL, postgresql://… (default: $OUTBOX_DATABASE_URL)"
    )
    parser.add_argument("--redis-url", help="Redis URL, redis://… (default: $OUTBOX_REDIS_URL)")
    parser.add_argument(
        "--namespace", help="prefix of the broker's Redis keys (default: $OUTBOX_NAMESPACE or outbox)"
    )
    parser.add_argument(
        "module",
        metavar="MODULE",
        help="importable module declaring the @outbox.handler functions (and their lookups), "
        "e.g. myapp.handlers",
    )
    parser.add_argument(
        "--interval",
        metavar="S",
        help="seconds between two runs of each job, e.g. 10, 30s, 1m "
        "(default: $OUTBOX_RECONCILE_INTERVAL or 10)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="run every job a single time, print the counts and exit (1 if a job failed)",
    )
    parser.add_argument(
        "--alert-hook",
        metavar="MODULE:FUNCTION",
        help=f"called with each reconciler.alerts.AlertRow to report (default: ${ALERT_HOOK_ENV}, "
        "else an ERROR log line)",
    )


def _interval(args: argparse.Namespace, cfg: settings.Settings) -> float:
    if args.interval is None:
        return cfg.reconcile_interval_seconds
    seconds = settings.parse_seconds(args.interval, "--interval")
    if seconds <= 0:
        raise ConfigError(f"--interval {args.interval!r} must be greater than zero")
    return seconds


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from outbox import transport
    from outbox.cli import stop_event_on_signals
    from outbox.handlers import load_module
    from outbox.migrate import check_database

    from .scheduler import Reconciler

    # Checked before anything else: a missing URL is one clear line, never an embedded server.
    database_url = cfg.require_database_url()
    redis_url = cfg.require_redis_url()
    interval = _interval(args, cfg)
    hook = load_alert_hook(args.alert_hook or os.environ.get(ALERT_HOOK_ENV))
    check_database(database_url)
    # An evicting Redis loses messages on its own; the redispatch job is the remedy, but the
    # deployment is still wrong, and every process says so the same way.
    transport.check_at_start(redis_url, cfg.namespace, allow_evicting=cfg.allow_evicting_redis)
    handlers = load_module(args.module)
    reconciler = Reconciler.from_settings(cfg, handlers=handlers, module=args.module, alert_hook=hook)
    try:
        if args.once:
            results = reconciler.run_once()
            for job, counts in results.items():
                shown = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "nothing to do"
                print(f"{job}: {shown}")
            # A job that raised (database or Redis away) is already logged; cron should see it.
            return 1 if any(counts.get("error") for counts in results.values()) else 0
        stop = stop_event_on_signals()
        reconciler.run_forever(stop, interval_seconds=interval)
        return 0
    finally:
        reconciler.close()


Command = Callable[[argparse.Namespace, settings.Settings], int]

#: Plugged into the ``outbox`` console script by ``outbox.cli``.
COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Command]] = [
    ("reconcile", HELP, add_arguments, run),
]
