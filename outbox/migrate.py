"""Apply and check the packaged Alembic migrations (shipped as ``outbox.migrations``)."""

from __future__ import annotations

import logging
import time
from importlib import resources

import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from .exceptions import NotMigrated
from .logs import first_line
from .schema import VERSION_TABLE

logger = logging.getLogger(__name__)


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("outbox.migrations")))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


#: Transaction-level advisory lock serialising concurrent migrations (also taken in env.py).
MIGRATION_LOCK_ID = 0x6F7574626F78  # "outbox"


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Bring the schema to ``revision``; returns (before, after). Safe to run concurrently."""
    with engine.begin() as connection:
        # Wait for a concurrent run before reading the revision, so that the run that waited
        # reports that it found the schema already there, not that it migrated it from empty.
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        before = current_revision(connection)
        command.upgrade(alembic_config(connection), revision)
        after = current_revision(connection)
    assert after is not None
    return before, after


def check_schema(connection: Connection) -> None:
    """Raise :class:`NotMigrated` unless the schema is at the packaged head."""
    exists = connection.execute(text("SELECT to_regclass('outbox_message') IS NOT NULL")).scalar()
    if not exists:
        raise NotMigrated("table outbox_message does not exist")
    current = current_revision(connection)
    head = head_revision()
    if current != head:
        raise NotMigrated(f"database is at revision {current}, this version needs {head}")


#: How long the start-up check waits for a PostgreSQL that is down or starting up. Running
#: processes ride out a database restart; one started during it (a supervisor's replacement
#: child, a deploy) exited at once, and a process manager's growing restart backoff then kept it
#: down long after the database was back.
START_WAIT_SECONDS = 30.0
_START_RETRY_MAX_DELAY_SECONDS = 2.0
# Worth waiting for: no server on the socket or port yet, or one refusing connections while it
# starts up, shuts down or recovers from a crash. libpq reports connection failures without an
# SQLSTATE, hence the messages; one not listed (a wrong password or database name, a message in
# another language) fails at once, as before.
_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P03"})
_TRANSIENT_MESSAGES = (
    "No such file or directory",
    "Connection refused",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "server closed the connection unexpectedly",
)


def _waitable(exc: sqlalchemy.exc.OperationalError) -> bool:
    if getattr(exc.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
        return True
    text_ = str(exc.orig or exc)
    return any(m in text_ for m in _TRANSIENT_MESSAGES)


def check_database(database_url: str, *, wait_seconds: float = START_WAIT_SECONDS) -> None:
    """:func:`check_schema` on a short-lived connection of its own: the start-up check of the
    long-running processes. Waits up to ``wait_seconds`` for a server that is not accepting
    connections yet; any other error raises at once."""
    from .db import make_engine

    engine = make_engine(database_url)
    deadline = time.monotonic() + wait_seconds
    delay = 0.25
    try:
        while True:
            try:
                with engine.connect() as conn:
                    check_schema(conn)
                return
            except sqlalchemy.exc.OperationalError as exc:
                if not _waitable(exc) or time.monotonic() + delay > deadline:
                    raise
                if delay == 0.25:
                    logger.warning(
                        "PostgreSQL is not accepting connections (%s); waiting up to %.0f s",
                        first_line(exc.orig or exc),
                        wait_seconds,
                        extra={"error": type(exc.orig or exc).__name__},
                    )
                time.sleep(delay)
                delay = min(delay * 2, _START_RETRY_MAX_DELAY_SECONDS)
    finally:
        engine.dispose()
