"""The transport: Dramatiq messages on Redis. Nothing here knows about SQL or handlers.

A message carries only the row id; the payload stays in the database, which is the source of
truth. The relay writes Dramatiq's documented Redis layout directly (``HSET ns:queue.msgs`` +
``RPUSH ns:queue``, exactly what Dramatiq's own ``enqueue`` does in Lua) so that a whole batch
costs one pipelined round trip instead of one EVALSHA per message.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis
import redis.sentinel
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis

from .exceptions import UnsafeBroker
from .settings import SentinelURL, is_sentinel_url, parse_sentinel_url, tcp_settings

logger = logging.getLogger(__name__)

#: The one actor every outbox message is addressed to; the queue names the destination.
ACTOR_NAME = "outbox_deliver"


def dispatch_micros(dispatched_at: datetime) -> int:
    """The dispatch time as it appears in message ids (the relay computes it once per batch)."""
    return int(dispatched_at.timestamp() * 1_000_000)


def message_id(row_id: int, dispatched_at: datetime) -> str:
    """Deterministic per (row, dispatch), so the reconciler can ask Redis whether it still waits."""
    return f"outbox-{row_id}-{dispatch_micros(dispatched_at)}"


def encode_message(row_id: int, destination: str, mid: str, timestamp_ms: int) -> bytes:
    return json.dumps(
        {
            "queue_name": destination,
            "actor_name": ACTOR_NAME,
            "args": [row_id],
            "kwargs": {},
            "options": {"redis_message_id": mid},
            "message_id": mid,
            "message_timestamp": timestamp_ms,
        },
        separators=(",", ":"),
    ).encode()


def queue_key(namespace: str, destination: str) -> str:
    return f"{namespace}:{destination}"


def connect(url: str, **options: object) -> redis.Redis:
    """A client of the Redis at ``url``: ``redis://``, ``rediss://``, ``unix://``, or the primary
    of a Sentinel service (``redis+sentinel://``, ``rediss+sentinel://``; docs/configuration.md),
    whose connections ask the sentinels where the primary is each time they connect, so that a
    client follows a failover without a restart."""
    if is_sentinel_url(url):
        return _connect_sentinel(parse_sentinel_url(url), options)
    if url.startswith(("redis://", "rediss://")):
        # A URL's own socket_keepalive wins (redis-py lets the URL's options win over these).
        options = {**tcp_options(), **options}
    return redis.Redis.from_url(url, **options)


def tcp_options() -> dict[str, object]:
    """TCP keepalives and ``TCP_USER_TIMEOUT`` (from ``OUTBOX_TCP_*``, docs/configuration.md) for a
    Redis client's TCP connections, as for PostgreSQL's (outbox.db.tcp_parameters): a link that
    silently drops packets gives a connection up within them, whatever redis-py release (and
    socket timeout) is installed. Options the platform lacks are left out."""
    tcp = tcp_settings()
    wanted = {
        "TCP_KEEPIDLE": tcp.keepalive_idle_seconds,
        "TCP_KEEPINTVL": tcp.keepalive_interval_seconds,
        "TCP_KEEPCNT": tcp.keepalive_count,
        "TCP_USER_TIMEOUT": tcp.user_timeout_ms,
    }
    keepalive = {
        getattr(socket, name): value
        for name, value in wanted.items()
        if hasattr(socket, name) and (value or name != "TCP_USER_TIMEOUT")
    }
    return {"socket_keepalive": True, "socket_keepalive_options": keepalive}


# -- Redis Sentinel ---------------------------------------------------------------------------------

#: The sentinels' socket timeouts unless the caller's are given: asking one where the primary is
#: is one short command, and a dead one must not hold a reconnect for long.
SENTINEL_SOCKET_TIMEOUT_SECONDS = 5.0

#: (namespace, allow_evicting) of this process's broker, once its start-up check ran: every new
#: primary a Sentinel client connects to is checked the same way before it is used.
_primary_policy: tuple[str, bool] | None = None


class UnsafePrimary(redis.ConnectionError):
    """The primary a failover promoted fails the start-up checks (its eviction policy, or keys
    of a cache in the namespace): it is not used, as if unreachable, until it passes them."""


def _connect_sentinel(spec: SentinelURL, options: dict[str, object]) -> redis.Redis:
    # The primary's options as redis-py reads them from a URL (socket_timeout=, ssl_cert_reqs=,
    # ...), the same names a redis:// URL takes; host and port are the sentinels' to say.
    scheme = "rediss" if spec.tls else "redis"
    query = urllib.parse.urlencode(spec.options)
    parsed = redis.connection.parse_url(f"{scheme}://localhost/{spec.db}" + (f"?{query}" if query else ""))
    primary: dict[str, Any] = {
        k: v for k, v in parsed.items() if k not in ("host", "port", "path", "connection_class")
    }
    for name, value in tcp_options().items():
        primary.setdefault(name, value)  # the URL's socket_keepalive wins
    primary.update(options)
    primary.update(db=spec.db, username=spec.username, password=spec.password)
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in primary.items() if k.startswith(("socket_", "ssl_"))}
    sentinel_kwargs.setdefault("socket_timeout", SENTINEL_SOCKET_TIMEOUT_SECONDS)
    sentinel_kwargs.setdefault("socket_connect_timeout", SENTINEL_SOCKET_TIMEOUT_SECONDS)
    sentinel_kwargs.update(username=spec.sentinel_username, password=spec.sentinel_password)
    if spec.tls:
        sentinel_kwargs["ssl"] = True
    manager = redis.sentinel.Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs)
    pool = _PrimaryPool(
        spec.service,
        manager,
        connection_class=_PrimarySSLConnection if spec.tls else _PrimaryConnection,
        **primary,
    )
    pool.check_options = {**primary, **({"ssl": True} if spec.tls else {})}
    return _SentinelClient(connection_pool=pool)


class _SentinelClient(redis.Redis):
    """Owns its pool, as a client from a URL does, and the clients of its sentinels: its close
    closes them all."""

    def close(self) -> None:
        super().close()
        pool: Any = self.connection_pool
        pool.disconnect()
        for sentinel in pool.sentinel_manager.sentinels:
            sentinel.close()


class _PrimaryPool(redis.sentinel.SentinelConnectionPool):
    """A Sentinel pool that runs the start-up checks on each new primary before a connection to
    it is used (and says in the log where the primary now is)."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.check_options: dict[str, Any] = {}
        self.checked: tuple[str, int] | None = None
        #: The primary last found unsafe: said once, not at every try of every thread.
        self._refused: tuple[str, int] | None = None
        self._check_lock = threading.Lock()

    def check_primary(self, address: tuple[str, int]) -> None:
        with self._check_lock:
            if self.checked == address:
                return
            policy = _primary_policy
            if policy is not None:
                namespace, allow_evicting = policy
                client = redis.Redis(host=address[0], port=int(address[1]), **self.check_options)
                try:
                    problems = check_broker_safety(client, namespace, allow_evicting=allow_evicting)
                finally:
                    client.close()
                if problems:
                    message = (
                        f"the Redis primary of Sentinel service {self.service_name!r} at "
                        f"{address[0]}:{address[1]} is not used: {'; '.join(problems)}"
                    )
                    if self._refused != address:
                        self._refused = address
                        logger.error(message)
                    raise UnsafePrimary(message)
                self._refused = None
            if self.checked is not None:
                logger.warning(
                    "Redis failover: the primary of Sentinel service %r is now %s:%s (was %s:%s)",
                    self.service_name,
                    address[0],
                    address[1],
                    *self.checked,
                    extra={"sentinel_service": self.service_name},
                )
            self.checked = address


class _PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    def connect_to(self, address: tuple[str, int]) -> None:
        super().connect_to(address)
        # redis-py >= 5.0.1 hands its connections a proxy of their pool.
        proxy = self.connection_pool
        pool = proxy.connection_pool_ref() if hasattr(proxy, "connection_pool_ref") else proxy
        if isinstance(pool, _PrimaryPool) and pool.checked != address:
            try:
                pool.check_primary(address)
            except BaseException:
                self.disconnect()
                raise


class _PrimarySSLConnection(_PrimaryConnection, redis.connection.SSLConnection):
    pass


def _is_failover(error: redis.ResponseError) -> bool:
    """Whether a reply is a demoted primary's READONLY: not a refusal of one command, but "not
    here any more". Redis before 7 wraps it in a script's error (``ERR Error running script …
    -READONLY …``), which redis-py does not recognize."""
    return isinstance(error, redis.exceptions.ReadOnlyError) or "-READONLY " in str(error)


class Broker(RedisBroker):
    """Dramatiq's Redis broker, whose ack is sent as one pre-packed ``EVALSHA`` of Dramatiq's own
    dispatch script: the same script, the same arguments, the same single round trip as
    ``RedisBroker.do_ack``, without redis-py's command path (argument encoding, retry wrapper,
    connection checks) and the closure Dramatiq builds for every ack. An ack is one per delivery,
    so that path's CPU counts (docs/decisions/hot-path-costs.md). A Redis that lost the script
    (a restart, SCRIPT FLUSH) gets it loaded again by Dramatiq's own path."""

    def do_ack(self, queue_name: str, message_id: str) -> Any:
        # Dramatiq's argument order: command, timestamp, queue, broker id, heartbeat timeout,
        # dead message TTL, maintenance flag, max unpack size, message id. All but the
        # timestamp, the flag and the id are fixed per queue: packed once.
        parts = self._ack_parts.get(queue_name)
        if parts is None:
            parts = self._ack_parts[queue_name] = self._pack_ack_parts(queue_name)
        head, middle, unpack = parts
        stamp = str(current_millis())
        flag = "1" if self._should_do_maintenance("ack") else "0"
        payload = (
            f"{head}${len(stamp)}\r\n{stamp}\r\n{middle}$1\r\n{flag}\r\n{unpack}"
            f"${len(message_id.encode())}\r\n{message_id}\r\n"
        ).encode()
        error = _send_packed(self.client, payload, 1)[0]
        if error is None:
            return None
        if isinstance(error, redis.exceptions.NoScriptError):
            try:
                return self._dispatch("ack")(queue_name, message_id)
            except redis.ResponseError as exc:
                # A replica lacks the script too: loaded, it is refused as a write.
                if _is_failover(exc):
                    raise redis.ConnectionError(f"Redis is not the primary any more ({exc})") from exc
                raise
        raise error

    @functools.cached_property
    def _ack_parts(self) -> dict[str, tuple[str, str, str]]:
        return {}

    def _pack_ack_parts(self, queue_name: str) -> tuple[str, str, str]:
        # 13 elements: EVALSHA, the script, 1 key, the namespace, then the 9 arguments.
        head = b"*13\r\n" + b"".join(
            _bulk(str(part)) for part in ("EVALSHA", self.scripts["dispatch"].sha, 1, self.namespace, "ack")
        )
        middle = b"".join(
            _bulk(str(v)) for v in (queue_name, self.broker_id, self.heartbeat_timeout, self.dead_message_ttl)
        )
        unpack = _bulk(str(self._max_unpack_size()))
        return head.decode(), middle.decode(), unpack.decode()


def publish_rows(client: redis.Redis, namespace: str, rows: Iterable[tuple[int, str, datetime]]) -> int:
    """Enqueue a message for each ``(row id, destination, dispatched_at)`` tuple, as the claim
    query returns them, in one round trip; returns how many messages were enqueued. Raises a
    ``redis`` error if any command failed, so that the caller rolls back and the rows stay
    ``pending``.

    This is the relay's hot path. redis-py's pipeline (``json.dumps`` of a dict per row, then
    redis-py packing three arguments per row) would be most of the relay's time; here each row is
    one f-string of Redis protocol built from a per-destination template, and the batch is sent
    as one buffer (docs/decisions/hot-path-costs.md). The bytes stored are exactly those of
    :func:`encode_message` (the tests compare them).
    """
    published = publish_group(client, namespace, rows)
    if published.failed:
        raise next(iter(published.failed.values()))
    return published.count


@dataclass
class Published:
    """What :func:`publish_group` did: messages enqueued, and the destinations whose commands
    Redis refused (with its error), none of whose messages stay in Redis."""

    count: int = 0
    failed: dict[str, redis.ResponseError] = field(default_factory=dict)


def publish_group(
    client: redis.Redis, namespace: str, rows: Iterable[tuple[int, str, datetime]]
) -> Published:
    """:func:`publish_rows`, destination by destination: a destination whose key Redis refuses
    (WRONGTYPE on a key somebody else created, say) is reported in ``failed`` instead of failing
    the batch, so that the caller still marks the other destinations' rows dispatched. What the
    refused destination's half-done commands left (its hash entries when only the RPUSH failed,
    its list entries when only the HSET did) is removed, best effort, before returning. A
    connection error still raises: then nothing is known about any destination."""
    payload, replies, count, queues = _pack(namespace, rows, int(time.time() * 1000))
    if not count:
        return Published()
    errors = _send_packed(client, payload, replies)
    failed: dict[str, redis.ResponseError] = {}
    for i, (destination, queue) in enumerate(queues.items()):
        error = errors[2 * i] or errors[2 * i + 1]
        if error is not None:
            failed[destination] = error
            count -= len(queue.ids)
    if failed:
        _remove_partial(client, namespace, {d: queues[d].mids for d in failed})
    return Published(count, failed)


def _remove_partial(client: redis.Redis, namespace: str, mids: dict[str, list[str]]) -> None:
    pipe = client.pipeline(transaction=False)
    for destination, ids in mids.items():
        key = queue_key(namespace, destination)
        pipe.hdel(f"{key}.msgs", *ids)
        for mid in ids:
            pipe.lrem(key, 1, mid)
    # The key Redis refused refuses these too; the others' results do not matter either.
    pipe.execute(raise_on_error=False)


class _Queue:
    """One destination of a batch: its message template and the protocol text built so far."""

    __slots__ = ("fields", "fixed", "head", "ids", "mids", "tail")

    def __init__(self, destination: str, timestamp_ms: int) -> None:
        # json.dumps escapes every non-ASCII character, so the message is pure ASCII and its
        # length in characters is its length in bytes, as the protocol needs.
        self.head = f'{{"queue_name":{json.dumps(destination)},"actor_name":{json.dumps(ACTOR_NAME)},"args":['
        self.tail = f'","message_timestamp":{timestamp_ms}}}'
        self.fixed = len(self.head) + len(_MSG_OPTIONS) + len(_MSG_ID) + len(self.tail)
        self.fields: list[str] = []  # HSET field/value pairs, already in protocol form
        self.ids: list[str] = []  # RPUSH elements, already in protocol form
        self.mids: list[str] = []  # the same ids, plain: to clean up after a refused command


_MSG_OPTIONS = '],"kwargs":{},"options":{"redis_message_id":"'
_MSG_ID = '"},"message_id":"'


def _bulk(value: str) -> bytes:
    raw = value.encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def _pack(
    namespace: str, rows: Iterable[tuple[int, str, datetime]], timestamp_ms: int
) -> tuple[bytes, int, int, dict[str, _Queue]]:
    """The Redis protocol for ``HSET ns:dest.msgs id msg …`` + ``RPUSH ns:dest id …`` per
    destination: (bytes to send, replies to read, messages, the queues in command order)."""
    queues: dict[str, _Queue] = {}
    suffixes: dict[datetime, str] = {}
    count = 0
    for row_id, destination, dispatched_at in rows:
        queue = queues.get(destination)
        if queue is None:
            queue = queues[destination] = _Queue(destination, timestamp_ms)
        suffix = suffixes.get(dispatched_at)
        if suffix is None:
            # One claim statement stamps every row with the same now(): computed once per batch.
            suffix = suffixes[dispatched_at] = f"-{dispatch_micros(dispatched_at)}"
        rid = str(row_id)
        mid = f"outbox-{rid}{suffix}"
        field = f"${len(mid)}\r\n{mid}\r\n"
        queue.fields.append(
            f"{field}${queue.fixed + len(rid) + 2 * len(mid)}\r\n"
            f"{queue.head}{rid}{_MSG_OPTIONS}{mid}{_MSG_ID}{mid}{queue.tail}\r\n"
        )
        queue.ids.append(field)
        queue.mids.append(mid)
        count += 1
    parts: list[bytes] = []
    for destination, queue in queues.items():
        key = queue_key(namespace, destination)
        n = len(queue.ids)
        parts += (b"*%d\r\n$4\r\nHSET\r\n" % (2 + 2 * n), _bulk(f"{key}.msgs"))
        parts.append("".join(queue.fields).encode("ascii"))
        parts += (b"*%d\r\n$5\r\nRPUSH\r\n" % (2 + n), _bulk(key))
        parts.append("".join(queue.ids).encode("ascii"))
    return b"".join(parts), 2 * len(queues), count, queues


def _send_packed(client: redis.Redis, payload: bytes, replies: int) -> list[redis.ResponseError | None]:
    """Send pre-packed commands on a pooled connection and read every reply, as redis-py's
    pipeline does (same retry policy, connection dropped on a transport error); returns each
    reply's error (None: it succeeded), read to the last one so that the socket never desyncs.

    A failover is never a reply: a primary that answers READONLY (demoted) raises a
    ``redis.ConnectionError``, as does one answering LOADING or gone. Through Sentinel the
    commands are then sent once more on a new connection, which asks the sentinels where the
    primary is now; when they do not know yet, the error is the caller's, as an outage."""
    pool = client.connection_pool
    again = True
    while True:
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.3 requires a command name, which its pools ignore
            conn = pool.get_connection("HSET")

        def send(conn: Any = conn) -> list[redis.ResponseError | None]:
            conn.send_packed_command([payload])
            errors: list[redis.ResponseError | None] = []
            failover: redis.ResponseError | None = None
            for _ in range(replies):
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    errors.append(exc)
                    if _is_failover(exc):
                        failover = exc
                else:
                    errors.append(None)
            if failover is not None:
                raise redis.ConnectionError(f"Redis is not the primary any more ({failover})") from failover
            return errors

        try:
            result: list[redis.ResponseError | None] = conn.retry.call_with_retry(
                send, lambda _exc, conn=conn: conn.disconnect()
            )
        except redis.ConnectionError:
            conn.disconnect()
            if again and isinstance(pool, redis.sentinel.SentinelConnectionPool):
                again = False
                continue
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return result


def messages_present(
    client: redis.Redis, namespace: str, candidates: Iterable[tuple[str, str]]
) -> list[bool]:
    """For each (destination, message id): is the message still held by Redis (queued or
    fetched-but-unacked)? One pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    count = 0
    for destination, mid in candidates:
        pipe.hexists(f"{queue_key(namespace, destination)}.msgs", mid)
        count += 1
    if not count:
        return []
    return [bool(x) for x in pipe.execute()]


#: Queue entries a whereabouts check reads at most per destination and run; past it, a message
#: not seen yet is taken to be waiting (never re-published on a guess).
MAX_QUEUE_SCAN = 100_000
_SCAN_CHUNK = 1000


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


#: Dramatiq's ``DEFAULT_HEARTBEAT_TIMEOUT``: a worker whose last Redis command is older than this
#: is dead to Dramatiq too (its maintenance then gives the worker's fetched messages back).
DRAMATIQ_HEARTBEAT_TIMEOUT_MS = 60_000


def broker_workers(client: redis.Redis, namespace: str) -> dict[str, bool]:
    """Dramatiq's worker ids in ``ns:__heartbeats__``, each with whether it is alive: every
    broker that ever fetched stays there until Dramatiq's maintenance forgets a dead one, which
    it does only once its ack sets are gone. The score is the worker's clock at its last command
    (a consumer polls every second or so while it can take work); it is compared with Redis's
    clock, a skew far below the 60 s timeout."""
    members: list[tuple[bytes, float]] = client.zrange(  # type: ignore[assignment]
        f"{namespace}:__heartbeats__", 0, -1, withscores=True
    )
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return {_text(w): now_ms - score < DRAMATIQ_HEARTBEAT_TIMEOUT_MS for w, score in members}


def fetched_ids(
    client: redis.Redis, namespace: str, destinations: Iterable[str], workers: Iterable[str]
) -> dict[str, dict[str, str]]:
    """Per destination, the message ids a worker fetched and has not acked, each with that
    worker: the members of Dramatiq's ack sets ``ns:__acks__.<worker>.<queue>`` (a fetch moves
    an id from the queue list to its worker's ack set; an ack or nack removes it and the
    message)."""
    names, ids = list(destinations), list(workers)
    pipe = client.pipeline(transaction=False)
    for d in names:
        for w in ids:
            pipe.smembers(f"{namespace}:__acks__.{w}.{d}")
    replies = iter(pipe.execute()) if names and ids else iter(())
    found: dict[str, dict[str, str]] = {d: {} for d in names}
    for d in names:
        for w in ids:
            found[d].update((_text(m), w) for m in next(replies))
    return found


def queued_ids(
    client: redis.Redis, namespace: str, destination: str, wanted: set[str], max_scan: int = MAX_QUEUE_SCAN
) -> tuple[set[str], set[str]]:
    """Which of ``wanted`` wait in the destination's queue list: (found, certainly absent).
    Read from the head, where the oldest messages are, stopping as soon as all are found, so a
    check of a healthy backlog's oldest messages reads about as many entries as it asks about.
    The chunks are not one snapshot (workers pop the head meanwhile), so an id not seen is only
    called absent once LPOS, which is atomic, says so too; past ``max_scan`` entries, the rest
    are neither."""
    key = queue_key(namespace, destination)
    found: set[str] = set()
    start = 0
    while start < max_scan:
        chunk = client.lrange(key, start, start + _SCAN_CHUNK - 1)
        found.update(m for m in (_text(x) for x in chunk) if m in wanted)
        if len(found) == len(wanted):
            return found, set()
        if len(chunk) < _SCAN_CHUNK:
            break
        start += _SCAN_CHUNK
    else:
        return found, set()
    unseen = sorted(wanted - found)
    pipe = client.pipeline(transaction=False)
    for mid in unseen:
        pipe.lpos(key, mid)
    positions = pipe.execute()
    found.update(mid for mid, pos in zip(unseen, positions, strict=True) if pos is not None)
    return found, {mid for mid, pos in zip(unseen, positions, strict=True) if pos is None}


def remove_messages(
    client: redis.Redis, namespace: str, destination: str, mids: list[str], workers: Iterable[str]
) -> None:
    """Take messages out of Redis for good, atomically (MULTI): the body first, so that neither
    Dramatiq's dead-worker maintenance nor a worker's requeue puts the id back (both check the
    body exists), then the id from the queue list and from every worker's ack set."""
    if not mids:
        return
    key = queue_key(namespace, destination)
    pipe = client.pipeline(transaction=True)
    pipe.hdel(f"{key}.msgs", *mids)
    for mid in mids:
        pipe.lrem(key, 0, mid)
    for w in workers:
        pipe.srem(f"{namespace}:__acks__.{w}.{destination}", *mids)
    pipe.execute()


