"""Configuration from the environment, with command-line flags over it.

Every timing carries its unit in its name and has a documented default and variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .exceptions import ConfigError

# -- every default, once (the Settings fields below, @outbox.handler, the CLI and the
# reconciler's jobs read them from here) --

DEFAULT_NAMESPACE = "outbox"
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
DEFAULT_POLL_INTERVAL_SECONDS = 1.0
#: Relay: the least time between two takes woken by NOTIFY (see `relay.relay`); 0 = none. 7 ms:
#: under a stream of one-row commits it nearly halves the relay's CPU a row for a few ms of
#: commit -> Redis latency (docs/decisions/hot-path-costs.md); a row committed after a quiet
#: spell (no take in the last 7 ms) is taken at once, so lower rates do not wait.
DEFAULT_RELAY_GATHER_SECONDS = 0.007
DEFAULT_RELAY_BATCH_SIZE = 1000
#: Rows an operator's list shows unless told otherwise (outbox list, failed, unknown).
DEFAULT_LIST_LIMIT = 50
DEFAULT_RELAY_CONNECTIONS = 2
DEFAULT_REDISPATCH_AFTER_SECONDS = 300.0
DEFAULT_RETENTION_SECONDS = 7 * 86400.0
DEFAULT_LEDGER_HORIZON_SECONDS = 90 * 86400.0
DEFAULT_RECONCILE_INTERVAL_SECONDS = 10.0
DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS = 3600.0
#: Lookups of one destination the reconciler has in flight at once (outbox.settlement).
DEFAULT_LOOKUP_CONCURRENCY = 16
DEFAULT_HEARTBEAT_INTERVAL_SECONDS = 5.0
#: Reconciler cycles a destination must go without a consumer before it is alerted.
DEFAULT_NO_CONSUMER_CYCLES = 3
#: A destination's pause or breaker trip that begins less than this after the previous one ended
#: by itself continues its episode (outbox.pauses, outbox.breaker): a provider answering "503,
#: Retry-After: 55" to every probe makes a chain of short holds, which is one outage, alerted once.
DESTINATION_EPISODE_GAP_SECONDS = 300
#: The rates a destination may be given (``max_calls_per_second``, ``outbox limit --per-second``),
#: as migration 0024's CHECK has them: from one call in about 17 minutes to far above any
#: provider's.
MIN_CALLS_PER_SECOND = 0.001
MAX_CALLS_PER_SECOND = 1_000_000
#: How far ahead a paced destination's claim may book its call's start (migration 0024's trigger
#: has the same): a second, or a quarter of the claim's lease if shorter.
PACE_AHEAD_SECONDS = 1.0
DEFAULT_CLOCK_SKEW_WARN_SECONDS = 2.0
DEFAULT_FAILOVER_CHECK_INTERVAL_SECONDS = 30.0
#: TCP on every connection to PostgreSQL and Redis (outbox.db, outbox.transport). Without them a
#: link that drops packets (a host cut off, a firewall forgetting the connection) leaves a socket
#: waiting for the kernel's retransmissions to give up, about 15 minutes, with a claim, a record
#: or a fetch stuck on it. Data unacknowledged for 30 s gives a connection up (a connect to a host
#: that does not answer included), and so does an idle one whose peer stops answering the
#: keepalive probes sent from 10 s of silence on, every 5 s (after 3 of them, or, where the user
#: timeout is set, once it has passed). A healthy peer's kernel acknowledges at once, however long
#: its query or command runs, so none of this cuts a slow statement short.
DEFAULT_TCP_KEEPALIVE_IDLE_SECONDS = 10.0
DEFAULT_TCP_KEEPALIVE_INTERVAL_SECONDS = 5.0
DEFAULT_TCP_KEEPALIVE_COUNT = 3
DEFAULT_TCP_USER_TIMEOUT_SECONDS = 30.0
#: Opening a connection to PostgreSQL (TCP, TLS, authentication, the server's first answer) gives
#: up after this: a peer that accepts TCP and never answers keeps its keepalives answered by the
#: kernel, so neither of the above ends that wait. Generous beside a healthy server's start-up
#: (milliseconds; seconds when it forks under load).
DEFAULT_CONNECT_TIMEOUT_SECONDS = 15.0
#: Connections an async handler's client keeps to its provider at most, per process and
#: destination, unless the worker runs more calls at once (httpx's own default is 100).
DEFAULT_ASYNC_POOL_SIZE = 100
#: Calls a worker process runs at once unless told (``--concurrency``): threads for sync
#: handlers, tasks for async ones. None of them holds a database connection during its call.
DEFAULT_WORKER_CONCURRENCY = 32
#: Connections a worker process shares between its threads for claims (synchronous commit) and
#: for records (asynchronous commit); with its heartbeat and failover guard, 8 in all. Records
#: get more: a claim takes a fetch's rows in one statement, each call's answer has its own
#: record, and answers come in bursts (with two, an async worker at 400/s, 300 ms provider,
#: waited a median 43 ms between the answer and its record, and its p99 doubled).
DEFAULT_WORKER_CLAIM_CONNECTIONS = 2
DEFAULT_WORKER_RECORD_CONNECTIONS = 4

# Handler declarations (``@outbox.handler``).
DEFAULT_TIME_LIMIT_SECONDS = 30.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF_SECONDS: tuple[float, ...] = (10.0, 60.0, 300.0)
#: How long providers keep an Idempotency-Key (Stripe: 24 h).
DEFAULT_KEY_TTL_SECONDS = 86400.0
#: The least lease beyond ``time_limit`` a default lease gives (``default_lease_seconds``).
DEFAULT_LEASE_MARGIN_SECONDS = 15.0
#: The least ``lease_seconds - time_limit`` a handler may declare: below it, the claim's own round
#: trip would eat the room the record needs after the call's deadline.
MIN_LEASE_MARGIN_SECONDS = 1.0
#: The most lease beyond ``time_limit`` a worker keeps for the record (see
#: ``Handler.start_margin_seconds``).
MAX_START_MARGIN_SECONDS = 5.0


def default_lease_seconds(time_limit: float) -> float:
    """A handler's lease when it declares none: ``time_limit + max(15, time_limit)``."""
    return time_limit + max(DEFAULT_LEASE_MARGIN_SECONDS, time_limit)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def describe_seconds(seconds: float) -> str:
    """A duration as the help texts show it: ``7d``, ``1h``, ``15m``, ``300 s``, ``0.5 s``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g} s"


def parse_seconds(value: str, name: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"`` → seconds."""
    match = _DURATION.match(value)
    if not match:
        raise ConfigError(f"{name}={value!r} is not a duration (examples: 30, 30s, 15m, 12h, 7d)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def normalize_database_url(url: str) -> str:
    """Accept the plain ``postgresql://`` form users have and select the psycopg 3 driver."""
    url = url.strip()
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg_async://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ConfigError(
        f"database URL must start with postgresql:// or postgresql+psycopg:// (got {redact_url(url)!r})"
    )


