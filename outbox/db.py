"""Engines and raw connections, with the psycopg 3 driver whatever URL form the user has, and the
server process behind a connection (to end a claim whose reply was lost)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine

from .settings import libpq_url, normalize_database_url


def make_engine(url: str, **options: Any) -> Engine:
    options.setdefault("pool_pre_ping", True)
    return create_engine(normalize_database_url(url), **options)


def connect_raw(url: str, *, autocommit: bool = False, **options: Any) -> psycopg.Connection[Any]:
    """A plain psycopg connection, for LISTEN and for hot paths that SQLAlchemy would slow."""
    return psycopg.connect(libpq_url(url), autocommit=autocommit, **options)


# The backend that ran a claim whose reply was lost; `backend_start` tells it from a later
# backend that was given the same pid.
_BACKEND = "pid = %(pid)s AND backend_start IS NOT DISTINCT FROM %(started)s"
_BACKEND_ALIVE = f"SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE {_BACKEND})"
_TERMINATE_BACKEND = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {_BACKEND}"


def backend_identity(conn: psycopg.Connection[Any]) -> tuple[int, datetime | None]:
    """The server process behind ``conn`` and its start time (once per connection)."""
    row = conn.execute(
        "SELECT pg_backend_pid(), backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
    ).fetchone()
    return (int(row[0]), row[1]) if row else (conn.info.backend_pid, None)


def end_backend(
    conn: psycopg.Connection[Any], *, pid: int, started: datetime | None, timeout_seconds: float
) -> bool:
    """Terminate the backend ``pid`` (started at ``started``) and wait until it is gone.

    Once it is gone, whatever it was running has committed or rolled back for good: a claim
    whose reply was lost can no longer commit behind our back. False if it outlived the wait.
    """
    params = {"pid": pid, "started": started}
    conn.execute(_TERMINATE_BACKEND, params)
    deadline = time.monotonic() + timeout_seconds
    while True:
        alive = conn.execute(_BACKEND_ALIVE, params).fetchone()
        if not (alive and alive[0]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
