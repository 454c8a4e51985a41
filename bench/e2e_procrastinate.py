"""The procrastinate side of ``bench/e2e.py``: what a user would write instead of the outbox.

The job is deferred inside the business transaction (``task.configure(connection=…)``, which
procrastinate 3 documents for ``SyncPsycopgConnector``/``PsycopgConnector``: the INSERT runs on
the caller's connection and the caller commits), and the task makes the same HTTP call to the
same provider with the same Idempotency-Key as ``bench/e2e_handlers.py``.

Two flavours of the task, both registered (``BENCH_PROCRASTINATE_TASK`` picks the one
``bench/e2e.py`` defers to):

* ``charge_async``: an ``async def`` task sharing one ``httpx.AsyncClient`` per worker process,
  the natural procrastinate 3 code (its worker is an asyncio loop);
* ``charge_sync``: a plain ``def`` task with a per-thread ``httpx.Client`` (procrastinate runs
  sync tasks in threads).

Workers: ``procrastinate --app=bench.e2e_procrastinate.app worker --concurrency 8 -q charges``
(the connection comes from ``BENCH_PROCRASTINATE_DSN``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
from collections import Counter
from typing import Any

import httpx
import procrastinate

PROVIDER_URL = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8099")
CHARGES_URL = f"{PROVIDER_URL}/charges"
DSN = os.environ.get(
    "BENCH_PROCRASTINATE_DSN", "postgresql://postgres@127.0.0.1:5432/bench_e2e_procrastinate"
)

# The worker runs on the async connector. The business transaction in bench/e2e.py defers with
# ``charge_sync.configure(connection=<its psycopg connection>).defer(...)``: procrastinate then
# runs its INSERT through the connector's sync twin on that connection, never on a pool.
# httpx logs every request at INFO; the outbox worker turns that off for its users, and so
# would a procrastinate user with 20k calls (procrastinate's own two lines per job remain).
logging.getLogger("httpx").setLevel(logging.WARNING)

# The pool keeps psycopg_pool's default size (4): a pool of concurrency + 2 (10) cost more CPU per
# job here (workers 4.5 vs 3.9-4.2 ms, backends 1.7 vs 1.4 ms, two runs each).
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))

_TIMEOUT = httpx.Timeout(connect=2.0, write=2.0, read=5.5, pool=0.5)
_async_client: httpx.AsyncClient | None = None
_local = threading.local()


class Declined(Exception):
    pass


def _ref(r: httpx.Response) -> dict[str, Any]:
    if r.status_code == 402:
        raise Declined("card declined")
    r.raise_for_status()
    body = r.json()
    return {"id": body["id"], "status": body.get("status")}


@app.task(name="charge_async", queue="charges")
async def charge_async(order_id: int, key: str, amount_cents: int, currency: str) -> dict[str, Any]:
    global _async_client
    if _async_client is None:
        # Limits above the concurrency (the issue-32 comparison runs 200 at once).
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        _async_client = httpx.AsyncClient(timeout=_TIMEOUT, limits=limits)
    r = await _async_client.post(
        CHARGES_URL,
        json={"amount_cents": amount_cents, "currency": currency},
        headers={"Idempotency-Key": key},
    )
    return _ref(r)


@app.task(name="charge_sync", queue="charges")
def charge_sync(order_id: int, key: str, amount_cents: int, currency: str) -> dict[str, Any]:
    client: httpx.Client | None = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(timeout=_TIMEOUT)
    r = client.post(
        CHARGES_URL,
        json={"amount_cents": amount_cents, "currency": currency},
        headers={"Idempotency-Key": key},
    )
    return _ref(r)


def _install_counters(directory: str) -> None:
    """Like bench/e2e_handlers.py: count this worker's statements (one round trip each, each a
    commit on procrastinate's autocommit pool) by the procrastinate function they call, and
    write them to DIR/<pid>.json at exit."""
    import psycopg

    counts: Counter[str] = Counter()
    lock = threading.Lock()
    name_re = re.compile(r"(procrastinate_\w+)")

    def name_of(query: Any) -> str:
        text = query if isinstance(query, str) else str(query)
        if not text.strip():
            return "pg.pool_check_connection (empty query on each pool checkout)"
        m = name_re.search(text)
        return f"pg.{m.group(1)}" if m else "pg.other." + (text.strip().split(None, 1) or ["?"])[0].upper()

    original_async = psycopg.AsyncCursor.execute

    async def execute_async(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            counts[name_of(query)] += 1
        return await original_async(self, query, params, **kwargs)

    psycopg.AsyncCursor.execute = execute_async  # type: ignore[method-assign]

    original_sync = psycopg.Cursor.execute

    def execute_sync(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            counts[name_of(query)] += 1
        return original_sync(self, query, params, **kwargs)

    psycopg.Cursor.execute = execute_sync  # type: ignore[method-assign]

    def dump() -> None:
        with open(os.path.join(directory, f"{os.getpid()}.json"), "w", encoding="utf-8") as f:
            json.dump(dict(counts), f)

    atexit.register(dump)


if os.environ.get("BENCH_COUNT_ROUND_TRIPS"):
    _install_counters(os.environ["BENCH_COUNT_ROUND_TRIPS"])
