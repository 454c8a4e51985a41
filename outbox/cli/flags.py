"""The flags shared by several commands, defined once.

Each is accepted before and after the subcommand (``outbox --json status`` and ``outbox status
--json``): the top-level parser and the subcommand's both define it with no default, so whichever
the operator gave survives, and ``defaults`` fills in the rest.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

from ..exceptions import ConfigError

DATABASE = "database"
REDIS = "redis"
JSON = "json"
METRICS = "metrics"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = "OUTBOX_LOG_LEVEL"


def log_level(value: str) -> str:
    """A level name in any case (``debug``, ``Info``), as the logging module spells it."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(LOG_LEVELS)} (any case)")
    return level


def duration(flag: str) -> Callable[[str], float]:
    """An argparse ``type``: ``flag``'s value as seconds (``90``, ``90s``, ``15m``), 0 or more."""

    def parse(value: str) -> float:
        from .. import settings

        try:
            seconds = settings.parse_seconds(value, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if seconds < 0:
            raise argparse.ArgumentTypeError(f"{flag} must not be negative, got {value!r}")
        return seconds

    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    """An argparse ``type``: ``flag``'s value as a whole number, 1 or more."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {value!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be 1 or more, got {value!r}")
        return n

    return parse


def add_global(parser: argparse.ArgumentParser, *, from_environment: bool = True) -> None:
    """--log-level: every command takes it, before or after the subcommand."""
    default = f"${LOG_LEVEL_ENV} or INFO" if from_environment else "INFO"
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=argparse.SUPPRESS,
        metavar="LEVEL",
        help=f"log verbosity: {', '.join(LOG_LEVELS)}, any case (default: {default})",
    )


def add_shared(parser: argparse.ArgumentParser, flags: frozenset[str]) -> None:
    """The shared flags among ``flags`` (DATABASE, REDIS with --namespace, JSON)."""
    if DATABASE in flags:
        parser.add_argument(
            "--database-url",
            default=argparse.SUPPRESS,
            help="PostgreSQL URL, postgresql://… (default: $OUTBOX_DATABASE_URL)",
        )
    if REDIS in flags:
        parser.add_argument(
            "--redis-url",
            default=argparse.SUPPRESS,
            help="Redis URL, redis://… or redis+sentinel://… (default: $OUTBOX_REDIS_URL)",
        )
        parser.add_argument(
            "--namespace",
            default=argparse.SUPPRESS,
            help="prefix of the broker's Redis keys (default: $OUTBOX_NAMESPACE or outbox)",
        )
    if METRICS in flags:
        parser.add_argument(
            "--metrics-port",
            type=_port,
            default=argparse.SUPPRESS,
            metavar="PORT",
            help="serve /metrics, /healthz and /readyz on this TCP port, all interfaces "
            "(default: $OUTBOX_METRICS_PORT; none)",
        )
    if JSON in flags:
        parser.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help='print one JSON document on stdout (errors too: {"error": {"message", "exit_code"}})',
        )


def _port(value: str) -> int:
    from ..settings import parse_port

    try:
        return parse_port(value, "--metrics-port")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


ALL = frozenset({DATABASE, REDIS, JSON, METRICS})

#: Flags taking a value, to find the subcommand in argv before parsing (outbox.cli.main).
WITH_VALUE = frozenset({"--log-level", "--database-url", "--redis-url", "--namespace", "--metrics-port"})


def defaults(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Fill in the shared flags nobody gave; the log level from $OUTBOX_LOG_LEVEL of ``environ``
    (default: the process's environment)."""
    for name in ("database_url", "redis_url", "namespace", "metrics_port"):
        if not hasattr(args, name):
            setattr(args, name, None)
    if not hasattr(args, "json"):
        args.json = False
    if not hasattr(args, "log_level"):
        raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV) or "INFO"
        try:
            args.log_level = log_level(raw)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{LOG_LEVEL_ENV}: {exc}") from None