def queue_lengths(client: redis.Redis, namespace: str, destinations: Iterable[str]) -> dict[str, int]:
    names = list(destinations)
    pipe = client.pipeline(transaction=False)
    for d in names:
        pipe.llen(queue_key(namespace, d))
    return dict(zip(names, (int(x) for x in pipe.execute()), strict=True))


def check_broker_safety(client: redis.Redis, namespace: str, *, allow_evicting: bool = False) -> list[str]:
    """Problems that could make Redis drop queued messages. Empty list: safe.

    ``maxmemory-policy`` is read from ``INFO memory`` because managed Redis often disables
    ``CONFIG``.
    """
    problems: list[str] = []
    memory = client.info("memory")
    maxmemory = int(memory.get("maxmemory", 0) or 0)
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if maxmemory and policy.startswith("allkeys-") and not allow_evicting:
        problems.append(
            f"Redis maxmemory-policy is {policy} with maxmemory={maxmemory}: it may evict queued "
            "messages; set maxmemory-policy noeviction (or volatile-*), or pass "
            "OUTBOX_ALLOW_EVICTING_REDIS=true if you accept delays"
        )
    if not namespace:
        problems.append("the broker namespace is empty; set OUTBOX_NAMESPACE")
    foreign = foreign_keys(client, namespace)
    if foreign:
        problems.append(
            f"the Redis namespace {namespace!r} holds keys Dramatiq does not write "
            f"(e.g. {', '.join(sorted(foreign)[:3])}): it looks shared with a cache or sessions; "
            "set OUTBOX_NAMESPACE to a prefix of its own"
        )
    return problems