def async_database_url(url: str) -> str:
    return normalize_database_url(url).replace("postgresql+psycopg://", "postgresql+psycopg_async://", 1)


def libpq_url(url: str) -> str:
    """The URL as psycopg (without SQLAlchemy) wants it."""
    return "postgresql://" + normalize_database_url(url)[len("postgresql+psycopg://") :]


def redact_url(url: str) -> str:
    """Hide the password of a URL before it reaches a log line or an error message.

    Both places libpq reads one from: ``user:password@`` and the ``password=`` query parameter;
    and a Sentinel URL's ``sentinel_password=``.
    """
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&](?:sentinel_)?password=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)


#: A Redis reached through Redis Sentinel (``redis+sentinel://``; TLS: ``rediss+sentinel://``).
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
#: A sentinel's port when a URL names a host alone.
DEFAULT_SENTINEL_PORT = 26379
_SENTINEL_FORM = "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"


@dataclasses.dataclass(frozen=True)
class SentinelURL:
    """A ``redis+sentinel://`` URL taken apart (see docs/configuration.md). The user and password
    before the ``@`` are the primary's (and its replicas'); the sentinels' own are the query
    options ``sentinel_username`` and ``sentinel_password``."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = dataclasses.field(default=None, repr=False)
    tls: bool = False
    #: The other query options, as given: redis-py's URL options for the primary's connections
    #: (``socket_timeout``, ``ssl_cert_reqs``, ...).
    options: tuple[tuple[str, str], ...] = ()


def _address(number: int, entry: str) -> str:
    """A sentinel address for an error message: its text when it can only be a host and port,
    else its position. A password holding an unencoded / ? or # ends the URL's authority early,
    and what an "address" then holds is part of that password."""
    if re.fullmatch(r"[A-Za-z0-9._\-]*(:[0-9]*)?|\[[0-9A-Fa-f:.]*\](:[0-9]*)?", entry):
        return repr(entry)
    return f"number {number} (not shown: percent-encode / ? # @ in a password)"


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEMES)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Take a Sentinel URL apart; ConfigError (the URL redacted) when it is not one."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{why}: a Sentinel URL is {_SENTINEL_FORM} (got {redact_url(url)!r})")

    if not is_sentinel_url(url):
        raise bad(f"the scheme {url.partition('://')[0]!r} is not redis+sentinel or rediss+sentinel")
    scheme, _, rest = url.partition("://")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise bad("a fragment (#...) means nothing here")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    sentinels: list[tuple[str, int]] = []
    for number, entry in enumerate(hosts.split(","), start=1):
        entry = entry.strip()
        if not entry:
            raise bad("a sentinel address is empty")
        if entry.startswith("["):  # [IPv6]:port
            host, bracket, tail = entry[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                raise bad(f"the sentinel address {_address(number, entry)} is not [IPv6]:PORT")
            raw_port = tail[1:] if tail else ""
        else:
            host, _, raw_port = entry.partition(":")
        if not host or any(c in host for c in " /?#@"):
            raise bad(f"the sentinel address {_address(number, entry)} has no host name")
        port = DEFAULT_SENTINEL_PORT
        if raw_port:
            try:
                port = parse_port(raw_port, "port")
            except ConfigError:
                raise bad(
                    f"the sentinel address {_address(number, entry)} has no TCP port between 1 and 65535"
                ) from None
        sentinels.append((host, port))
    parts = path.split("/") if slash else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise bad("no service name (the name the sentinels monitor the primary by, e.g. mymaster)")
    if len(parts) > 2:
        raise bad(f"the path {'/' + path!r} has more than a service and a database number")
    service = urllib.parse.unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise bad(f"the database {parts[1]!r} is not a whole number")
        db = int(parts[1])
    options: list[tuple[str, str]] = []
    sentinel_username = sentinel_password = None
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise bad("the query is not NAME=VALUE&...") from None
    for name, value in pairs:
        if name == "sentinel_username":
            sentinel_username = value or None
        elif name == "sentinel_password":
            sentinel_password = value or None
        elif name in ("db", "host", "port", "username", "password"):
            raise bad(f"the query option {name!r} belongs in the URL itself")
        else:
            options.append((name, value))
    return SentinelURL(
        sentinels=tuple(sentinels),
        service=service,
        db=db,
        username=username,
        password=password,
        sentinel_username=sentinel_username,
        sentinel_password=sentinel_password,
        tls=scheme == "rediss+sentinel",
        options=tuple(options),
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the processes read from ``OUTBOX_*`` variables; see ``docs/configuration.md``."""

    #: The connection the hot paths use: the worker's claims, records and heartbeat, the relay's
    #: takes. May be a pooler in transaction mode (``database_pooler``).
    database_url: str | None = None
    redis_url: str | None = None
    #: ``"transaction"`` when ``database_url`` is a connection pooler in transaction mode
    #: (PgBouncer): then ``direct_database_url`` is required, and everything that needs one
    #: backend for longer than a transaction connects there (docs/production.md).
    database_pooler: str | None = None
    #: PostgreSQL itself, not the pooler: LISTEN, advisory locks, migrate, the failover guard,
    #: the reconciler, operator commands and the dashboard.
    direct_database_url: str | None = None
    #: Prefix of every Redis key the broker writes; must not be shared with caches or sessions.
    namespace: str = DEFAULT_NAMESPACE
    #: Relay: fallback poll when no NOTIFY arrives (NOTIFY is not durable).
    poll_interval_seconds: float = DEFAULT_POLL_INTERVAL_SECONDS
    #: Relay: a NOTIFY that comes less than this after the relay's previous take waits out the
    #: rest of it, so a stream of one-row commits is published a few rows per take instead of one
    #: take (an UPDATE, a Redis pipeline, a COMMIT) per row; a row committed while the relay has
    #: been idle longer is taken at once. Adds at most this much to commit -> Redis; 0 = off.
    relay_gather_seconds: float = DEFAULT_RELAY_GATHER_SECONDS
    #: Relay: rows claimed and published per batch.
    relay_batch_size: int = DEFAULT_RELAY_BATCH_SIZE
    #: Relay: connections claiming batches at once while there is a backlog (one waits on
    #: PostgreSQL while another publishes); one when the relay is idle.
    relay_connections: int = DEFAULT_RELAY_CONNECTIONS
    worker_concurrency: int = DEFAULT_WORKER_CONCURRENCY
    #: Worker: deliveries one destination may hold at once in a process (None: all of
    #: ``worker_concurrency`` for a worker of one queue, three quarters with several; outbox.runner).
    worker_slots_per_destination: int | None = None
    #: Reconciler: a `dispatched` row unclaimed for this long is re-queued.
    redispatch_after_seconds: float = DEFAULT_REDISPATCH_AFTER_SECONDS
    #: Reconciler: `sent` and `cancelled` rows older than this are purged.
    retention_seconds: float = DEFAULT_RETENTION_SECONDS
    #: Reconciler: a purged key stays in the key ledger this long after its row completed;
    #: past it, writing the key again creates a new row (a new call).
    ledger_horizon_seconds: float = DEFAULT_LEDGER_HORIZON_SECONDS
    #: Reconciler: cadence of every job.
    reconcile_interval_seconds: float = DEFAULT_RECONCILE_INTERVAL_SECONDS
    #: Reconciler: lookups of one destination in flight at once while it settles `unknown`
    #: rows (each destination starts at one and doubles while its lookups answer).
    lookup_concurrency: int = DEFAULT_LOOKUP_CONCURRENCY
    #: Reconciler: an `unknown` row older than this raises an alert.
    unknown_alert_after_seconds: float = DEFAULT_UNKNOWN_ALERT_AFTER_SECONDS
    #: Write API: largest encoded payload accepted.
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: Start even when Redis may evict keys (never do this in production).
    allow_evicting_redis: bool = False
    # -- transport --
    #: Worker: seconds between two heartbeats recorded in the database.
    heartbeat_interval_seconds: float = DEFAULT_HEARTBEAT_INTERVAL_SECONDS
    #: Reconciler: cycles a destination goes with rows waiting and no live consumer before it
    #: is alerted (once per episode).
    no_consumer_cycles: int = DEFAULT_NO_CONSUMER_CYCLES
    #: Doctor: a process whose clock differs from the database's by more than this is warned.
    clock_skew_warn_seconds: float = DEFAULT_CLOCK_SKEW_WARN_SECONDS
    #: Relay, worker, reconciler: how often the database identity is compared with the recorded
    #: one (failover detection, outbox.failover); also at start and on every new connection.
    failover_check_interval_seconds: float = DEFAULT_FAILOVER_CHECK_INTERVAL_SECONDS
    #: Every connection to PostgreSQL and Redis: seconds of silence before an idle connection is
    #: probed, seconds between probes, unanswered probes before it is given up.
    tcp_keepalive_idle_seconds: float = DEFAULT_TCP_KEEPALIVE_IDLE_SECONDS
    tcp_keepalive_interval_seconds: float = DEFAULT_TCP_KEEPALIVE_INTERVAL_SECONDS
    tcp_keepalive_count: int = DEFAULT_TCP_KEEPALIVE_COUNT
    #: Every connection to PostgreSQL and Redis: how long sent data may stay unacknowledged (a
    #: connect included) before the connection is given up; 0: the system's default (minutes).
    tcp_user_timeout_seconds: float = DEFAULT_TCP_USER_TIMEOUT_SECONDS
    #: Every connection to PostgreSQL: how long opening it may take (libpq's connect_timeout);
    #: 0: no limit.
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS
    #: Relay, worker, reconciler: TCP port serving /metrics, /healthz and /readyz (outbox.probes);
    #: None: no endpoint.
    metrics_port: int | None = None

    @property
    def pooled(self) -> bool:
        """Whether ``database_url`` leads to a pooler in transaction mode."""
        return self.database_pooler == POOLER_TRANSACTION

    def require_database_url(self) -> str:
        """A connection that keeps its backend between transactions: PostgreSQL itself
        (``OUTBOX_DIRECT_DATABASE_URL`` when a pooler is configured)."""
        if self.pooled and self.direct_database_url:
            return normalize_database_url(self.direct_database_url)
        return self.require_hot_database_url()

    def require_hot_database_url(self) -> str:
        """``OUTBOX_DATABASE_URL``: the hot paths' connections (a pooler's when ``pooled``)."""
        if not self.database_url:
            raise ConfigError(
                "no database configured: set OUTBOX_DATABASE_URL (or pass --database-url), "
                "e.g. postgresql://user:password@host:5432/dbname"
            )
        return normalize_database_url(self.database_url)

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ConfigError(
                "no Redis configured: set OUTBOX_REDIS_URL (or pass --redis-url), e.g. redis://host:6379/0"
            )
        return self.redis_url

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


