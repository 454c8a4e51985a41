"""A pytest plugin for testing code that uses outbox: opt in from your ``conftest.py``::

    pytest_plugins = ["outbox.testing.pytest_plugin"]

No entry point: installing outbox changes nobody's test runs. Fixtures:

``outbox_database_url``
    A migrated throwaway database, emptied before each test, as a SQLAlchemy URL
    (``postgresql+psycopg://…``). With ``OUTBOX_TEST_DATABASE_URL`` set, the plugin creates a
    database of its own on that server (never yours) and drops it at the end of the session;
    otherwise it starts an embedded PostgreSQL (``pgserver``, the ``embedded`` extra) once per
    session. Handlers declared in a test are forgotten after it.
    ``outbox_session_database_url`` is the same database, not emptied.
``outbox_engine``
    A SQLAlchemy ``Engine`` on that database, for the business code under test.
``outbox_provider``
    The provider simulator (:class:`outbox.testing.provider.ProviderSimulator`) on 127.0.0.1,
    with named faults: ``decline()``, ``unavailable()`` (503), ``drop_after_charge()``,
    ``slow(ms)`` (each for every call until ``healthy()``, or ``times=N`` for the next N);
    ``charges(idempotency_key=None)`` counts the charges made.
``outbox_written``
    ``outbox_written()`` lists the rows written so far; ``outbox_written.assert_written(key,
    step, destination=…, payload=…)`` checks one, with a readable diff when it differs.

Delivery in-process through the real path: :mod:`outbox.testing.delivery` (``deliver``,
``reconcile_once``, ``crash_after_call``, ``recover``, ``pass_time``). docs/testing.md shows them
at work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from sqlalchemy import Engine

from ..settings import normalize_database_url
from .databases import empty_database, fresh_database
from .delivery import rows

DATABASE_ENV = "OUTBOX_TEST_DATABASE_URL"


def _terminate_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _teardown_on_sigterm() -> Iterator[None]:
    """A CI timeout or ``docker stop`` sends SIGTERM, whose default kills the run before the
    session's teardown: the embedded server or the database made on your server would stay. As
    an interrupt, pytest still tears down. Only while nobody else handles SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _terminate_as_interrupt:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def outbox_session_database_url() -> Iterator[str]:
    """The migrated test database of this session, as a SQLAlchemy URL; never emptied here."""
    from ..db import make_engine
    from ..migrate import upgrade

    with contextlib.ExitStack() as stack:
        stack.enter_context(_teardown_on_sigterm())
        given = os.environ.get(DATABASE_ENV)
        if given:
            url = stack.enter_context(fresh_database(given))
        else:
            if importlib.util.find_spec("pgserver") is None:
                raise RuntimeError(
                    f"the outbox plugin needs a PostgreSQL: set {DATABASE_ENV} to a server it may "
                    "create a test database on, or install the embedded one: "
                    "pip install 'outbox-relay[embedded]'"
                )
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
        yield normalize_database_url(url)


@pytest.fixture(autouse=True)
def _outbox_isolated_registry() -> Iterator[None]:
    """Handlers (and worker middleware) a test declares are forgotten after it; those of modules
    imported before stay."""
    from .. import middleware
    from ..handlers import isolated_registry

    saved = middleware.added()
    try:
        with isolated_registry():
            yield
    finally:
        middleware.restore(saved)


@pytest.fixture
def outbox_database_url(outbox_session_database_url: str) -> str:
    """The migrated test database, emptied now: deliveries use connections of their own, so a
    rolled-back test transaction would not be enough."""
    empty_database(outbox_session_database_url)
    return outbox_session_database_url


@pytest.fixture
def outbox_engine(outbox_database_url: str) -> Iterator[Engine]:
    """A SQLAlchemy engine on the emptied test database; disposed after the test."""
    from sqlalchemy import create_engine

    engine = create_engine(outbox_database_url)
    yield engine
    engine.dispose()


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
        __tracebackhide__ = True  # pytest shows the caller's line and the diff, not this body
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
                if isinstance(want, dict) and isinstance(got, dict):
                    lines.extend(f"    {line}" for line in _key_differences(want, got))
            raise AssertionError("\n".join(lines))
        return row


def _key_differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(want) | set(got)):
        if k not in got:
            out.append(f"{k!r}: missing (expected {want[k]!r})")
        elif k not in want:
            out.append(f"{k!r}: not expected (written {got[k]!r})")
        elif want[k] != got[k]:
            out.append(f"{k!r}: expected {want[k]!r}, written {got[k]!r}")
    return out


@pytest.fixture
def outbox_written(outbox_database_url: str) -> Written:
    return Written(outbox_database_url)
