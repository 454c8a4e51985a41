"""Alembic environment: runs on the connection handed over by ``outbox.migrate``.

A transaction-level advisory lock serialises concurrent ``outbox migrate`` runs (several pods
starting at once), so the second one waits and then finds nothing to do.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from outbox.migrate import MIGRATION_LOCK_ID
from outbox.schema import VERSION_TABLE, metadata
from outbox.settings import normalize_database_url

config = context.config


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(normalize_database_url(config.get_main_option("sqlalchemy.url") or ""))
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