#: Environment variable → (field, parser). Read by `Settings.from_env` and by the compose test.
ENVIRONMENT: dict[str, str] = {
    "OUTBOX_DATABASE_URL": "database_url",
    "OUTBOX_REDIS_URL": "redis_url",
    "OUTBOX_DATABASE_POOLER": "database_pooler",
    "OUTBOX_DIRECT_DATABASE_URL": "direct_database_url",
    "OUTBOX_NAMESPACE": "namespace",
    "OUTBOX_POLL_INTERVAL": "poll_interval_seconds",
    "OUTBOX_RELAY_BATCH_SIZE": "relay_batch_size",
    "OUTBOX_RELAY_CONNECTIONS": "relay_connections",
    "OUTBOX_WORKER_CONCURRENCY": "worker_concurrency",
    "OUTBOX_WORKER_SLOTS_PER_DESTINATION": "worker_slots_per_destination",
    "OUTBOX_RELAY_GATHER": "relay_gather_seconds",
    "OUTBOX_REDISPATCH_AFTER": "redispatch_after_seconds",
    "OUTBOX_RETENTION": "retention_seconds",
    "OUTBOX_LEDGER_HORIZON": "ledger_horizon_seconds",
    "OUTBOX_RECONCILE_INTERVAL": "reconcile_interval_seconds",
    "OUTBOX_UNKNOWN_ALERT_AFTER": "unknown_alert_after_seconds",
    "OUTBOX_LOOKUP_CONCURRENCY": "lookup_concurrency",
    "OUTBOX_MAX_PAYLOAD_BYTES": "max_payload_bytes",
    "OUTBOX_ALLOW_EVICTING_REDIS": "allow_evicting_redis",
    "OUTBOX_HEARTBEAT_INTERVAL": "heartbeat_interval_seconds",
    "OUTBOX_NO_CONSUMER_CYCLES": "no_consumer_cycles",
    "OUTBOX_CLOCK_SKEW_WARN": "clock_skew_warn_seconds",
    "OUTBOX_FAILOVER_CHECK_INTERVAL": "failover_check_interval_seconds",
    "OUTBOX_METRICS_PORT": "metrics_port",
    "OUTBOX_TCP_KEEPALIVE_IDLE": "tcp_keepalive_idle_seconds",
    "OUTBOX_TCP_KEEPALIVE_INTERVAL": "tcp_keepalive_interval_seconds",
    "OUTBOX_TCP_KEEPALIVE_COUNT": "tcp_keepalive_count",
    "OUTBOX_TCP_USER_TIMEOUT": "tcp_user_timeout_seconds",
    "OUTBOX_CONNECT_TIMEOUT": "connect_timeout_seconds",
}

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES)
#: The one pooler mode supported: a session pooler needs nothing of us, a statement pooler
#: breaks every multi-statement transaction (the relay's take).
POOLER_TRANSACTION = "transaction"
#: Durations where 0 means "off" rather than a mistake.
_ZERO_ALLOWED = frozenset({"relay_gather_seconds", "tcp_user_timeout_seconds", "connect_timeout_seconds"})
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")


