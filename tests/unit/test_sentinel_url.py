"""``redis+sentinel://`` URLs: taken apart, refused with a reason, never echoed with a password,
and turned into a client of the service's primary whose sentinels get their own credentials."""

from __future__ import annotations

import pytest
import redis.sentinel

from outbox import settings, transport
from outbox.exceptions import ConfigError
from outbox.settings import SentinelURL, parse_sentinel_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://s1:26379,s2:26380,s3:26381/mymaster",
            SentinelURL(sentinels=(("s1", 26379), ("s2", 26380), ("s3", 26381)), service="mymaster"),
        ),
        (
            "redis+sentinel://app:p%40ss@s1:5000/mymaster/3",
            SentinelURL(sentinels=(("s1", 5000),), service="mymaster", db=3, username="app", password="p@ss"),
        ),
        (
            "redis+sentinel://:pw@s1,s2/mymaster/",
            SentinelURL(sentinels=(("s1", 26379), ("s2", 26379)), service="mymaster", password="pw"),
        ),
        (
            "rediss+sentinel://[::1]:26379,10.0.0.2:26379/cache.primary/0"
            "?sentinel_username=watch&sentinel_password=sp&socket_timeout=2",
            SentinelURL(
                sentinels=(("::1", 26379), ("10.0.0.2", 26379)),
                service="cache.primary",
                sentinel_username="watch",
                sentinel_password="sp",
                tls=True,
                options=(("socket_timeout", "2"),),
            ),
        ),
    ],
)
def test_a_sentinel_url_is_taken_apart(url: str, expected: SentinelURL) -> None:
    parsed = parse_sentinel_url(url)
    assert parsed == expected
    # Compared apart: the passwords are left out of the dataclass's repr (and so of its ==
    # message), not out of its equality.
    assert (parsed.password, parsed.sentinel_password) == (expected.password, expected.sentinel_password)
    assert settings.from_env({"OUTBOX_REDIS_URL": url}).redis_url == url


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+sentinel://s1:26379", "no service name"),
        ("redis+sentinel://s1:26379/", "no service name"),
        ("redis+sentinel:///mymaster", "a sentinel address is empty"),
        ("redis+sentinel://s1,,s2/mymaster", "a sentinel address is empty"),
        ("redis+sentinel://s1:0/mymaster", "no TCP port between 1 and 65535"),
        ("redis+sentinel://s1:http/mymaster", "no TCP port between 1 and 65535"),
        ("redis+sentinel://[::1/mymaster", "is not [IPv6]:PORT"),
        ("redis+sentinel://s1/mymaster/one", "the database 'one' is not a whole number"),
        ("redis+sentinel://s1/mymaster/1/2", "more than a service and a database number"),
        ("redis+sentinel://s1/mymaster?db=2", "the query option 'db' belongs in the URL itself"),
        ("redis+sentinel://s1/mymaster?password=x", "the query option 'password' belongs in the URL"),
        ("redis+sentinel://s1/mymaster?sentinel_password", "the query is not NAME=VALUE"),
        ("redis+sentinel://s1/mymaster#top", "a fragment"),
    ],
)
def test_a_bad_sentinel_url_is_refused_with_its_reason(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match="a Sentinel URL is redis\\+sentinel://") as info:
        parse_sentinel_url(url)
    assert reason in str(info.value)
    with pytest.raises(ConfigError) as from_env:
        settings.from_env({"OUTBOX_REDIS_URL": url})
    assert str(from_env.value).startswith("OUTBOX_REDIS_URL: ") and reason in str(from_env.value)
    with pytest.raises(ConfigError, match=r"^--redis-url: "):
        settings.from_env({}, redis_url=url)


@pytest.mark.parametrize("url", ["sentinel://s1/mymaster", "redis-sentinel://s1/mymaster", "s1:26379"])
def test_other_schemes_name_the_sentinel_ones(url: str) -> None:
    with pytest.raises(ConfigError, match=r"redis\+sentinel:// or rediss\+sentinel://"):
        settings.from_env({"OUTBOX_REDIS_URL": url})


