"""Throwaway databases on a PostgreSQL server: for the project's tests and the pytest plugin."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
from sqlalchemy.engine import make_url

from outbox.settings import libpq_url


@contextlib.contextmanager
def fresh_database(url: str, prefix: str = "outbox_test") -> Iterator[str]:
    """An empty database on the same server as ``url``; yields its URL, drops it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(libpq_url(url), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
    except BaseException:
        # Ctrl-C during CREATE DATABASE: psycopg's cancel may come after the server finished,
        # so the database can exist though the statement raised.
        with contextlib.suppress(psycopg.Error):
            _drop(url, name)
        raise
    try:
        # make_url, not string surgery: a URL without a database path ("…@host:5432") keeps its host.
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop(url, name)


def _drop(url: str, name: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# A write of outbox_message outside outbox.store, and no state move: a test database
# emptied between tests (tests/unit/test_store_home.py names this file).
# The heartbeats go too: a worker a previous test killed still counts as live for a few
# intervals, and would serve its destination's queue in the next test's eyes.
_EMPTY = (
    "TRUNCATE outbox_message, outbox_attempt, outbox_key_ledger, outbox_destination, outbox_batch,"
    " outbox_dashboard_session_end, outbox_process, outbox_no_consumer RESTART IDENTITY CASCADE"
)


def empty_database(database_url: str) -> None:
    """Empty the outbox tables of a test database (every row, attempt row and ledger key, and
    the processes' heartbeats)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(_EMPTY)
