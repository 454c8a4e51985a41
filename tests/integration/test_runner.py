"""The worker's own loop over Dramatiq's consumers (outbox.runner): it fetches only as many
messages as it has free slots, a slow destination cannot take every slot, and an async handler's
calls in flight hold no thread each. An ack that fails or that a middleware refuses stalls no
delivery thread; a Redis outage at the ack and rows locked by the application hold no database
thread of async deliveries; a stop with async calls in flight finishes them."""

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
from sqlalchemy.orm import Session

import outbox
from outbox import middleware as mw
from outbox import runner, transport
from outbox.settings import libpq_url


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


def _runner(services: Any, url: str | None = None) -> runner.Runner:
    from outbox.transport import Broker

    broker = Broker(url=url or services.redis_url, namespace=services.namespace, middleware=[])
    return runner.Runner(broker, None, {}, [], concurrency=1)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_an_idle_wait_ends_when_a_message_is_pushed_and_takes_none(clean):
    """The idle wait (BLMOVE of the queue onto its own tail) ends when the queue gets a message,
    at once when it has some, and after its timeout when nothing comes; the queue's messages
    and their order are what they were."""
    r = _runner(clean)
    client = redis.Redis.from_url(clean.redis_url)
    key = f"{clean.namespace}:payments.charge"
    try:
        started = time.monotonic()
        r._wait_for_message("payments.charge", 0.3)
        assert 0.25 <= time.monotonic() - started < 2.0

        pusher = threading.Timer(0.2, lambda: client.rpush(key, "m1", "m2"))
        pusher.start()
        started = time.monotonic()
        r._wait_for_message("payments.charge", 10.0)
        waited = time.monotonic() - started
        pusher.join()
        assert 0.15 <= waited < 2.0, waited
        assert client.lrange(key, 0, -1) == [b"m1", b"m2"]

        client.rpush(key, "m3")
        started = time.monotonic()
        r._wait_for_message("payments.charge", 10.0)
        assert time.monotonic() - started < 1.0
        assert client.lrange(key, 0, -1) == [b"m1", b"m2", b"m3"]
    finally:
        client.close()
        r.broker.close()


@pytest.mark.timeout(60)
def test_an_idle_worker_fetches_a_message_when_it_is_published_not_after_its_backoff(
    clean, engine, monkeypatch
):
    """An empty queue's fetch backoff (here made 3 s every time) does not delay a message: a row
    published to it 0.7 s into that backoff is called within half a second, twice. (Without
    the wait on the queue, the second call came about 2.3 s after its row was published.)"""
    monkeypatch.setattr(runner, "compute_backoff", lambda attempts, **_: (attempts + 1, 3000))
    called: list[float] = []

    @outbox.handler("payments.charge", time_limit=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        called.append(time.monotonic())
        return outbox.Confirmed(ref=f"ch_{d.payload['i']}")

    with worker_thread(clean, threads=2):
        for n in (1, 2):
            threading.Event().wait(0.7)  # the worker polled its queue empty: 3 s to its next fetch
            with Session(engine) as s, s.begin():
                outbox.write(
                    s, key=f"order:{n}", step="charge", destination="payments.charge", payload={"i": n}
                )
            published = time.monotonic()
            assert relay_once(clean) == 1
            wait_for(lambda n=n: len(called) == n, 10, "the call")
            assert called[-1] - published < 0.5, called[-1] - published


@pytest.mark.timeout(30)
def test_a_redis_without_blmove_gets_the_plain_backoff(clean, monkeypatch, caplog):
    """Redis before 6.2 answers BLMOVE "unknown command": the wait sleeps out its timeout, says
    so once, and does not ask again."""
    r = _runner(clean)
    asked: list[str] = []

    def blmove(*args: Any, **kwargs: Any) -> None:
        asked.append(args[0])
        raise redis.ResponseError("unknown command 'BLMOVE', with args beginning with: ")

    monkeypatch.setattr(r.broker.client, "blmove", blmove)
    try:
        with caplog.at_level("INFO", logger="outbox.runner"):
            for _ in range(3):
                started = time.monotonic()
                r._wait_for_message("payments.charge", 0.1)
                assert time.monotonic() - started >= 0.09
        assert len(asked) == 1
        assert [m for m in caplog.messages if "BLMOVE" in m] == [
            "this Redis has no BLMOVE (6.2): an idle worker polls its queues"
        ]
    finally:
        r.broker.close()


@pytest.mark.timeout(30)
def test_idle_waits_hold_a_few_redis_connections_not_one_per_queue(clean):
    """Ten empty queues waiting at once in one process: four block in Redis (each on a
    connection of its own), the other six sleep their backoff, and every wait lasts its time."""
    r = _runner(clean)
    client = redis.Redis.from_url(clean.redis_url)
    took: list[float] = []

    def wait(i: int) -> None:
        started = time.monotonic()
        r._wait_for_message(f"queue{i}.send", 1.5)
        took.append(time.monotonic() - started)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(10)]
    try:
        for t in threads:
            t.start()
        threading.Event().wait(0.7)
        # This test's database only: other processes may wait on other databases of the server.
        db = str(client.connection_pool.connection_kwargs.get("db", 0))
        blocked = [c for c in client.client_list() if c.get("cmd") == "blmove" and c.get("db") == db]
        for t in threads:
            t.join(10)
        assert len(blocked) == runner.WAKE_WAITS_PER_PROCESS == 4, blocked
        assert len(took) == 10 and min(took) >= 1.4, took
    finally:
        client.close()
        r.broker.close()


@pytest.mark.timeout(30)
def test_a_socket_timeout_shorter_than_the_wait_cuts_it_into_turns(clean):
    """A Redis URL with ``socket_timeout=0.3``: the wait blocks in turns shorter than that (a
    longer one was a timeout error, a dropped connection and a blind sleep), so a message
    pushed 0.6 s into a 3 s wait still ends it at once, and an empty queue's wait lasts its time."""
    sep = "&" if "?" in clean.redis_url else "?"
    r = _runner(clean, f"{clean.redis_url}{sep}socket_timeout=0.3")
    client = redis.Redis.from_url(clean.redis_url)
    key = f"{clean.namespace}:payments.charge"
    try:
        started = time.monotonic()
        r._wait_for_message("payments.charge", 0.8)
        assert time.monotonic() - started >= 0.75

        pusher = threading.Timer(0.6, lambda: client.rpush(key, "m1"))
        pusher.start()
        started = time.monotonic()
        r._wait_for_message("payments.charge", 3.0)
        waited = time.monotonic() - started
        pusher.join()
        assert 0.55 <= waited < 1.0, waited
        assert client.lrange(key, 0, -1) == [b"m1"]
    finally:
        client.close()
        r.broker.close()


def delivery_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("outbox-delivery-") and t.is_alive())


# --- an ack error that is not a connection error kills a sync delivery thread ---------------


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


# --- Redis down at ack time (async): records of finished calls wait behind acks -----------


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


# --- rows locked by the application stop every async delivery -----------------------------


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


# --- SIGTERM-like stop with async calls in flight ----------------------------------------


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