def test_no_password_reaches_an_error_or_a_redacted_url() -> None:
    url = "redis+sentinel://app:s3cret@s1/mymaster/x?sentinel_password=t0psecret"
    with pytest.raises(ConfigError) as info:
        settings.from_env({"OUTBOX_REDIS_URL": url})
    assert "s3cret" not in str(info.value) and "t0psecret" not in str(info.value)
    assert settings.redact_url(url) == "redis+sentinel://app:***@s1/mymaster/x?sentinel_password=***"
    parsed = parse_sentinel_url(url.replace("/x?", "/1?"))
    assert "s3cret" not in repr(parsed) and "t0psecret" not in repr(parsed)


@pytest.mark.parametrize(
    "url",
    [
        # A password holding an unencoded / ? or # ends the authority early: what is then read as
        # an address, or a port, is part of it.
        "redis+sentinel://:TopSecretPw/x@127.0.0.1:26379/svc/8",
        "redis+sentinel://admin:TopSecretPw?x@127.0.0.1:26379/svc",
        "redis+sentinel://admin:TopSecretPw#x@127.0.0.1:26379/svc",
        "redis://:TopSecretPw/x@127.0.0.1:6379/8",
        "rediss://admin:TopSecretPw?x@127.0.0.1:6379/8",
    ],
)
def test_a_password_that_breaks_the_url_is_not_in_its_refusal(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        settings.from_env({"OUTBOX_REDIS_URL": url})
    assert "TopSecret" not in str(refused.value)
    assert "OUTBOX_REDIS_URL" in str(refused.value)


def test_the_client_asks_the_sentinels_with_their_credentials_and_the_primary_with_its_own() -> None:
    client = transport.connect(
        "redis+sentinel://app:primary-pw@127.0.0.1:26379,127.0.0.1:26380/mymaster/4"
        "?sentinel_username=watch&sentinel_password=sentinel-pw&socket_keepalive=true",
        socket_timeout=7,
    )
    try:
        pool = client.connection_pool
        assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
        assert pool.service_name == "mymaster" and pool.is_master
        primary = pool.connection_kwargs
        assert (primary["username"], primary["password"], primary["db"]) == ("app", "primary-pw", 4)
        assert primary["socket_timeout"] == 7 and primary["socket_keepalive"] is True
        sentinels = pool.sentinel_manager.sentinels
        addresses = [
            (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels
        ]
        assert addresses == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
        for sentinel in sentinels:
            kwargs = sentinel.connection_pool.connection_kwargs
            assert (kwargs["username"], kwargs["password"]) == ("watch", "sentinel-pw")
            assert kwargs["socket_timeout"] == 7
            assert kwargs.get("db", 0) == 0
    finally:
        client.close()


def test_a_tls_url_speaks_tls_to_the_sentinels_and_the_primary() -> None:
    client = transport.connect("rediss+sentinel://s1:26379/mymaster?ssl_cert_reqs=none")
    try:
        pool = client.connection_pool
        assert issubclass(pool.connection_class, redis.connection.SSLConnection)
        assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
        for sentinel in pool.sentinel_manager.sentinels:
            assert issubclass(sentinel.connection_pool.connection_class, redis.connection.SSLConnection)
    finally:
        client.close()


def test_a_plain_url_is_redis_py_s_own() -> None:
    client = transport.connect("redis://127.0.0.1:6390/2")
    try:
        assert type(client.connection_pool) is redis.ConnectionPool
    finally:
        client.close()


@pytest.mark.parametrize(
    ("error", "failover"),
    [
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
        # Redis 6 wraps a script's READONLY (the worker's ack is a script) in a plain error.
        (
            redis.ResponseError(
                "Error running script (call to f_fdacc359): @user_script:58: @user_script: 58: "
                "-READONLY You can't write against a read only replica."
            ),
            True,
        ),
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), False),
    ],
)
def test_a_demoted_primarys_answer_is_told_from_a_refusal(error: redis.ResponseError, failover: bool) -> None:
    assert transport._is_failover(error) is failover
