"""The application API's check that the database is migrated: once per engine, read-only.

A missing table would abort the caller's transaction; a read-only check does not, so a clear
``NotMigrated`` leaves the transaction usable. ``write``, ``cancel`` and ``batch`` call it.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from .exceptions import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

#: Engines whose database was found at the head revision (checked once each, not per write).
_checked_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_checked_lock = threading.Lock()


def _engine_of(target: Session | Connection) -> Engine:
    if isinstance(target, Session):
        bind = target.get_bind()
        return bind.engine if isinstance(bind, Connection) else bind
    return target.engine


def _require_postgresql(engine: Engine) -> None:
    # The statements use PostgreSQL's ON CONFLICT, jsonb and NOTIFY: another database would fail
    # on the first of them with an error that names none of this.
    if engine.dialect.name != "postgresql":
        raise ConfigError(f"outbox needs PostgreSQL, got {engine.dialect.name}")


def ensure_schema(target: Session | Connection) -> None:
    """Check once per engine that the tables exist at the head revision.

    A missing table would abort the caller's transaction; a read-only check does not, so a
    clear `NotMigrated` leaves the transaction usable.
    """
    engine = _engine_of(target)
    if engine in _checked_engines:
        return
    _require_postgresql(engine)
    from .migrate import check_schema  # imports Alembic: only when an engine is first seen

    connection = target.connection() if isinstance(target, Session) else target
    check_schema(connection)
    with _checked_lock:
        _checked_engines.add(engine)


async def ensure_schema_async(target: AsyncSession | AsyncConnection) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    connection = await target.connection() if isinstance(target, AsyncSession) else target
    engine = connection.engine.sync_engine
    if engine in _checked_engines:
        return
    _require_postgresql(engine)
    from .migrate import check_schema

    await connection.run_sync(check_schema)
    with _checked_lock:
        _checked_engines.add(engine)