def parse_port(raw: str, name: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a TCP port number") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r} must be a TCP port between 1 and 65535")
    return port


def _parse(field: dataclasses.Field[Any], name: str, raw: str) -> Any:
    if field.name.endswith("_port"):
        return parse_port(raw, name)
    if field.name.endswith("_seconds"):
        seconds = parse_seconds(raw, name)
        if field.name in _ZERO_ALLOWED and seconds == 0:
            return seconds
        if seconds <= 0:
            raise ConfigError(f"{name}={raw!r} must be greater than zero")
        return seconds
    if field.type in ("int", int, "int | None"):
        try:
            number = int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a whole number") from None
        if number <= 0:
            raise ConfigError(f"{name}={raw!r} must be greater than zero")
        return number
    if field.type in ("bool", bool):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}={raw!r} is not a boolean (use true or false)")
    return raw.strip() or None


@dataclasses.dataclass(frozen=True)
class TcpSettings:
    """The TCP settings of every connection to PostgreSQL and Redis, in whole units as the
    sockets take them (the kernel counts keepalive times in seconds)."""

    keepalive_idle_seconds: int
    keepalive_interval_seconds: int
    keepalive_count: int
    #: 0: not set (the system's default).
    user_timeout_ms: int
    #: libpq's connect_timeout for PostgreSQL connections (whole seconds; 0: no limit).
    connect_timeout_seconds: int = 0


