"""A worker that cannot reach PostgreSQL stops fetching and hands the messages it fetched, and
could not claim, back to their queue (requeued, not acked), for any worker that reaches the
database; it says so once (a WARNING), asks the database every second, and resumes fetching when
it answers (an INFO). Here the worker's connections go through a TCP forwarder the test cuts: every
connection through it closed, every new one refused. (Packets silently dropped, the realistic cut,
is tests/acceptance/test_host_cut_off.py.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers import (
    Forwarder,
    destination_states,
    relay_once,
    sql,
    unacked,
    wait_for,
    worker_thread,
    write_rows,
)

import outbox
from outbox import metrics
from outbox.consumer import LOST_CLAIM_UNREACHABLE_SECONDS

DEST = "payments.charge"


@pytest.fixture
def forwarder(clean: Any) -> Iterator[Forwarder]:
    if not Forwarder.possible(clean.database_url):
        pytest.skip("the test PostgreSQL is reached over a Unix socket here: no TCP to cut")
    f = Forwarder(clean.database_url)
    yield f
    f.close()


def queued(services: Any) -> int:
    client = redis.Redis.from_url(services.redis_url)
    try:
        return int(client.llen(f"{services.namespace}:{DEST}"))
    finally:
        client.close()


def unreachable_runs() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "outbox_deliveries_total", {"destination": DEST, "outcome": "unreachable"}
    )
    return value or 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_cut_off_from_postgres_hands_its_messages_back_and_resumes(
    clean, engine, provider, forwarder, caplog, kind
):
    caplog.set_level(logging.INFO, logger="outbox.runner")
    if kind == "async":

        @outbox.handler(DEST, time_limit=5, backoff=(1,))
        async def charge(d: outbox.Delivery) -> outbox.Confirmed:
            r = await d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            return outbox.Confirmed(ref=r.json()["id"])
    else:

        @outbox.handler(DEST, time_limit=5, backoff=(1,))
        def charge(d: outbox.Delivery) -> outbox.Confirmed:
            r = d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            return outbox.Confirmed(ref=r.json()["id"])

    services = type(clean)(forwarder.url, clean.redis_url, clean.namespace)
    with worker_thread(services, threads=4):
        # Up and delivering through the forwarder first: its connections are open when the cut comes.
        write_rows(engine, DEST, 1)
        assert relay_once(clean) == 1
        wait_for(lambda: destination_states(clean, DEST) == {"sent": 1}, 30, "the first row sent")
        assert forwarder.connections > 0

        forwarder.cut()
        before = unreachable_runs()
        write_rows(engine, DEST, 11)  # ten more rows: the first key is written already
        assert relay_once(clean) == 10
        # Fetched, not claimed, handed back: all ten wait in the queue again, none fetched. A
        # claim sent on a connection the cut broke may have committed: its delivery tries to
        # settle it for LOST_CLAIM_UNREACHABLE_SECONDS before it hands its message back too.
        wait_for(lambda: unreachable_runs() > before, 30, "a delivery that could not reach PostgreSQL")
        wait_for(
            lambda: queued(clean) == 10 and unacked(clean, DEST) == 0,
            LOST_CLAIM_UNREACHABLE_SECONDS + 20,
            "the messages handed back",
        )
        handed_back = unreachable_runs() - before
        # And it stays so: no fetch while the database does not answer (each would be one more
        # unreachable run), so the messages wait for a worker that reaches it.
        time.sleep(2.5)
        assert unreachable_runs() - before == handed_back
        assert (queued(clean), unacked(clean, DEST)) == (10, 0)
        assert handed_back <= 4, "no more fetched than the worker had slots"
        assert destination_states(clean, DEST) == {"sent": 1, "dispatched": 10}
        assert sql(clean, "SELECT count(*) FROM outbox_attempt") == [(1,)], "no claim was made"
        stopped = [r for r in caplog.records if "cannot reach PostgreSQL: stopped fetching" in r.getMessage()]
        assert [r.levelno for r in stopped] == [logging.WARNING]

        forwarder.restore()
        wait_for(lambda: destination_states(clean, DEST) == {"sent": 11}, 60, "every row sent once back")
        resumed = [
            r for r in caplog.records if "reaches PostgreSQL again: fetching resumed" in r.getMessage()
        ]
        assert [r.levelno for r in resumed] == [logging.INFO]
    stats = provider.stats()
    assert stats["double_charged"] == [] and stats["charges"] == 11


def test_a_worker_that_reconnects_again_and_again_keeps_only_the_connections_it_holds(clean, consumer):
    deliverer = consumer()
    for _ in range(50):
        # As the probe does while the database does not answer: idle connections closed, a new
        # claim connection opened and given back.
        assert deliverer.database_answers()
    held = [c for c in deliverer._all if not c.closed]
    assert len(held) <= 2, len(held)
    assert len(deliverer._all) <= 3, len(deliverer._all)
