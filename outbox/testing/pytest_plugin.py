"""A pytest plugin for testing code that uses outbox: opt in from your ``conftest.py``::

    pytest_plugins = ["outbox.testing.pytest_plugin"]

No entry point: installing outbox changes nobody's test runs. Fixtures:

``outbox_database_url``
    A migrated throwaway database, emptied before each test. With ``OUTBOX_TEST_DATABASE_URL``
    set, the plugin creates a database of its own on that server (never yours) and drops it at
    the end of the session; otherwise it starts an embedded PostgreSQL (``pgserver``, the
    ``embedded`` extra) once per session.
``outbox_provider``
    The provider simulator (:class:`outbox.testing.provider.ProviderSimulator`) on 127.0.0.1:
    ``configure(decline_rate=1.0)``, ``fail_before_rate``, ``drop_after_rate`` …; ``stats()``
    counts charges per Idempotency-Key.
``outbox_written``
    ``outbox_written()`` lists the rows written so far; ``outbox_written.assert_written(key,
    step, destination=…, payload=…)`` checks one, with a readable diff when it differs.

Delivery in-process through the real path: :mod:`outbox.testing.delivery` (``deliver``,
``reconcile_once``, ``crash_after_call``, ``pass_time``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from ..settings import libpq_url
from .databases import fresh_database
from .delivery import rows

DATABASE_ENV = "OUTBOX_TEST_DATABASE_URL"
# The one write of outbox_message outside outbox.transitions, and no state move: a test
# database emptied between tests (tests/unit/test_transitions_home.py names this file).
_EMPTY = "TRUNCATE outbox_message, outbox_attempt, outbox_key_ledger RESTART IDENTITY CASCADE"


@pytest.fixture(scope="session")
def _outbox_session_database() -> Iterator[str]:
    from ..db import make_engine
    from ..migrate import upgrade

    with contextlib.ExitStack() as stack:
        given = os.environ.get(DATABASE_ENV)
        if given:
            url = stack.enter_context(fresh_database(given))
        else:
            from .embedded import embedded_postgres

            directory = tempfile.mkdtemp(prefix="outbox-plugin-")
            stack.callback(shutil.rmtree, directory, True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                url = stack.enter_context(embedded_postgres(directory))
        engine = make_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        yield url


@pytest.fixture
def outbox_database_url(_outbox_session_database: str) -> str:
    """The migrated test database, emptied now: deliveries use connections of their own, so a
    rolled-back test transaction would not be enough."""
    with psycopg.connect(libpq_url(_outbox_session_database), autocommit=True) as conn:
        conn.execute(_EMPTY)
    from ..handlers import clear_registry

    clear_registry()
    return _outbox_session_database


@pytest.fixture
def outbox_provider() -> Iterator[Any]:
    from .provider import ProviderSimulator

    with ProviderSimulator() as provider:
        yield provider


class Written:
    """What the business transactions wrote, read from the table."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def __call__(self) -> list[dict[str, Any]]:
        return rows(self.database_url)

    def assert_written(
        self,
        key: str,
        step: str,
        *,
        destination: str | None = None,
        payload: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        found = [r for r in self() if r["key"] == key and r["step"] == step]
        if not found:
            written = ", ".join(f"{r['key']}/{r['step']}" for r in self()) or "nothing"
            raise AssertionError(f"no outbox row for ({key!r}, {step!r}); written: {written}")
        row = found[0]
        wanted = {"destination": destination, "payload": payload}
        differs = {
            name: (value, row[name])
            for name, value in wanted.items()
            if value is not None and row[name] != value
        }
        if differs:
            lines = [f"outbox row ({key!r}, {step!r}) differs:"]
            for name, (want, got) in differs.items():
                lines.append(f"  {name}: expected {want!r}")
                lines.append(f"  {' ' * len(name)}  written  {got!r}")
            raise AssertionError("\n".join(lines))
        return row


@pytest.fixture
def outbox_written(outbox_database_url: str) -> Written:
    return Written(outbox_database_url)
