"""The transport: Dramatiq messages on Redis. Nothing here knows about SQL or handlers.

A message carries only the row id; the payload stays in the database, which is the source of
truth. The relay writes Dramatiq's documented Redis layout directly (``HSET ns:queue.msgs`` +
``RPUSH ns:queue``, exactly what Dramatiq's own ``enqueue`` does in Lua) so that a whole batch
costs one pipelined round trip instead of one EVALSHA per message.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import redis

from .exceptions import UnsafeBroker

logger = logging.getLogger(__name__)

#: The one actor every outbox message is addressed to; the queue names the destination.
ACTOR_NAME = "outbox_deliver"


@dataclass(frozen=True)
class Publication:
    row_id: int
    destination: str
    dispatched_at: datetime


def message_id(row_id: int, dispatched_at: datetime) -> str:
    """Deterministic per (row, dispatch), so the reconciler can ask Redis whether it still waits."""
    return f"outbox-{row_id}-{int(dispatched_at.timestamp() * 1_000_000)}"


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
    return redis.Redis.from_url(url, **options)  # type: ignore[arg-type]


def publish(client: redis.Redis, namespace: str, publications: Sequence[Publication]) -> None:
    """Enqueue every publication in one pipelined round trip.

    Raises a ``redis`` error if any command failed, so that the caller rolls back and the rows
    stay ``pending``.
    """
    if not publications:
        return
    now_ms = int(time.time() * 1000)
    by_queue: dict[str, tuple[dict[str, bytes], list[str]]] = defaultdict(lambda: ({}, []))
    for p in publications:
        mid = message_id(p.row_id, p.dispatched_at)
        messages, ids = by_queue[p.destination]
        messages[mid] = encode_message(p.row_id, p.destination, mid, now_ms)
        ids.append(mid)
    pipe = client.pipeline(transaction=False)
    for destination, (messages, ids) in by_queue.items():
        key = queue_key(namespace, destination)
        pipe.hset(f"{key}.msgs", mapping=messages)  # type: ignore[arg-type]
        pipe.rpush(key, *ids)
    for result in pipe.execute(raise_on_error=True):
        if isinstance(result, Exception):  # pragma: no cover - raise_on_error raises first
            raise result


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
            "--allow-evicting-redis / OUTBOX_ALLOW_EVICTING_REDIS=true if you accept delays"
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
