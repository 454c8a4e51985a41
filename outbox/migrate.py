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


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str]:
    """Bring the schema to ``revision``; returns (before, after). Safe to run concurrently."""
    with engine.begin() as connection:
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