_TCP_VARIABLES = (
    "OUTBOX_TCP_KEEPALIVE_IDLE",
    "OUTBOX_TCP_KEEPALIVE_INTERVAL",
    "OUTBOX_TCP_KEEPALIVE_COUNT",
    "OUTBOX_TCP_USER_TIMEOUT",
    "OUTBOX_CONNECT_TIMEOUT",
)


def tcp_settings(environ: Mapping[str, str] | None = None) -> TcpSettings:
    """``OUTBOX_TCP_*`` as the connections take them. Read where a connection is opened (a
    URL is all those places are given); a process checks them with the rest at start
    (:func:`from_env`)."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name in _TCP_VARIABLES:
        raw = environ.get(name)
        if raw:
            values[ENVIRONMENT[name]] = _parse(fields[ENVIRONMENT[name]], name, raw)
    cfg = Settings(**values)
    return TcpSettings(
        keepalive_idle_seconds=max(1, math.ceil(cfg.tcp_keepalive_idle_seconds)),
        keepalive_interval_seconds=max(1, math.ceil(cfg.tcp_keepalive_interval_seconds)),
        keepalive_count=cfg.tcp_keepalive_count,
        user_timeout_ms=math.ceil(cfg.tcp_user_timeout_seconds * 1000),
        # libpq counts whole seconds and takes 1 as 2.
        connect_timeout_seconds=(
            max(2, math.ceil(cfg.connect_timeout_seconds)) if cfg.connect_timeout_seconds else 0
        ),
    )


def check_redis_url(url: str, source: str) -> None:
    """ConfigError, naming ``source``, unless ``url`` is a Redis URL the processes can use."""
    if not url.startswith(_REDIS_SCHEMES):
        raise ConfigError(
            f"{source}: Redis URL must start with redis://, rediss://, unix://, redis+sentinel:// "
            f"or rediss+sentinel:// (got {redact_url(url)!r})"
        )
    if is_sentinel_url(url):
        try:
            parse_sentinel_url(url)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    elif not url.startswith("unix://"):
        try:
            _ = urllib.parse.urlsplit(url).port
        except ValueError:
            # urllib's own message quotes what it read as the port: with an unencoded / ? or #
            # in the password, part of the password.
            raise ConfigError(
                f"{source}: the Redis URL's HOST:PORT cannot be read (percent-encode / ? # @ in a "
                f"password) (got {redact_url(url)!r})"
            ) from None


def from_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Read ``OUTBOX_*`` variables; keyword overrides (command-line flags) win when not None."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, field_name in ENVIRONMENT.items():
        raw = environ.get(name)
        if raw is not None and raw != "":
            values[field_name] = _parse(fields[field_name], name, raw)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "ledger_horizon_seconds" not in values and "retention_seconds" in values:
        # A deployment that already keeps rows longer than the default horizon keeps working:
        # the ledger then starts where the rows end.
        values["ledger_horizon_seconds"] = max(Settings.ledger_horizon_seconds, values["retention_seconds"])
    settings = Settings(**values)
    if not isinstance(settings.namespace, str) or not _NAMESPACE_RE.match(settings.namespace):
        raise ConfigError(
            f"OUTBOX_NAMESPACE={settings.namespace or ''!r} must be 1-64 characters of letters, "
            "digits, '_', '.', '-'"
        )
    if settings.ledger_horizon_seconds < settings.retention_seconds:
        # The ledger counts from the same completed_at as the retention: a shorter horizon would
        # drop a key as soon as its row is purged.
        raise ConfigError(
            f"OUTBOX_LEDGER_HORIZON ({settings.ledger_horizon_seconds:g} s) must be at least "
            f"OUTBOX_RETENTION ({settings.retention_seconds:g} s)"
        )
    if settings.database_url:
        try:
            normalize_database_url(settings.database_url)
        except ConfigError as exc:
            source = "--database-url" if overrides.get("database_url") else "OUTBOX_DATABASE_URL"
            raise ConfigError(f"{source}: {exc}") from None
    if settings.direct_database_url:
        try:
            normalize_database_url(settings.direct_database_url)
        except ConfigError as exc:
            raise ConfigError(f"OUTBOX_DIRECT_DATABASE_URL: {exc}") from None
    if settings.database_pooler is not None:
        if settings.database_pooler.lower() != POOLER_TRANSACTION:
            raise ConfigError(
                f"OUTBOX_DATABASE_POOLER={settings.database_pooler!r}: the only pooler mode is "
                f"{POOLER_TRANSACTION!r} (leave it unset when OUTBOX_DATABASE_URL is PostgreSQL itself "
                "or a pooler in session mode)"
            )
        settings = dataclasses.replace(settings, database_pooler=POOLER_TRANSACTION)
        if not settings.direct_database_url:
            raise ConfigError(
                "OUTBOX_DATABASE_POOLER=transaction needs OUTBOX_DIRECT_DATABASE_URL: PostgreSQL itself, "
                "not the pooler (LISTEN, advisory locks, migrate and the failover guard need one backend)"
            )
        if settings.database_url and normalize_database_url(settings.direct_database_url) == (
            normalize_database_url(settings.database_url)
        ):
            raise ConfigError(
                "OUTBOX_DIRECT_DATABASE_URL is the same as OUTBOX_DATABASE_URL: with "
                "OUTBOX_DATABASE_POOLER=transaction it must lead to PostgreSQL itself, not the pooler"
            )
    elif settings.direct_database_url:
        # Ignored, it would hide a half-made switch to a pooler (OUTBOX_DATABASE_URL already
        # pointing at it, and everything going through it).
        raise ConfigError(
            "OUTBOX_DIRECT_DATABASE_URL is only read with OUTBOX_DATABASE_POOLER=transaction: set that "
            "too (OUTBOX_DATABASE_URL is then the pooler's), or unset OUTBOX_DIRECT_DATABASE_URL"
        )
    if settings.redis_url:
        check_redis_url(
            settings.redis_url, "--redis-url" if overrides.get("redis_url") else "OUTBOX_REDIS_URL"
        )
    return settings
