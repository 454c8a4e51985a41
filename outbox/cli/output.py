"""What the commands print: text or one JSON document on stdout, and errors as one line.

With ``--json`` a command prints exactly one JSON document: its data, or for an error
``{"error": {"message": …, "exit_code": N}}``; a command that did part of what was asked (some
rows refused) prints its data with that ``error`` member added. Without ``--json`` errors go to
stderr as ``outbox: message``; a usage error as ``outbox CMD: error: message (outbox CMD --help)``
(``outbox.cli.common.usage_error``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from . import exits

logger = logging.getLogger(__name__)


def out(text: str) -> None:
    """Print to stdout; a reader that went away (``outbox failed | head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def err(message: str) -> None:
    print(f"outbox: {message}", file=sys.stderr)


def error_member(message: str, exit_code: int) -> dict[str, Any]:
    return {"error": {"message": message, "exit_code": exit_code}}


def print_json(data: Any, *, error: str | None = None, exit_code: int = exits.OK) -> int:
    """Print one JSON document; with ``error``, the ``error`` member too. Returns ``exit_code``."""
    from .render import to_json

    if error is not None:
        data = (
            {**data, **error_member(error, exit_code)}
            if isinstance(data, dict)
            else error_member(error, exit_code)
        )
    out(to_json(data))
    return exit_code


def fail(message: str, exit_code: int, *, as_json: bool) -> int:
    """Report an error (one line, or the error document) and return its exit code."""
    if as_json:
        out(json.dumps(error_member(message, exit_code), indent=2, ensure_ascii=False))
    else:
        err(message)
    return exit_code


def _classify(exc: Exception) -> tuple[str, int]:
    # The driver modules are looked up, not imported: `outbox --help` must not load them, and an
    # error of a module nobody imported cannot have been raised.
    from ..exceptions import ConfigError, OutboxError
    from ..logs import first_line
    from .extras import missing_extra

    if isinstance(exc, ConfigError):
        return str(exc), exits.CONFIG
    missing = missing_extra(exc)
    if missing is not None:
        return missing, exits.CONFIG
    sa_exc = sys.modules.get("sqlalchemy.exc")
    psycopg = sys.modules.get("psycopg")
    redis_exc = sys.modules.get("redis.exceptions")
    orig = getattr(exc, "orig", None)
    if psycopg is not None and isinstance(orig or exc, psycopg.errors.UndefinedTable):
        return (
            "the outbox tables are missing from this database (not migrated, or another "
            f"database): run `outbox migrate` ({first_line(exc)})",
            exits.FAILED,
        )
    if (sa_exc is not None and isinstance(exc, sa_exc.OperationalError)) or (
        psycopg is not None and isinstance(exc, psycopg.OperationalError)
    ):
        return f"cannot reach PostgreSQL: {first_line(exc)}", exits.UNAVAILABLE
    if redis_exc is not None and isinstance(exc, redis_exc.ConnectionError):
        return f"cannot reach Redis: {first_line(exc)}", exits.UNAVAILABLE
    if isinstance(exc, OutboxError):
        return str(exc), exits.FAILED
    # A bug or an unforeseen failure: one line here, the traceback in the log at DEBUG.
    logger.debug("unexpected error", exc_info=exc)
    return (
        f"unexpected {type(exc).__name__}: {first_line(exc)} (--log-level debug shows the traceback)",
        exits.FAILED,
    )


def report_error(exc: Exception, *, as_json: bool) -> int:
    message, code = _classify(exc)
    return fail(message, code, as_json=as_json)
