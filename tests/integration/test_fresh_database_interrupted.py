"""A throwaway database is dropped however its creation ends: ``outbox demo --database-url`` on a
server of one's own, interrupted by Ctrl-C or SIGTERM while its CREATE DATABASE runs, left the
database behind (the interrupt came before the context manager that drops it was entered).
Real PostgreSQL, a real signal."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import psycopg
import pytest

from outbox.settings import libpq_url
from outbox.testing.databases import fresh_database


def _databases(url: str, prefix: str) -> list[str]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,))
        return [r[0] for r in rows]


def _interrupt_during_create(
    url: str, prefix: str, main: int, ready: threading.Event, seen: threading.Event
) -> None:
    # SIGINT to the main thread the moment the server runs this prefix's CREATE DATABASE.
    pattern = f'CREATE DATABASE "{prefix}_%'
    deadline = time.monotonic() + 20
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        # Watching before the creation starts: a watcher still connecting on a loaded machine
        # missed a quick CREATE DATABASE, and no interrupt came.
        ready.set()
        while time.monotonic() < deadline:
            if conn.execute("SELECT 1 FROM pg_stat_activity WHERE query LIKE %s", (pattern,)).fetchone():
                seen.set()
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.001)


def test_an_interrupt_during_create_database_leaves_no_database(services) -> None:
    prefix = f"interrupted_{uuid.uuid4().hex[:6]}"
    ready, seen = threading.Event(), threading.Event()
    watcher = threading.Thread(
        target=_interrupt_during_create,
        args=(services.database_url, prefix, threading.main_thread().ident, ready, seen),
        daemon=True,
    )
    # Python's own Ctrl-C, whatever this process inherited: a run started in the background by a
    # shell without job control ignores SIGINT, and the interrupt would never come.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher.start()
    assert ready.wait(20), "the watcher could not connect"
    try:
        with pytest.raises(KeyboardInterrupt):
            with fresh_database(services.database_url, prefix=prefix):
                time.sleep(10)  # the interrupt lands during CREATE DATABASE or, at worst, here
        assert seen.is_set()
        assert _databases(services.database_url, prefix) == []
    finally:
        watcher.join(timeout=20)
        signal.signal(signal.SIGINT, previous)
        with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
            for name in _databases(services.database_url, prefix):
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
