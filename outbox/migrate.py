"""Apply and check the packaged Alembic migrations (shipped as ``outbox.migrations``)."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from .exceptions import NotMigrated
from .schema import VERSION_TABLE


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


def check_database(database_url: str) -> None:
    """:func:`check_schema` on a short-lived connection of its own: the start-up check of the
    long-running processes."""
    from .db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            check_schema(conn)
    finally:
        engine.dispose()
