"""What the bench scripts share: finding their servers, a throwaway database of their own, the
Redis keys under their namespace, and waiting with a timeout.

``bench/relay.py`` and ``bench/e2e.py`` import it as ``bench.common``, after putting the
repository root on ``sys.path`` (as ``bench.e2e_handlers`` and ``bench.e2e_procrastinate`` are
imported). It needs only what both scripts already need (psycopg, redis, outbox): the process
and CPU accounting that needs psutil stays in ``bench/e2e.py``, its only user.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import redis
from sqlalchemy import text

from outbox.db import make_engine
from outbox.migrate import upgrade
from outbox.settings import libpq_url
from outbox.transport import delete_namespace

MACHINE_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"


# -- servers ---------------------------------------------------------------------------------------


def answers(url: str, default_port: int) -> bool:
    """Whether something listens at the URL's host and port (within a second)."""
    parts = urlsplit(url)
    if not parts.hostname or parts.hostname.startswith("/"):
        return True  # a Unix socket URL: let the driver tell
    try:
        socket.create_connection((parts.hostname, parts.port or default_port), 1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def servers(args: argparse.Namespace, machine_redis_url: str, prefix: str) -> Iterator[tuple[str, str, str]]:
    """(admin database URL, Redis URL, where they come from): ``--database-url``/``--redis-url``,
    then ``OUTBOX_*`` variables, then the machine's servers when they answer (unless
    ``--embedded``), else embedded ones started for this run in a temporary directory ``prefix…``."""
    database_url = args.database_url or os.environ.get("OUTBOX_DATABASE_URL")
    redis_url = args.redis_url or os.environ.get("OUTBOX_REDIS_URL")
    if not args.embedded:
        if not database_url and answers(MACHINE_DATABASE_URL, 5432):
            database_url = MACHINE_DATABASE_URL
        if not redis_url and answers(machine_redis_url, 6379):
            redis_url = machine_redis_url
    if database_url and redis_url:
        yield database_url, redis_url, "external"
        return
    from outbox.testing.embedded import embedded_postgres, embedded_redis

    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
        database_url = database_url or stack.enter_context(embedded_postgres(directory))
        redis_url = redis_url or stack.enter_context(embedded_redis(directory))
        yield database_url, redis_url, "embedded"


# -- a database of the bench's own ------------------------------------------------------------------


def connect(url: str) -> psycopg.Connection[Any]:
    """An autocommit connection (any accepted URL form), giving up after 10 s."""
    return psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10)


def with_database(url: str, name: str) -> str:
    """The same server URL with another database name (the query string kept)."""
    base, _, query = url.partition("?")
    return base.rsplit("/", 1)[0] + "/" + name + (f"?{query}" if query else "")


def recreate_database(admin_url: str, name: str) -> str:
    """Drop (disconnecting its users) and create the database ``name``; its URL."""
    with connect(admin_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_database(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    with connect(admin_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(url: str, *statements: str) -> None:
    """The outbox's migrations (``outbox.migrate.upgrade``), then ``statements`` in one transaction."""
    engine = make_engine(url)
    try:
        upgrade(engine)
        if statements:
            with engine.begin() as conn:
                for statement in statements:
                    conn.execute(text(statement))
    finally:
        engine.dispose()


def checkpoint(url: str) -> None:
    """A CHECKPOINT now, so that none lands inside a measurement (superuser only: else nothing)."""
    with connect(url) as conn, contextlib.suppress(psycopg.Error):
        conn.execute("CHECKPOINT")


# -- Redis -----------------------------------------------------------------------------------------


def clear_namespace(redis_url: str, namespace: str) -> None:
    """Delete the keys under ``namespace:`` in the URL's database, and nothing else."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        delete_namespace(client, namespace)
    finally:
        client.close()


# -- timing ----------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """The first true value of ``predicate()``, asked every ``interval`` s; TimeoutError after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
