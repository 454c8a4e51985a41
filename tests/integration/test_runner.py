"""The worker's own loop over Dramatiq's consumers (outbox.runner): it fetches only as many
messages as it has free slots, a slow destination cannot take every slot, and an async handler's
calls in flight hold no thread each."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis
from helpers import destination_states, relay_once, unacked, wait_for, worker_thread, write_rows

import outbox
from outbox import runner


class InHand:
    """Calls running at once in a handler, and the most seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.done = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1
            self.done += 1


def sent(services: Any, destination: str) -> int:
    return destination_states(services, destination).get("sent", 0)


def waiting(services: Any, queue: str) -> int:
    client = redis.Redis.from_url(services.redis_url)
    try:
        return int(client.llen(f"{services.namespace}:{queue}"))
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_a_worker_fetches_no_more_messages_than_it_has_free_slots(clean, engine):
    """Four slots, twenty messages, every call held: four are fetched (unacked in Redis) and
    sixteen stay in the queue for any other worker, not 2 x 4 prefetched here as before."""
    release = threading.Event()
    seen = InHand()

    @outbox.handler("payments.charge", time_limit=30)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        seen.enter()
        try:
            release.wait(30)
            return outbox.Confirmed(ref=f"ch_{d.payload['i']}")
        finally:
            seen.leave()

    write_rows(engine, "payments.charge", 20)
    assert relay_once(clean) == 20
    with worker_thread(clean, threads=4):
        wait_for(lambda: seen.now == 4, 30, "four calls in flight")
        # Any fetch beyond the free slots would have happened by now: the slots are all taken.
        threading.Event().wait(1.5)
        assert seen.now == 4
        assert unacked(clean, "payments.charge") == 4
        assert waiting(clean, "payments.charge") == 16
        release.set()
        wait_for(lambda: sent(clean, "payments.charge") == 20, 30, "every row sent")
    assert seen.most == 4
    assert unacked(clean, "payments.charge") == 0


@pytest.mark.timeout(90)
def test_a_slow_destination_leaves_slots_to_the_others(clean, engine):
    """Eight slots, a destination whose calls hang: it holds six (three quarters), the other
    destination's rows are all delivered meanwhile on the two it left."""
    release = threading.Event()
    slow = InHand()

    @outbox.handler("bank.transfer", time_limit=30)
    def transfer(d: outbox.Delivery) -> outbox.Confirmed:
        slow.enter()
        try:
            release.wait(30)
            return outbox.Confirmed(ref=f"tr_{d.payload['i']}")
        finally:
            slow.leave()

    @outbox.handler("mail.send", time_limit=5)
    def send(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"m_{d.payload['i']}")

    assert runner.destination_slots(8, 2) == 6
    write_rows(engine, "bank.transfer", 20)
    assert relay_once(clean) == 20
    with worker_thread(clean, threads=8):
        wait_for(lambda: slow.now == 6, 30, "the slow destination's six calls in flight")
        write_rows(engine, "mail.send", 30)
        assert relay_once(clean) == 30
        wait_for(lambda: sent(clean, "mail.send") == 30, 30, "the other destination's rows sent")
        assert slow.now == 6
        assert unacked(clean, "bank.transfer") == 6
        release.set()
        wait_for(lambda: sent(clean, "bank.transfer") == 20, 30, "the slow rows sent")
    assert slow.most == 6


@pytest.mark.timeout(90)
def test_slots_per_destination_is_the_operators_cap(clean, engine):
    release = threading.Event()
    slow = InHand()

    @outbox.handler("bank.transfer", time_limit=30)
    def transfer(d: outbox.Delivery) -> outbox.Confirmed:
        slow.enter()
        try:
            release.wait(30)
            return outbox.Confirmed(ref=f"tr_{d.payload['i']}")
        finally:
            slow.leave()

    write_rows(engine, "bank.transfer", 10)
    assert relay_once(clean) == 10
    with worker_thread(clean, threads=8, slots_per_destination=3):
        wait_for(lambda: slow.now == 3, 30, "three calls in flight")
        threading.Event().wait(1.0)
        assert slow.now == 3
        assert unacked(clean, "bank.transfer") == 3
        release.set()
        wait_for(lambda: sent(clean, "bank.transfer") == 10, 30, "every row sent")
    assert slow.most == 3


@pytest.mark.timeout(120)
def test_async_calls_in_flight_hold_no_thread_each(clean, engine):
    """A hundred async calls in flight at once in a worker process run on a few threads: the
    event loop's, the fetch thread and the database threads, not one per call."""
    release = asyncio.Event()
    seen = InHand()
    threads_seen: list[int] = []

    @outbox.handler("payments.charge", time_limit=30)
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        seen.enter()
        try:
            if seen.now == 100:
                threads_seen.append(threading.active_count())
                release.set()
            await asyncio.wait_for(release.wait(), 30)
            return outbox.Confirmed(ref=f"ch_{d.payload['i']}")
        finally:
            seen.leave()

    before = threading.active_count()
    write_rows(engine, "payments.charge", 100)
    assert relay_once(clean) == 100
    with worker_thread(clean, threads=100):
        wait_for(lambda: sent(clean, "payments.charge") == 100, 60, "every row sent")
    assert seen.most == 100
    # The worker's own threads (fetch, heartbeat, failover guard, the database threads, the loop)
    # and the test's: far fewer than the hundred calls that were in flight.
    assert threads_seen and threads_seen[0] - before <= runner.DATABASE_THREADS + 8


@pytest.mark.timeout(90)
def test_one_slot_serves_every_destination(clean, engine):
    """A worker of one slot and three destinations: a queue polled empty holds no slot, so
    the one slot goes round. (Holding it through an empty queue's long poll, one fetch thread
    kept it: the other destinations' rows waited for ever.)"""
    for destination in ("payments.charge", "mail.send", "sms.send"):

        @outbox.handler(destination, time_limit=5)
        def send(d: outbox.Delivery) -> outbox.Confirmed:
            return outbox.Confirmed(ref=f"r_{d.payload['i']}")

    for destination in ("payments.charge", "mail.send", "sms.send"):
        write_rows(engine, destination, 5)
    assert relay_once(clean) == 15
    with worker_thread(clean, threads=1):
        wait_for(
            lambda: all(sent(clean, d) == 5 for d in ("payments.charge", "mail.send", "sms.send")),
            30,
            "every destination's rows sent through one slot",
        )


@pytest.mark.timeout(90)
def test_two_queues_never_fetch_on_the_same_free_slots(clean, engine):
    """Four slots, two busy queues: never more than four messages fetched and unacked at once
    (each queue sized its fetch on the same free slots, and six were held)."""
    seen = InHand()

    for destination in ("payments.charge", "mail.send"):

        @outbox.handler(destination, time_limit=10)
        def send(d: outbox.Delivery) -> outbox.Confirmed:
            seen.enter()
            try:
                threading.Event().wait(0.3)
                return outbox.Confirmed(ref=f"r_{d.payload['i']}")
            finally:
                seen.leave()

    write_rows(engine, "payments.charge", 20)
    write_rows(engine, "mail.send", 20)
    assert relay_once(clean) == 40
    most = 0
    with worker_thread(clean, threads=4):
        while sent(clean, "payments.charge") + sent(clean, "mail.send") < 40:
            most = max(most, unacked(clean, "payments.charge", "mail.send"))
            threading.Event().wait(0.02)
    assert seen.most <= 4
    assert 0 < most <= 4
