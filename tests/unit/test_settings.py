"""Settings from OUTBOX_* variables, database URL forms, redaction, and the CLI's error contract
(exit 2 for configuration, 3 for an unreachable service, one line on stderr, no traceback)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import outbox
from outbox import settings
from outbox.exceptions import ConfigError

# -- from_env --------------------------------------------------------------------------------------

#: Every variable of settings.ENVIRONMENT: (a valid raw value, the parsed value, bad raw values).
VARIABLES: dict[str, tuple[str, Any, list[str]]] = {
    "OUTBOX_DATABASE_URL": (
        "postgresql://app:pw@db:5432/shop",
        "postgresql://app:pw@db:5432/shop",
        ["mysql://app:pw@db/shop", "sqlite:///x.db", "db:5432/shop"],
    ),
    "OUTBOX_REDIS_URL": ("redis://cache:6379/2", "redis://cache:6379/2", ["http://cache:6379", "cache:6379"]),
    "OUTBOX_DIRECT_DATABASE_URL": (
        "postgresql://app:pw@db:5432/shop",
        "postgresql://app:pw@db:5432/shop",
        ["mysql://app:pw@db/shop", "db:5432/shop"],
    ),
    # Alone each names what it lacks (test_a_pooler_needs_the_direct_url).
    "OUTBOX_DATABASE_POOLER": ("transaction", None, ["session", "statement", "yes", "transaction"]),
    "OUTBOX_NAMESPACE": ("shop-outbox.v1", "shop-outbox.v1", ["a b", "a:b", "x" * 65, " ", "ns/1"]),
    "OUTBOX_POLL_INTERVAL": ("2.5", 2.5, ["abc", "0", "-1", "1w", "s"]),
    "OUTBOX_RELAY_BATCH_SIZE": ("500", 500, ["abc", "0", "-5", "1.5", "1e3"]),
    "OUTBOX_RELAY_CONNECTIONS": ("4", 4, ["two", "0", "-1", "2.5"]),
    "OUTBOX_WORKER_CONCURRENCY": ("150", 150, ["many", "0", "-1", "1.5"]),
    "OUTBOX_WORKER_SLOTS_PER_DESTINATION": ("40", 40, ["half", "0", "-1", "2.5"]),
    "OUTBOX_RELAY_GATHER": ("5ms", 0.005, ["soon", "-1ms", "1w", "5 ms later"]),
    "OUTBOX_REDISPATCH_AFTER": ("15m", 900.0, ["fifteen", "0s", "15 minutes"]),
    "OUTBOX_RETENTION": ("30d", 2592000.0, ["7 days", "0d", "-7d"]),
    "OUTBOX_LEDGER_HORIZON": ("30d", 2592000.0, ["30 days", "0d", "-1d", "1d"]),
    "OUTBOX_RECONCILE_INTERVAL": ("30s", 30.0, ["30sec", "0"]),
    "OUTBOX_UNKNOWN_ALERT_AFTER": ("12h", 43200.0, ["12hours", "h"]),
    "OUTBOX_LOOKUP_CONCURRENCY": ("64", 64, ["many", "0", "-1", "2.5"]),
    "OUTBOX_MAX_PAYLOAD_BYTES": ("65536", 65536, ["64k", "0", "-1"]),
    "OUTBOX_ALLOW_EVICTING_REDIS": ("true", True, ["maybe", "2"]),
    "OUTBOX_HEARTBEAT_INTERVAL": ("10s", 10.0, ["often", "0"]),
    "OUTBOX_NO_CONSUMER_CYCLES": ("5", 5, ["three", "0", "1.5"]),
    "OUTBOX_CLOCK_SKEW_WARN": ("500ms", 0.5, ["2 seconds", "0"]),
    "OUTBOX_FAILOVER_CHECK_INTERVAL": ("1m", 60.0, ["often", "0"]),
    "OUTBOX_METRICS_PORT": ("9400", 9400, ["http", "0", "65536", "-1", "94.5"]),
    "OUTBOX_TCP_KEEPALIVE_IDLE": ("20s", 20.0, ["often", "0", "-1"]),
    "OUTBOX_TCP_KEEPALIVE_INTERVAL": ("2", 2.0, ["often", "0s"]),
    "OUTBOX_TCP_KEEPALIVE_COUNT": ("5", 5, ["five", "0", "2.5"]),
    "OUTBOX_TCP_USER_TIMEOUT": ("500ms", 0.5, ["soon", "-1s"]),
    "OUTBOX_CONNECT_TIMEOUT": ("20s", 20.0, ["soon", "-1s"]),
}


def test_every_environment_variable_is_covered_here() -> None:
    assert set(VARIABLES) == set(settings.ENVIRONMENT)


def test_defaults_without_any_variable() -> None:
    cfg = settings.from_env({})
    assert cfg == settings.Settings()
    assert cfg.database_url is None and cfg.redis_url is None
    assert cfg.namespace == "outbox"
    assert cfg.max_payload_bytes == 256 * 1024
    assert cfg.allow_evicting_redis is False
    for field in dataclasses.fields(cfg):
        if field.name.endswith("_seconds") and field.name not in settings._ZERO_ALLOWED:
            assert getattr(cfg, field.name) > 0, field.name


def test_a_pooler_needs_the_direct_url() -> None:
    direct = "postgresql://app:pw@db:5432/shop"
    pooler = "postgresql://app:pw@pgbouncer:6432/shop"
    with pytest.raises(ConfigError, match="OUTBOX_DIRECT_DATABASE_URL") as info:
        settings.from_env({"OUTBOX_DATABASE_URL": pooler, "OUTBOX_DATABASE_POOLER": "transaction"})
    assert "\n" not in str(info.value)
    cfg = settings.from_env(
        {
            "OUTBOX_DATABASE_URL": pooler,
            "OUTBOX_DATABASE_POOLER": "Transaction",
            "OUTBOX_DIRECT_DATABASE_URL": direct,
        }
    )
    assert cfg.pooled and cfg.database_pooler == "transaction"
    # The hot paths go through the pooler; everything that keeps a backend goes direct.
    assert cfg.require_hot_database_url() == settings.normalize_database_url(pooler)
    assert cfg.require_database_url() == settings.normalize_database_url(direct)
    # Without a pooler both are OUTBOX_DATABASE_URL.
    plain = settings.from_env({"OUTBOX_DATABASE_URL": pooler})
    assert not plain.pooled
    assert plain.require_database_url() == plain.require_hot_database_url()
    # A direct URL alone is a half-made switch; a direct URL that is the pooler's is no direct URL.
    with pytest.raises(ConfigError, match="OUTBOX_DATABASE_POOLER=transaction"):
        settings.from_env({"OUTBOX_DATABASE_URL": pooler, "OUTBOX_DIRECT_DATABASE_URL": direct})
    with pytest.raises(ConfigError, match="same as OUTBOX_DATABASE_URL"):
        settings.from_env(
            {
                "OUTBOX_DATABASE_URL": pooler,
                "OUTBOX_DATABASE_POOLER": "transaction",
                "OUTBOX_DIRECT_DATABASE_URL": pooler,
            }
        )


@pytest.mark.parametrize(
    "name", sorted(set(VARIABLES) - {"OUTBOX_DATABASE_POOLER", "OUTBOX_DIRECT_DATABASE_URL"})
)
def test_each_variable_is_parsed(name: str) -> None:
    raw, expected, _ = VARIABLES[name]
    cfg = settings.from_env({name: raw})
    field = settings.ENVIRONMENT[name]
    assert getattr(cfg, field) == expected
    assert getattr(settings.Settings(), field) != expected, "pick a value that differs from the default"
    # Only that field moved.
    others = {f.name for f in dataclasses.fields(cfg)} - {field}
    assert all(getattr(cfg, f) == getattr(settings.Settings(), f) for f in others)


@pytest.mark.parametrize(
    ("name", "bad"),
    [(name, bad) for name, (_, _, bads) in sorted(VARIABLES.items()) for bad in bads],
)
def test_bad_values_name_the_variable(name: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(name)) as info:
        settings.from_env({name: bad})
    assert isinstance(info.value, outbox.OutboxError)
    assert "pw" not in str(info.value), "a password reached an error message"


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("15m", 900.0),
        ("12h", 43200.0),
        ("7d", 604800.0),
        ("250ms", 0.25),
        ("1.5m", 90.0),
        (" 45s ", 45.0),
    ],
)
def test_durations(raw: str, seconds: float) -> None:
    assert settings.parse_seconds(raw, "OUTBOX_X") == seconds
    assert settings.from_env({"OUTBOX_REDISPATCH_AFTER": raw}).redispatch_after_seconds == seconds


@pytest.mark.parametrize("raw", ["abc", "", "-5", "5 w", "m15", "1,5m", "inf", "nan"])
def test_bad_durations(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"OUTBOX_RETENTION=.* is not a duration \(examples: 30, 30s"):
        settings.parse_seconds(raw, "OUTBOX_RETENTION")


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("No", False)],
)
def test_booleans(raw: str, value: bool) -> None:
    assert settings.from_env({"OUTBOX_ALLOW_EVICTING_REDIS": raw}).allow_evicting_redis is value


def test_a_zero_gathering_window_turns_it_off_where_other_durations_refuse_zero() -> None:
    assert settings.from_env({"OUTBOX_RELAY_GATHER": "0"}).relay_gather_seconds == 0
    assert settings.from_env({"OUTBOX_RELAY_GATHER": "0ms"}).relay_gather_seconds == 0
    with pytest.raises(ConfigError, match="greater than zero"):
        settings.from_env({"OUTBOX_POLL_INTERVAL": "0"})


def test_empty_variable_means_unset() -> None:
    env = {name: "" for name in settings.ENVIRONMENT}
    assert settings.from_env(env) == settings.Settings()


def test_unrelated_variables_are_ignored() -> None:
    assert (
        settings.from_env({"OUTBOX_NO_SUCH_THING": "x", "DATABASE_URL": "mysql://x"}) == settings.Settings()
    )


def test_flags_win_over_the_environment() -> None:
    env = {"OUTBOX_DATABASE_URL": "postgresql://env/db", "OUTBOX_NAMESPACE": "fromenv"}
    cfg = settings.from_env(env, database_url="postgresql://flag/db", namespace=None)
    assert cfg.database_url == "postgresql://flag/db"
    assert cfg.namespace == "fromenv"  # a flag left unset (None) does not erase the variable
    with pytest.raises(ConfigError, match="--database-url"):
        settings.from_env(env, database_url="mysql://flag/db")
    with pytest.raises(ConfigError, match="OUTBOX_NAMESPACE"):
        settings.from_env(env, namespace="bad namespace")


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_POLL_INTERVAL", "3s")
    assert settings.from_env().poll_interval_seconds == 3.0
    monkeypatch.setenv("OUTBOX_POLL_INTERVAL", "abc")
    with pytest.raises(ConfigError, match="OUTBOX_POLL_INTERVAL='abc'"):
        settings.from_env()


def test_require_urls() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_DATABASE_URL"):
        settings.Settings().require_database_url()
    with pytest.raises(ConfigError, match="OUTBOX_REDIS_URL"):
        settings.Settings().require_redis_url()
    cfg = settings.Settings(database_url="postgres://h/db", redis_url="redis://h")
    assert cfg.require_database_url() == "postgresql+psycopg://h/db"
    assert cfg.require_redis_url() == "redis://h"


# -- URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "normalized"),
    [
        ("postgresql://u:p@h:5432/db", "postgresql+psycopg://u:p@h:5432/db"),
        ("postgres://u:p@h:5432/db", "postgresql+psycopg://u:p@h:5432/db"),
        ("postgresql+psycopg://u:p@h/db", "postgresql+psycopg://u:p@h/db"),
        ("postgresql+psycopg_async://u@h/db", "postgresql+psycopg://u@h/db"),
        (
            "postgresql://postgres:@/postgres?host=/tmp/pg",
            "postgresql+psycopg://postgres:@/postgres?host=/tmp/pg",
        ),
        ("  postgresql://h/db\n", "postgresql+psycopg://h/db"),
    ],
)
def test_normalize_database_url(url: str, normalized: str) -> None:
    assert settings.normalize_database_url(url) == normalized
    assert settings.async_database_url(url) == normalized.replace("+psycopg://", "+psycopg_async://")
    assert settings.libpq_url(url) == normalized.replace("postgresql+psycopg://", "postgresql://")


@pytest.mark.parametrize(
    "url",
    [
        "mysql://u:secret@h/db",
        "mysql+pymysql://h/db",
        "sqlite:///db",
        "postgresql+psycopg2://h/db",
        "h/db",
        "",
    ],
)
def test_normalize_database_url_rejects_other_databases(url: str) -> None:
    with pytest.raises(ConfigError, match="must start with postgresql://") as info:
        settings.normalize_database_url(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("postgresql://app:s3cret@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        ("postgresql+psycopg://app:p%40ss@db/shop", "postgresql+psycopg://app:***@db/shop"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        (
            "postgresql://db/shop?user=app&password=s3cret&sslmode=require",
            "postgresql://db/shop?user=app&password=***&sslmode=require",
        ),
        ("postgresql://app@db/shop", "postgresql://app@db/shop"),
        ("postgresql://db/shop", "postgresql://db/shop"),
    ],
)
def test_redact_url(url: str, redacted: str) -> None:
    assert settings.redact_url(url) == redacted
    assert "s3cret" not in settings.redact_url(url)


# -- CLI -------------------------------------------------------------------------------------------

OUTBOX_SCRIPT = Path(sys.executable).with_name("outbox")


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args], env=base, capture_output=True, text=True, timeout=timeout
    )


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_migrate_without_database_url_exits_2() -> None:
    proc = run("migrate")
    assert proc.returncode == 2, proc
    line = one_line(proc.stderr)
    assert line.startswith("outbox: ")
    assert "OUTBOX_DATABASE_URL" in line
    assert proc.stdout == ""


def test_bad_setting_exits_2() -> None:
    proc = run("migrate", env={"OUTBOX_DATABASE_URL": "postgresql://h/db", "OUTBOX_POLL_INTERVAL": "abc"})
    assert proc.returncode == 2, proc
    assert "OUTBOX_POLL_INTERVAL='abc'" in one_line(proc.stderr)


@pytest.mark.parametrize(
    "command",
    [["worker", "examples.shop.handlers"], ["relay"], ["reconcile", "examples.shop.handlers"], ["migrate"]],
)
def test_a_pooler_without_the_direct_url_exits_2_in_one_line(command: list[str]) -> None:
    env = {
        "OUTBOX_DATABASE_URL": "postgresql://app:s3cret@pgbouncer:6432/shop",
        "OUTBOX_DATABASE_POOLER": "transaction",
        "OUTBOX_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    proc = run(*command, env=env)
    assert proc.returncode == 2, proc
    line = one_line(proc.stderr)
    assert "OUTBOX_DIRECT_DATABASE_URL" in line and "s3cret" not in line


def test_other_database_url_exits_2_without_the_password() -> None:
    proc = run("migrate", "--database-url", "mysql://app:s3cret@db/shop")
    assert proc.returncode == 2, proc
    line = one_line(proc.stderr)
    assert "postgresql://" in line and "s3cret" not in line


def test_unreachable_database_exits_3() -> None:
    proc = run("migrate", env={"OUTBOX_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/x"})
    assert proc.returncode == 3, proc
    line = one_line(proc.stderr)
    assert line.startswith("outbox: cannot reach PostgreSQL")
    assert "127.0.0.1" in line


def test_version() -> None:
    assert OUTBOX_SCRIPT.exists(), "the console script is installed next to the interpreter"
    proc = subprocess.run([str(OUTBOX_SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc
    assert proc.stdout.strip() == f"outbox {outbox.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", outbox.__version__)


def test_migrate_help() -> None:
    proc = subprocess.run(
        [str(OUTBOX_SCRIPT), "migrate", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc
    assert proc.stdout.startswith("usage: outbox migrate")
    assert "--database-url" in proc.stdout
    assert "$OUTBOX_DATABASE_URL" in proc.stdout


def test_every_default_is_defined_once_in_settings() -> None:
    """The Settings fields, the relay's and the reconciler's constructors, @outbox.handler and the
    heartbeat read their defaults from the module's DEFAULT_* constants, never a literal of their own."""
    import inspect

    from outbox import heartbeat
    from outbox.reconciler.scheduler import Reconciler
    from outbox.relay import Relay

    fields = {f.name: f.default for f in dataclasses.fields(settings.Settings)}
    assert fields["relay_batch_size"] == settings.DEFAULT_RELAY_BATCH_SIZE
    assert fields["retention_seconds"] == settings.DEFAULT_RETENTION_SECONDS
    assert fields["no_consumer_cycles"] == settings.DEFAULT_NO_CONSUMER_CYCLES
    assert fields["failover_check_interval_seconds"] == settings.DEFAULT_FAILOVER_CHECK_INTERVAL_SECONDS
    relay = inspect.signature(Relay).parameters
    assert (
        relay["batch_size"].default,
        relay["parallel"].default,
        relay["poll_interval_seconds"].default,
    ) == (
        settings.DEFAULT_RELAY_BATCH_SIZE,
        settings.DEFAULT_RELAY_CONNECTIONS,
        settings.DEFAULT_POLL_INTERVAL_SECONDS,
    )
    reconciler = inspect.signature(Reconciler).parameters
    for name in ("redispatch_after_seconds", "retention_seconds", "ledger_horizon_seconds"):
        assert reconciler[name].default == fields[name], name
    assert reconciler["unknown_alert_after_seconds"].default == settings.DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS
    assert heartbeat.DEFAULT_HEARTBEAT_INTERVAL_SECONDS is settings.DEFAULT_HEARTBEAT_INTERVAL_SECONDS


def test_help_texts_show_the_defaults_as_durations():
    assert [settings.describe_seconds(s) for s in (7 * 86400, 3600, 300, 10, 0.5, 90 * 86400)] == [
        "7d",
        "1h",
        "300 s",
        "10 s",
        "0.5 s",
        "90d",
    ]
    from outbox.cli import reconcile

    # The reconciler's help names the defaults outbox.settings holds, not copies of them.
    assert f"OUTBOX_RETENTION (default {settings.describe_seconds(settings.DEFAULT_RETENTION_SECONDS)})" in (
        reconcile.DESCRIPTION
    )