def delete_namespace(client: redis.Redis, namespace: str) -> int:
    """Delete every key under ``namespace:`` in the client's database, and nothing else; for
    tests, benchmarks and the demo, never for a namespace a deployment is using."""
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    for i in range(0, len(keys), 1000):
        client.unlink(*keys[i : i + 1000])
    return len(keys)


def foreign_keys(client: redis.Redis, namespace: str, limit: int = 1000) -> list[str]:
    """Keys under ``namespace:`` of a type Dramatiq never writes (caches and sessions are
    strings); only the first ``limit`` keys are looked at, to stay cheap at start-up."""
    found: list[str] = []
    for seen, raw in enumerate(client.scan_iter(match=f"{namespace}:*", count=500)):
        if seen >= limit:
            break
        kind = client.type(raw)
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind not in ("list", "hash", "set", "zset", "none"):
            found.append(raw.decode() if isinstance(raw, bytes) else str(raw))
    return found


def ensure_safe(client: redis.Redis, namespace: str, *, allow_evicting: bool = False) -> None:
    problems = check_broker_safety(client, namespace, allow_evicting=allow_evicting)
    if problems:
        raise UnsafeBroker("; ".join(problems))


def check_at_start(url: str, namespace: str, *, allow_evicting: bool = False) -> None:
    """The start-up check of every long-running process: :func:`ensure_safe` on a short-lived
    connection. Through Sentinel, the same check runs again on each primary a failover
    promotes, before this process's connections use it (:class:`UnsafePrimary`)."""
    global _primary_policy
    client = connect(url, socket_connect_timeout=5)
    try:
        ensure_safe(client, namespace, allow_evicting=allow_evicting)
    finally:
        client.close()
    _primary_policy = (namespace, allow_evicting)
