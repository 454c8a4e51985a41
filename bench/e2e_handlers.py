"""The outbox side of ``bench/e2e.py``: the handler a user would write for a card charge.

Run by ``python -m outbox worker bench.e2e_handlers --processes 2 --concurrency 8``. The provider's
address comes from ``BENCH_PROVIDER_URL``.

With ``BENCH_COUNT_ROUND_TRIPS=/some/dir`` each worker process also counts, on the client side,
the statements it sends to PostgreSQL (``psycopg.Cursor.execute``: one extended-protocol flight,
one round trip, each a commit on these autocommit connections) and the requests it writes to
Redis (``redis.Connection.send_packed_command``: one per command or per pipeline), and writes
them to ``DIR/<pid>.json`` when it exits. The counting is a few integer increments per call.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections import Counter
from typing import Any

import outbox
from outbox import Confirmed, Delivery, PermanentError

PROVIDER_URL = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8099")
CHARGES_URL = f"{PROVIDER_URL}/charges"


def charge(d: Delivery) -> Confirmed:
    r = d.http.post(CHARGES_URL, json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
    return _confirmed(r)


async def charge_async(d: Delivery) -> Confirmed:
    r = await d.http.post(CHARGES_URL, json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
    return _confirmed(r)


def _confirmed(r: Any) -> Confirmed:
    if r.status_code == 402:
        raise PermanentError("card declined")
    r.raise_for_status()
    body = r.json()
    return Confirmed(ref=body["id"], response={"id": body["id"], "status": body.get("status")})


# BENCH_TIME_LIMIT: only for running a worker under valgrind, where the first calls are slow.
# BENCH_ASYNC_HANDLER=1: the async def twin (bench/e2e.py --async-handler).
payments_charge = outbox.handler(
    "payments.charge",
    time_limit=float(os.environ.get("BENCH_TIME_LIMIT", "10")),
    max_attempts=5,
    backoff=(1, 5, 30),
)(charge_async if os.environ.get("BENCH_ASYNC_HANDLER") == "1" else charge)


def _install_counters(directory: str) -> None:
    import psycopg
    import redis.connection

    counts: Counter[str] = Counter()
    lock = threading.Lock()

    original_execute = psycopg.Cursor.execute

    def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
        text = query if isinstance(query, str) else str(query)
        head = text.lstrip().split(None, 1)[0].upper() if text.strip() else "?"
        if "outbox_attempt" in text and "claim_token" in text and "INSERT INTO" in text:
            name = "pg.claim"
        elif "superseded" in text:
            name = "pg.record"
        else:
            name = f"pg.other.{head}"
        with lock:
            counts[name] += 1
        return original_execute(self, query, params, **kwargs)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]

    original_send = redis.connection.AbstractConnection.send_packed_command

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        with lock:
            counts["redis.requests"] += 1
        return original_send(self, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]

    original_command = redis.client.Redis.execute_command

    def execute_command(self, *args, **options):  # type: ignore[no-untyped-def]
        name = args[0] if args else "?"
        if isinstance(name, bytes):
            name = name.decode()
        with lock:
            counts[f"redis.cmd.{str(name).upper()}"] += 1
        return original_command(self, *args, **options)

    redis.client.Redis.execute_command = execute_command  # type: ignore[method-assign]

    def dump() -> None:
        path = os.path.join(directory, f"{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dict(counts), f)

    atexit.register(dump)


if os.environ.get("BENCH_COUNT_ROUND_TRIPS"):
    _install_counters(os.environ["BENCH_COUNT_ROUND_TRIPS"])
