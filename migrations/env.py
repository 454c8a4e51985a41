"""Alembic environment: runs on the connection handed over by ``outbox.migrate``.

``outbox.migrate.upgrade`` holds an advisory lock for its session, so concurrent ``outbox
migrate`` runs (several pods starting at once) wait for each other and the second finds nothing
to do. The same lock is taken here for the transaction too, for a plain ``alembic`` run; a
revision that builds an index CONCURRENTLY ends that transaction early (see
``migrations/helpers.py``), which only the session lock outlives.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, text

from outbox.migrate import MIGRATION_LOCK_ID
from outbox.schema import VERSION_TABLE, metadata
from outbox.settings import normalize_database_url

config = context.config


def _run(connection: Connection) -> None:
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
