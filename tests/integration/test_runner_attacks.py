"""The attack on the worker's own loop (outbox/runner.py), kept as tests: an ack that fails for
a reason other than a lost connection, or that a middleware refuses, killed a delivery thread
and the worker stalled; twelve rows locked by the application held every database thread of
async deliveries; a Redis outage at the ack held them too, so finished calls went unrecorded
past their leases. And a stop with async calls in flight finishes them."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest
import redis
from dramatiq.middleware import Middleware, SkipMessage
from helpers import destination_states, relay_once, unacked, wait_for, worker_thread, write_rows

import outbox
from outbox import middleware as mw
from outbox import transport
from outbox.settings import libpq_url


def delivery_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("outbox-delivery-") and t.is_alive())


# --- A: an ack error that is not a connection error kills a sync delivery thread ---------------


class RaiseBeforeAck(Middleware):
    def __init__(self, times: int) -> None:
        self.left = times
        self.lock = threading.Lock()

    def before_ack(self, broker: Any, message: Any) -> None:
        with self.lock:
            if self.left > 0:
                self.left -= 1
                raise SkipMessage("middleware refuses the ack")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("trigger", ["readonly_ack", "middleware_before_ack"])
def test_an_ack_that_fails_or_is_refused_stalls_no_delivery_thread(
    clean, engine, provider, monkeypatch, trigger
):
    calls = []

    @outbox.handler("payments.charge", time_limit=2, backoff=(1,))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        calls.append(d.id)
        return outbox.Confirmed(ref=r.json()["id"])

    if trigger == "readonly_ack":
        left = [2]
        real = transport.Broker.do_ack

        def do_ack(self: Any, queue_name: str, message_id: str) -> Any:
            if left[0] > 0:
                left[0] -= 1
                # what a non-Sentinel client gets from a demoted master (failover) or OOM
                raise redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
            return real(self, queue_name, message_id)

        monkeypatch.setattr(transport.Broker, "do_ack", do_ack)
    else:
        saved = mw.added()
        mw.worker_middleware(RaiseBeforeAck(2))

    write_rows(engine, "payments.charge", 10)
    assert relay_once(clean) == 10
    try:
        with worker_thread(clean, threads=2):
            wait_for(
                lambda: destination_states(clean, "payments.charge") == {"sent": 10}, 30, "every row sent"
            )
            assert delivery_threads() == 2
    finally:
        if trigger != "readonly_ack":
            mw.restore(saved)
    assert provider.charges() == 10


# --- B: Redis down at ack time (async): records of finished calls wait behind acks -----------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_redis_outage_at_the_ack_holds_no_record(clean, engine, provider, monkeypatch, kind):
    outage = threading.Event()
    outage.set()
    real = transport.Broker.do_ack

    def do_ack(self: Any, queue_name: str, message_id: str) -> Any:
        if outage.is_set():
            raise redis.exceptions.ConnectionError("Connection refused (Redis restarting)")
        return real(self, queue_name, message_id)

    monkeypatch.setattr(transport.Broker, "do_ack", do_ack)
    calls: list[int] = []

    if kind == "async":

        @outbox.handler("payments.charge", time_limit=10, lease_seconds=30, backoff=(1,))
        async def charge(d: outbox.Delivery) -> outbox.Confirmed:
            r = await d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            calls.append(d.id)
            return outbox.Confirmed(ref=r.json()["id"])
    else:

        @outbox.handler("payments.charge", time_limit=10, lease_seconds=30, backoff=(1,))
        def charge(d: outbox.Delivery) -> outbox.Confirmed:
            r = d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            calls.append(d.id)
            return outbox.Confirmed(ref=r.json()["id"])

    write_rows(engine, "payments.charge", 30)
    assert relay_once(clean) == 30
    with worker_thread(clean, threads=32):
        # Every call made and recorded while Redis refuses every ack: no record waits on one.
        wait_for(
            lambda: destination_states(clean, "payments.charge") == {"sent": 30}, 60, "every row recorded"
        )
        assert unacked(clean, "payments.charge") == 30
        outage.clear()
        wait_for(lambda: unacked(clean, "payments.charge") == 0, 30, "the acks sent once Redis is back")
    assert provider.charges() == 30 and provider.stats()["double_charged"] == []


# --- C: rows locked by the application stop every async delivery -----------------------------


@pytest.mark.timeout(120)
def test_rows_locked_by_the_application_hold_no_database_thread_of_async_deliveries(clean, engine, provider):
    for destination in ("payments.charge", "mail.send"):

        @outbox.handler(destination, time_limit=2, backoff=(1,))
        async def send(d: outbox.Delivery) -> outbox.Confirmed:
            r = await d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            return outbox.Confirmed(ref=r.json()["id"])

    write_rows(engine, "payments.charge", 12)
    relay_once(clean)
    locker = psycopg.connect(libpq_url(clean.database_url))
    try:
        locked = locker.execute(
            "SELECT id FROM outbox_message WHERE destination = 'payments.charge' FOR UPDATE"
        ).fetchall()
        assert len(locked) == 12
        with worker_thread(clean, threads=32):
            time.sleep(2)
            write_rows(engine, "mail.send", 20)
            relay_once(clean)
            wait_for(
                lambda: destination_states(clean, "mail.send") == {"sent": 20}, 15, "the unlocked rows sent"
            )
            assert destination_states(clean, "payments.charge") == {"dispatched": 12}
            locker.rollback()
            wait_for(
                lambda: destination_states(clean, "payments.charge") == {"sent": 12},
                30,
                "the locked rows sent",
            )
    finally:
        locker.close()


# --- D: SIGTERM-like stop with async calls in flight ----------------------------------------


@pytest.mark.timeout(120)
def test_a_stop_with_async_calls_in_flight_finishes_them(clean, engine, provider):
    started = []

    @outbox.handler("payments.charge", time_limit=5, backoff=(1,))
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        started.append(d.id)
        await asyncio.sleep(2)
        r = await d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    write_rows(engine, "payments.charge", 60)
    relay_once(clean)
    t0 = time.monotonic()
    with worker_thread(clean, threads=20) as th:
        wait_for(lambda: len(started) >= 20, 30, "calls in flight")
    took = time.monotonic() - t0
    st = destination_states(clean, "payments.charge")
    client = redis.Redis.from_url(clean.redis_url)
    qlen = client.llen(f"{clean.namespace}:payments.charge")
    assert took < 15
    assert not th.is_alive()
    assert st.get("in_flight", 0) == 0 and st.get("sent", 0) == len(started)
    assert qlen + unacked(clean, "payments.charge") == 60 - len(started)


@pytest.mark.timeout(120)
def test_records_refused_by_row_locks_hold_no_database_thread(clean, engine, provider):
    """Fourteen async calls answer while the application holds their rows locked: their records
    wait for the locks as paused tasks, and the other destination's rows are all delivered
    meanwhile (a record's lock wait used to sleep on one of the twelve database threads)."""
    answer = asyncio.Event()
    in_call: list[int] = []

    @outbox.handler("payments.charge", time_limit=20, backoff=(1,))
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        in_call.append(d.id)
        await asyncio.wait_for(answer.wait(), 20)
        return outbox.Confirmed(ref=f"ch_{d.id}")

    @outbox.handler("mail.send", time_limit=5, backoff=(1,))
    async def send(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"m_{d.id}")

    write_rows(engine, "payments.charge", 14)
    relay_once(clean)
    locker = psycopg.connect(libpq_url(clean.database_url))

    def answer_all() -> None:
        from outbox import aio

        aio.loop().call_soon_threadsafe(answer.set)

    try:
        with worker_thread(clean, threads=32):
            wait_for(lambda: len(in_call) == 14, 30, "fourteen calls in flight")
            locked = locker.execute(
                "SELECT id FROM outbox_message WHERE destination = 'payments.charge' FOR UPDATE"
            ).fetchall()
            assert len(locked) == 14
            answer_all()
            time.sleep(1.0)  # the records meet the locks
            write_rows(engine, "mail.send", 20)
            relay_once(clean)
            wait_for(
                lambda: destination_states(clean, "mail.send") == {"sent": 20}, 15, "the other rows sent"
            )
            assert destination_states(clean, "payments.charge") == {"in_flight": 14}
            locker.rollback()
            wait_for(
                lambda: destination_states(clean, "payments.charge") == {"sent": 14}, 30, "the records land"
            )
    finally:
        locker.close()
