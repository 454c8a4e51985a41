"""The sockets of real connections carry the TCP keepalives and ``TCP_USER_TIMEOUT`` outbox asks
for (``OUTBOX_TCP_*``): libpq (psycopg 3's) sets what it is given, redis-py what it is given, and
an option the user's URL sets stays the user's. Read back from the kernel with getsockopt."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import sqlalchemy.exc

from outbox import transport
from outbox.db import connect_raw, make_engine

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is a Linux socket option"
)


def _tcp_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if not parts.hostname or parts.hostname.startswith("/") or "host=%2F" in url or "host=/" in url:
        pytest.skip(f"the test {what} is reached over a Unix socket here: no TCP options to read back")
    return url


@pytest.fixture
def database_url(services: Any) -> str:
    return _tcp_url(services.database_url, "PostgreSQL")


@pytest.fixture
def redis_url(services: Any) -> str:
    return _tcp_url(services.redis_url, "Redis")


def options_of(fd: int) -> dict[str, int]:
    sock = socket.socket(fileno=socket.dup(fd))
    try:
        return {
            "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        }
    finally:
        sock.close()


DEFAULTS = {"keepalive": 1, "idle": 10, "interval": 5, "count": 3, "user_timeout_ms": 30_000}


@pytest.fixture(autouse=True)
def _no_tcp_variables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "OUTBOX_TCP_KEEPALIVE_IDLE",
        "OUTBOX_TCP_KEEPALIVE_INTERVAL",
        "OUTBOX_TCP_KEEPALIVE_COUNT",
        "OUTBOX_TCP_USER_TIMEOUT",
        "OUTBOX_CONNECT_TIMEOUT",
        "PGCONNECT_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    yield


def test_raw_connections_carry_the_defaults(database_url: str) -> None:
    with connect_raw(database_url, autocommit=True) as conn:
        assert options_of(conn.fileno()) == DEFAULTS


def test_engines_carry_them_and_the_variables_change_them(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "7s")
    monkeypatch.setenv("OUTBOX_TCP_KEEPALIVE_COUNT", "6")
    engine = make_engine(database_url, connect_args={"application_name": "outbox tcp test"})
    try:
        raw = engine.raw_connection()
        try:
            fd = raw.driver_connection.fileno()  # type: ignore[union-attr]
            assert options_of(fd) == {**DEFAULTS, "user_timeout_ms": 7000, "count": 6}
        finally:
            raw.close()
    finally:
        engine.dispose()


def test_the_urls_own_parameters_win(database_url: str) -> None:
    sep = "&" if "?" in database_url else "?"
    with connect_raw(f"{database_url}{sep}tcp_user_timeout=9000&keepalives_idle=42", autocommit=True) as conn:
        assert options_of(conn.fileno()) == {**DEFAULTS, "user_timeout_ms": 9000, "idle": 42}


def test_redis_connections_carry_them(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "3s")
    client = transport.connect(redis_url)
    try:
        conn = client.connection_pool.get_connection()
        try:
            conn.connect()
            sock = conn._sock
            assert sock is not None
            assert options_of(sock.fileno()) == {**DEFAULTS, "user_timeout_ms": 3000}
        finally:
            client.connection_pool.release(conn)
    finally:
        client.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A PostgreSQL that accepts connections and never answers (a frozen host, a hung pooler):
    the kernel answers TCP and its keepalives, so only the connect timeout ends the wait."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        yield silent.getsockname()[1]
    finally:
        silent.close()


def test_a_connect_to_a_server_that_never_answers_gives_up(
    silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT", "2s")
    url = f"postgresql://outbox@127.0.0.1:{silent_port}/outbox"
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError, match="timeout expired"):
        connect_raw(url, autocommit=True)
    assert 1.5 < time.monotonic() - started < 10
    engine = make_engine(url, pool_pre_ping=False)
    try:
        started = time.monotonic()
        with pytest.raises(sqlalchemy.exc.OperationalError, match="timeout expired"):
            engine.connect()
        assert 1.5 < time.monotonic() - started < 10
    finally:
        engine.dispose()
