"""Engines and raw connections, with the psycopg 3 driver whatever URL form the user has, directly
to PostgreSQL or through a pooler in transaction mode."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
import psycopg.conninfo
import psycopg.types.json
from psycopg.adapt import Loader
from psycopg.pq import Format
from sqlalchemy import Engine, create_engine

from .payloads import Unreadable
from .settings import libpq_url, normalize_database_url, tcp_settings

_NAMED = re.compile(r"%\((\w+)\)s")


class Statement:
    """A hot statement whose ``%(name)s`` placeholders are turned into ``$1, $2 …`` once, at
    import, and run on a :class:`psycopg.RawCursor`.

    psycopg parses a query's placeholders on every execute unless the query is under 4,096
    characters (then it caches the result); the claim is longer, and parsing it at every
    delivery shows in a worker's CPU (docs/decisions/hot-path-costs.md). Same statement, same
    parameters (by name), same adaptation; the server still prepares it after a few executions,
    as for any query."""

    __slots__ = ("names", "sql")

    def __init__(self, sql: str) -> None:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        converted = _NAMED.sub(number, sql)
        if "%" in converted or not names:
            # A literal % would need %% in the named form and must stay as it is here: refuse
            # rather than guess (none of the hot statements has one).
            raise ValueError("Statement: only %(name)s placeholders and no literal %")
        self.sql = converted
        self.names = tuple(names)

    def execute(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> psycopg.RawCursor[Any]:
        """Run on the connection's own cursor, made once: a new cursor per statement built its
        adaptation state again every time (docs/decisions/hot-path-costs.md). Its result is
        read before the next statement on that connection (one thread uses a connection)."""
        cursor: psycopg.RawCursor[Any] | None = getattr(conn, "_outbox_cursor", None)
        if cursor is None or cursor.closed:
            cursor = psycopg.RawCursor(conn)
            conn._outbox_cursor = cursor  # type: ignore[attr-defined]
        return cursor.execute(self.sql, [params[name] for name in self.names])


def tcp_parameters(url: str) -> dict[str, int]:
    """libpq's TCP keepalive and ``tcp_user_timeout`` parameters from ``OUTBOX_TCP_*``, and its
    ``connect_timeout`` from ``OUTBOX_CONNECT_TIMEOUT`` (docs/configuration.md), less those the URL
    sets itself (and ``connect_timeout`` when ``PGCONNECT_TIMEOUT`` is set): the user's win.
    Without them a connection over a link that silently drops packets hangs until the kernel
    gives up on its retransmissions, about 15 minutes, and a connect to a server that accepts
    and never answers hangs for ever. libpq ignores the TCP ones on a Unix socket."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(libpq_url(url))
    except psycopg.Error:
        given = {}  # the connect itself reports what is wrong with the URL
    tcp = tcp_settings()
    wanted = {
        "keepalives": 1,
        "keepalives_idle": tcp.keepalive_idle_seconds,
        "keepalives_interval": tcp.keepalive_interval_seconds,
        "keepalives_count": tcp.keepalive_count,
    }
    if tcp.user_timeout_ms:
        wanted["tcp_user_timeout"] = tcp.user_timeout_ms
    if tcp.connect_timeout_seconds and not os.environ.get("PGCONNECT_TIMEOUT"):
        wanted["connect_timeout"] = tcp.connect_timeout_seconds
    return {name: value for name, value in wanted.items() if name not in given}


def make_engine(url: str, **options: Any) -> Engine:
    options.setdefault("pool_pre_ping", True)
    options["connect_args"] = {**tcp_parameters(url), **options.get("connect_args", {})}
    return create_engine(normalize_database_url(url), **options)


def connect_raw(
    url: str, *, autocommit: bool = False, pooled: bool = False, **options: Any
) -> psycopg.Connection[Any]:
    """A plain psycopg connection, for LISTEN and for hot paths that SQLAlchemy would slow.

    ``pooled``: through a pooler in transaction mode, where consecutive transactions may run on
    different backends. No server-side prepared statement then (a statement prepared on one
    backend is unknown to the next; PgBouncer 1.18 does not track them), and no startup
    ``options`` (the pooler refuses them, and they would set one backend for every client):
    a statement that needs a setting sets it inside itself with ``set_config(…, true)``."""
    if pooled:
        if "options" in options:
            raise ValueError("connect_raw: no startup options through a pooler (set_config in the statement)")
        options["prepare_threshold"] = None
    return psycopg.connect(libpq_url(url), autocommit=autocommit, **{**tcp_parameters(url), **options})


def _loads(data: str | bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        return Unreadable("it is nested deeper than this process's JSON parser goes")
    except ValueError as exc:
        # A number of more digits than int() converts (sys.get_int_max_str_digits).
        return Unreadable(f"this process's JSON parser refuses it: {exc}")


#: Where a timestamptz no Python datetime holds is placed: 'infinity' or a year past 9999 at the
#: latest, '-infinity' or a year before 1 at the earliest (a day inside the range, so that a
#: conversion to any time zone stays in it).
LATEST = datetime(9999, 12, 30, tzinfo=UTC)
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)

_TIMESTAMPTZ_OID = psycopg.postgres.types["timestamptz"].oid
_TIMESTAMPTZ = psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)


class _TimestamptzLoader(Loader):
    """psycopg's own timestamptz loader, with a value it refuses placed at :data:`LATEST` or
    :data:`EARLIEST` instead of raising (psycopg's C loader cannot be subclassed)."""

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        assert _TIMESTAMPTZ is not None
        self._inner = _TIMESTAMPTZ(oid, context)

    def load(self, data: Any) -> Any:
        try:
            return self._inner.load(data)
        except psycopg.DataError:
            raw = bytes(data)
            return EARLIEST if raw.startswith(b"-") or raw.endswith(b"BC") else LATEST


def tolerate_unloadable(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Make ``conn`` load what plain SQL can store and Python cannot hold: a timestamptz of
    'infinity' (a deadline never reached) or '-infinity' (one always passed), a payload nested
    too deep (:class:`Unreadable`). Raising instead, the claim that read such a row left it
    claimed and unread, released, claimed again, for ever."""
    conn.adapters.register_loader(_TIMESTAMPTZ_OID, _TimestamptzLoader)
    psycopg.types.json.set_json_loads(_loads, conn)
    return conn


def require_autocommit(conn: psycopg.Connection[Any], job: str) -> None:
    """Refuse a connection inside a transaction: there a lookup would hold row locks (and a
    snapshot) for the length of an HTTP call, and one failing statement would undo a batch's
    earlier moves."""
    if not conn.autocommit:
        raise ValueError(f"{job} needs a psycopg connection in autocommit mode")


# Superusers and members of pg_read_all_stats (pg_monitor is one) see every session's
# xact_start; USAGE, not MEMBER: a NOINHERIT membership does not lend the privilege.
CAN_SEE_ALL_XACTS = """
SELECT r.rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
FROM pg_roles r WHERE r.rolname = current_user
"""


def can_see_all_transactions(conn: psycopg.Connection[Any]) -> bool:
    """True when this role sees the ``xact_start`` of every role's sessions, as the purge needs."""
    row = conn.execute(CAN_SEE_ALL_XACTS).fetchone()
    return bool(row and row[0])
