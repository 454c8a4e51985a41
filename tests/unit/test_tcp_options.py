"""TCP keepalives and ``tcp_user_timeout`` on every connection to PostgreSQL and Redis: what
``OUTBOX_TCP_*`` turns into (libpq parameters, socket options), and the user's URL winning over
them. That the sockets really carry them is tests/integration/test_tcp_options.py."""

from __future__ import annotations

import socket

import pytest

from outbox import settings, transport
from outbox.db import tcp_parameters
from outbox.exceptions import ConfigError

URL = "postgresql://app@db.example:5432/shop"


def test_defaults() -> None:
    tcp = settings.tcp_settings({})
    assert tcp == settings.TcpSettings(
        keepalive_idle_seconds=10,
        keepalive_interval_seconds=5,
        keepalive_count=3,
        user_timeout_ms=30_000,
        connect_timeout_seconds=15,
    )


def test_the_variables_in_whole_units_as_sockets_take_them() -> None:
    tcp = settings.tcp_settings(
        {
            "OUTBOX_TCP_KEEPALIVE_IDLE": "1m",
            "OUTBOX_TCP_KEEPALIVE_INTERVAL": "1.5",
            "OUTBOX_TCP_KEEPALIVE_COUNT": "4",
            "OUTBOX_TCP_USER_TIMEOUT": "2.5s",
            "OUTBOX_CONNECT_TIMEOUT": "4.2s",
        }
    )
    # Keepalive times are whole seconds in the kernel: rounded up, never to 0.
    assert tcp == settings.TcpSettings(
        keepalive_idle_seconds=60,
        keepalive_interval_seconds=2,
        keepalive_count=4,
        user_timeout_ms=2500,
        connect_timeout_seconds=5,
    )
    assert settings.tcp_settings({"OUTBOX_TCP_KEEPALIVE_IDLE": "200ms"}).keepalive_idle_seconds == 1


def test_a_zero_user_timeout_leaves_the_systems_default() -> None:
    assert settings.tcp_settings({"OUTBOX_TCP_USER_TIMEOUT": "0"}).user_timeout_ms == 0
    with pytest.raises(ConfigError, match="OUTBOX_TCP_KEEPALIVE_COUNT"):
        settings.tcp_settings({"OUTBOX_TCP_KEEPALIVE_COUNT": "0"})


def test_libpq_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "7s")
    assert tcp_parameters(URL) == {
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 7000,
        "connect_timeout": 15,
    }
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "0")
    assert "tcp_user_timeout" not in tcp_parameters(URL)


def test_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    # libpq takes whole seconds and 1 as 2: what it is given is what it does.
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT", "500ms")
    assert tcp_parameters(URL)["connect_timeout"] == 2
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT", "0")
    assert "connect_timeout" not in tcp_parameters(URL)
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT", "20s")
    # The URL's own, or libpq's environment variable, wins.
    assert "connect_timeout" not in tcp_parameters(URL + "?connect_timeout=60")
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "60")
    assert "connect_timeout" not in tcp_parameters(URL)
    monkeypatch.delenv("PGCONNECT_TIMEOUT")
    assert tcp_parameters(URL)["connect_timeout"] == 20
    with pytest.raises(ConfigError, match="OUTBOX_CONNECT_TIMEOUT"):
        settings.tcp_settings({"OUTBOX_CONNECT_TIMEOUT": "-1"})


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@db.example/shop?keepalives_idle=120&tcp_user_timeout=9000",
        "postgresql+psycopg://app@db.example/shop?keepalives_idle=120&tcp_user_timeout=9000",
    ],
)
def test_what_the_url_sets_wins(url: str) -> None:
    params = tcp_parameters(url)
    assert "keepalives_idle" not in params and "tcp_user_timeout" not in params
    assert params["keepalives"] == 1 and params["keepalives_count"] == 3


def test_redis_socket_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "4s")
    monkeypatch.setenv("OUTBOX_TCP_KEEPALIVE_IDLE", "12")
    options = transport.tcp_options()
    assert options["socket_keepalive"] is True
    keepalive = options["socket_keepalive_options"]
    assert isinstance(keepalive, dict)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        assert keepalive[socket.TCP_USER_TIMEOUT] == 4000
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert keepalive[socket.TCP_KEEPIDLE] == 12
    monkeypatch.setenv("OUTBOX_TCP_USER_TIMEOUT", "0")
    keepalive = transport.tcp_options()["socket_keepalive_options"]
    assert isinstance(keepalive, dict)
    assert getattr(socket, "TCP_USER_TIMEOUT", None) not in keepalive


def test_a_redis_url_keeps_its_own_choice() -> None:
    client = transport.connect("redis://cache.example:6379/0?socket_keepalive=false")
    try:
        assert client.connection_pool.connection_kwargs["socket_keepalive"] is False
    finally:
        client.close()
    client = transport.connect("redis://cache.example:6379/0")
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_keepalive"] is True and kwargs["socket_keepalive_options"]
    finally:
        client.close()
    # A Unix socket has no TCP options (redis-py's Unix connection refuses them).
    client = transport.connect("unix:///tmp/no-such-redis.sock")
    try:
        assert "socket_keepalive" not in client.connection_pool.connection_kwargs
    finally:
        client.close()
