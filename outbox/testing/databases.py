"""Throwaway databases on a PostgreSQL server: for the project's tests and the pytest plugin."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg

from outbox.settings import libpq_url


@contextlib.contextmanager
def fresh_database(url: str, prefix: str = "outbox_test") -> Iterator[str]:
    """An empty database on the same server as ``url``; yields its URL, drops it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(libpq_url(url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base, _, query = url.partition("?")
    fresh = base.rsplit("/", 1)[0] + "/" + name + (f"?{query}" if query else "")
    try:
        yield fresh
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
