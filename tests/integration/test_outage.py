"""A provider outage, end to end (issue 13): the provider answers 503 to every charge for 30 s,
then recovers, while a Dramatiq worker (4 threads), the relay and the reconciler's re-dispatch
run. With the destination's breaker, no row ends `failed`, the provider sees a bounded number
of calls during the outage, and every row is charged exactly once after it; with the breaker
off, the same run shows what users got before it: every row spends its attempts on the 503s and
ends `failed`. Each run prints its figures (pytest -s shows them). Real PostgreSQL, Redis and
the provider simulator on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from helpers import relay_once, wait_for, worker_thread

import outbox
from outbox.handlers import registry
from outbox.reconciler.jobs.redispatch import redispatch

from .reconciler.support import DEST, write_rows

OUTAGE_SECONDS = 30.0
ROWS = 40
THREADS = 4
BREAKER = outbox.Breaker(failures=5, window_seconds=30, open_seconds=2, max_open_seconds=8)

pytestmark = pytest.mark.timeout(150)


def states(db: Any) -> dict[str, int]:
    return dict(db.execute("SELECT state, count(*) FROM outbox_message GROUP BY state").fetchall())


@contextmanager
def relay_and_reconciler(services: Any, db: Any, redis_client: Any) -> Iterator[None]:
    """The relay and the reconciler's re-dispatch, every 0.2 s, in a thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            relay_once(services)
            redispatch(
                db,
                redis_client,
                registry(),
                namespace=services.namespace,
                redispatch_after_seconds=300,
                grace_seconds=0.5,
            )
            stop.wait(0.2)

    thread = threading.Thread(target=loop, name="relay-and-reconciler", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.stress
@pytest.mark.parametrize("with_breaker", [True, False], ids=["breaker", "no-breaker"])
def test_a_30_second_outage(clean, engine, provider, redis_client, with_breaker):
    import psycopg

    from outbox.settings import libpq_url

    @outbox.handler(
        DEST, time_limit=5, max_attempts=3, backoff=(1, 2), breaker=BREAKER if with_breaker else None
    )
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    provider.unavailable()
    write_rows(engine, ROWS)
    started = time.monotonic()
    recovered = threading.Timer(OUTAGE_SECONDS, provider.healthy)
    with (
        psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db,
        psycopg.connect(libpq_url(clean.database_url), autocommit=True) as loop_db,
        worker_thread(clean, threads=THREADS),
        relay_and_reconciler(clean, loop_db, redis_client),
    ):
        recovered.start()
        try:
            if with_breaker:
                wait_for(lambda: states(db) == {"sent": ROWS}, 100, "every row sent after the outage")
            else:
                wait_for(lambda: states(db) == {"failed": ROWS}, 60, "every row to fail")
        finally:
            recovered.cancel()
        elapsed = time.monotonic() - started
        stats = provider.stats()
        during = stats["faults"]["fail_before"]
        spent = db.execute("SELECT sum(attempts), max(attempts) FROM outbox_message").fetchone()
        trips = db.execute(
            "SELECT coalesce(sum(breaker_trips), 0), coalesce(sum(breaker_probes), 0) FROM outbox_destination"
        ).fetchone()
    print(
        f"\n{'breaker' if with_breaker else 'no breaker'}: {ROWS} rows, {OUTAGE_SECONDS:g} s of 503s, "
        f"{THREADS} worker threads: {during} calls answered 503 during the outage, "
        f"{stats['charges']} charges, final states {states_text(with_breaker)}, attempts spent "
        f"{spent[0]} (max {spent[1]} a row), breaker trips {trips[0]}, probes {trips[1]}, "
        f"done after {elapsed:.1f} s"
    )
    if with_breaker:
        # Tripping takes `failures` answers, plus the calls already under way on the other
        # threads; then one probe per open period (2, 4, 8, 8, … s).
        bound = BREAKER.failures + THREADS + int(OUTAGE_SECONDS / BREAKER.open_seconds) + 1
        assert during <= bound, f"{during} calls during the outage, bound {bound}"
        assert stats["charges"] == ROWS and stats["double_charged"] == []
        assert all(provider.charges(f"order:{i}:charge") == 1 for i in range(ROWS))
        assert spent[1] <= 2, "a row spends at most the attempt that tripped the breaker and its success"
    else:
        assert during == ROWS * 3, "every row spent its three attempts on the 503s"
        assert stats["charges"] == 0


def states_text(with_breaker: bool) -> str:
    return f"{ROWS} sent, 0 failed" if with_breaker else f"{ROWS} failed"
