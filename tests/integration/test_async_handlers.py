"""``async def`` handlers and lookups, through the worker's own claim → call → record against real
PostgreSQL and the provider simulator on 127.0.0.1: ``d.http`` is an ``httpx.AsyncClient`` with
the sync client's timeouts and notes, concurrent calls keep their own per-call state, the end
bound cancels the task, and the testing helpers run both kinds."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.consumer import Deliverer, DeliveryResult
from outbox.exceptions import ConfigError
from outbox.handlers import Deliveries, registry
from outbox.settings import libpq_url
from outbox.testing import delivery as testing


def async_charge(provider: Any, seen: list[Any] | None = None, **options: Any) -> outbox.Handler:
    @outbox.handler("payments.charge", **{"time_limit": 2, "backoff": (1, 5), **options})
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        if seen is not None:
            seen.append(d.http)
        r = await d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return charge


def write_rows(engine: Any, n: int, *, destination: str = "payments.charge") -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s, key=f"order:{i}", step="charge", destination=destination, payload={"amount_cents": 100 + i}
            ).id
            for i in range(n)
        ]


def rows(services: Any) -> dict[int, dict[str, Any]]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT id, key, state, attempts, provider_ref, last_error FROM outbox_message")
        names = [c.name for c in cur.description or ()]
        return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def test_async_handler_is_sent_through_an_async_client(clean, engine, provider, consumer):
    seen: list[Any] = []
    handler = async_charge(provider, seen)
    assert handler.is_async
    (row_id,) = write_rows(engine, 1)
    c = consumer()
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.SENT
    assert isinstance(seen[0], httpx.AsyncClient)
    # The sync client's timeouts: connect + write + read inside time_limit.
    assert seen[0].timeout == handler.timeouts()
    r = rows(clean)[row_id]
    assert r["state"] == "sent" and r["provider_ref"].startswith("ch_") and r["attempts"] == 1
    assert provider.stats()["effects"] == {"order:0:charge": 1}
    # A duplicate message: nothing claimed, nothing charged.
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.EMPTY
    assert provider.charges() == 1


def test_concurrent_async_calls_keep_their_own_status_and_retry_after(clean, engine, provider):
    """Twenty threads deliver at once on one event loop; half the provider's answers are 503 with
    a Retry-After. A handler that raises its own error on a 503 (the status is not in its
    exception) gets each row's own status and wait: with one shared state a row would take
    another's 200 (and be counted processed) or lose its Retry-After."""
    provider.configure(retry_after="40", latency_ms=150)
    provider.configure(fault_keys={f"order:{i}:charge": "fail_before" for i in range(0, 20, 2)})

    @outbox.handler("payments.charge", time_limit=3, backoff=(1,), max_attempts=3)
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = await d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code >= 500:
            raise outbox.RetryableError("provider busy")
        return outbox.Confirmed(ref=r.json()["id"])

    ids = write_rows(engine, 20)
    deliverer = Deliverer(clean.database_url, registry())
    results: dict[int, DeliveryResult] = {}

    def one(row_id: int) -> None:
        results[row_id] = deliverer.deliver(row_id, "payments.charge")
        deliverer.close_thread()

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - started
    deliverer.close()
    by_key = {r["key"]: r for r in rows(clean).values()}
    for i in range(20):
        r = by_key[f"order:{i}"]
        if i % 2 == 0:
            assert r["state"] == "pending", r
        else:
            assert r["state"] == "sent", r
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        waits = dict(
            conn.execute(
                "SELECT m.key, EXTRACT(EPOCH FROM m.available_at - a.finished_at) FROM outbox_message m "
                "JOIN outbox_attempt a ON a.message_id = m.id WHERE m.state = 'pending'"
            ).fetchall()
        )
    # Each 503's own Retry-After (40 s) holds its retry, not the 1 s backoff.
    assert len(waits) == 10 and all(float(w) >= 39 for w in waits.values()), waits
    # They overlapped: 20 calls of 150 ms one after the other would take 3 s.
    assert elapsed < 2.5, elapsed


def test_the_end_bound_cancels_the_task(clean, engine, provider, consumer):
    """A call past its time limit is abandoned and recorded unknown within the lease; its task is
    cancelled, so nothing it had yet to send is sent."""
    cancelled = threading.Event()

    @outbox.handler("payments.charge", time_limit=1, lease_seconds=4)
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        await d.http.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": d.idempotency_key})
        return outbox.Confirmed(ref="never")

    (row_id,) = write_rows(engine, 1)
    started = time.monotonic()
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.UNKNOWN
    assert time.monotonic() - started < 3
    assert cancelled.wait(2)
    assert "time limit" in rows(clean)[row_id]["last_error"]
    time.sleep(0.2)
    assert provider.stats()["requests"] == 0


def test_a_call_that_starts_past_its_send_bound_sends_nothing(clean, provider):
    """The send bound is the task's own: set in one task, it does not leak to another."""

    @outbox.handler("payments.charge", time_limit=2)
    async def charge(d: outbox.Delivery) -> Any:
        return await d.http.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": "k:s"})

    clients = Deliveries()
    client = clients.client(charge, asynchronous=True)
    clients.give_back(client)

    async def bounded() -> BaseException | None:
        outbox.handlers.set_send_bound(time.monotonic() - 0.1)
        try:
            await client.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": "a:s"})
        except outbox.RetryableError as exc:
            return exc
        return None

    async def unbounded() -> int:
        outbox.handlers.set_send_bound(None)
        r = await client.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": "b:s"})
        return r.status_code

    async def both() -> tuple[Any, Any]:
        return await asyncio.gather(bounded(), unbounded())

    try:
        refused, status = aio.run(both(), timeout_seconds=10)
    finally:
        clients.close()
    assert isinstance(refused, outbox.RetryableError) and "not sent" in str(refused)
    assert status == 200
    assert provider.stats()["effects"] == {"b:s": 1}


def test_a_pool_wait_is_no_attempt_and_no_call(clean, engine, provider, monkeypatch):
    """Every connection of the client's pool is busy: the call's only request times out waiting
    for one. Nothing was sent, and the wait was ours: the claim is released, no attempt spent."""
    provider.configure(latency_ms=900)  # under the read timeout (0.55 of the time limit)
    async_charge(provider, time_limit=2, lease_seconds=10)
    first, second = write_rows(engine, 2)
    deliverer = Deliverer(clean.database_url, registry())
    # As a pool smaller than the calls in flight: one client of one connection.
    monkeypatch.setattr(outbox.handlers, "ASYNC_CLIENT_CONNECTIONS", 1)
    deliverer.async_deliveries = Deliveries(pool_size=1)
    results: dict[int, DeliveryResult] = {}
    holder = threading.Thread(
        target=lambda: results.setdefault(first, deliverer.deliver(first, "payments.charge"))
    )
    holder.start()
    time.sleep(0.4)  # the first call holds the only connection
    try:
        results[second] = deliverer.deliver(second, "payments.charge")
        holder.join(10)
    finally:
        deliverer.close()
    assert results == {first: DeliveryResult.SENT, second: DeliveryResult.RELEASED}
    waiting = rows(clean)[second]
    assert waiting["state"] == "pending" and waiting["attempts"] == 0, waiting
    assert "pool" in waiting["last_error"]
    assert provider.stats()["effects"] == {"order:0:charge": 1}


def test_an_async_lookup_settles_an_unknown_row(clean, engine, provider):
    handler = async_charge(provider)
    asked: list[Any] = []

    @handler.lookup
    async def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        asked.append(d.http)
        r = await d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    provider.configure(fault_next=["drop_after"])  # charged, then the connection drops: unknown
    (row_id,) = write_rows(engine, 1)
    assert testing.deliver({"payments.charge": handler}, database_url=clean.database_url) == {
        row_id: DeliveryResult.UNKNOWN
    }
    testing.pass_time(3600, database_url=clean.database_url)
    testing.reconcile_once({"payments.charge": handler}, database_url=clean.database_url)
    assert rows(clean)[row_id]["state"] == "sent"
    assert isinstance(asked[0], httpx.AsyncClient)
    assert provider.charges() == 1


def test_crash_after_an_async_call_charges_once(clean, engine, provider):
    """The testing helpers run async handlers: a worker dead between the answer and the record,
    then what the running system does, and the provider's own count."""
    handler = async_charge(provider)

    @handler.lookup
    async def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        r = await d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
        return None if r.status_code == 404 else outbox.Confirmed(ref=r.json()["id"])

    ids = write_rows(engine, 3)
    table = {"payments.charge": handler}
    assert sorted(testing.crash_after_call(table, database_url=clean.database_url)) == ids
    assert testing.recover(table, database_url=clean.database_url) == {i: "sent" for i in ids}
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in range(3)}


def test_next_steps_must_be_plain_functions(clean, provider):
    handler = async_charge(provider)
    with pytest.raises(ConfigError, match="not async def"):

        @handler.then
        async def follow(d: outbox.Delivery, c: outbox.Confirmed) -> list[Any]:
            return []

    with pytest.raises(ConfigError, match="not async def"):

        @handler.on_failure
        async def undo(d: outbox.Delivery, reason: str) -> list[Any]:
            return []


def test_blocking_on_the_loop_from_the_loop_is_refused():
    async def inner() -> None:
        aio.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="event loop"):
        aio.run(inner(), timeout_seconds=5)


def test_async_calls_share_small_clients_least_busy_first(clean, provider):
    """A destination's async connections are spread over small clients (httpcore's pool costs
    grow with the square of its size); each call gets the least busy client, and gives it back."""

    @outbox.handler("payments.charge", time_limit=2)
    async def charge(d: outbox.Delivery) -> Any:
        return None

    clients = Deliveries(pool_size=10)
    try:
        lent = [clients.client(charge, asynchronous=True) for _ in range(10)]
        distinct = {id(c) for c in lent}
        assert len(distinct) == 3  # ceil(10 / 4) clients
        # Least busy first: 10 calls spread 4/3/3 at most, never 5 on one client.
        assert max(sum(1 for c in lent if c is x) for x in lent) <= 4
        for c in lent[:4]:
            clients.give_back(c)
        again = clients.client(charge, asynchronous=True)
        assert again in lent[:4]
        assert all(c.timeout == charge.timeouts() for c in lent)
        size = outbox.handlers.ASYNC_CLIENT_CONNECTIONS
        assert all(c._transport._pool._max_connections == size for c in lent)
    finally:
        clients.close()
    assert all(c.is_closed for c in lent)


def test_sent_runs_are_summed_at_info_and_failed_runs_each_keep_a_warning(clean, engine, provider, caplog):
    provider.configure(fault_keys={"order:3:charge": "decline"})
    async_charge(provider)
    ids = write_rows(engine, 7)
    deliverer = Deliverer(clean.database_url, registry())
    deliverer.runs.every_seconds = 0.2
    caplog.set_level(logging.DEBUG, logger="outbox.consumer")
    results = [deliverer.deliver(row_id, "payments.charge") for row_id in ids[:5]]
    deliverer.runs.tick()
    assert not [r for r in caplog.records if r.getMessage().startswith("delivered:")], "the window is open"
    time.sleep(0.25)
    deliverer.runs.tick()  # the worker's main loop does this every 0.5 s
    results += [deliverer.deliver(row_id, "payments.charge") for row_id in ids[5:]]
    deliverer.close()
    assert results.count(DeliveryResult.SENT) == 6 and results.count(DeliveryResult.FAILED) == 1
    runs = [r for r in caplog.records if " -> " in r.getMessage()]
    assert [r.levelno for r in runs] == [
        logging.DEBUG,
        logging.DEBUG,
        logging.DEBUG,
        logging.WARNING,
        logging.DEBUG,
        logging.DEBUG,
        logging.DEBUG,
    ], [(r.levelname, r.getMessage()) for r in runs]
    assert runs[3].getMessage().startswith("outbox order:3:charge -> failed (attempt 1)")
    sums = [r for r in caplog.records if r.getMessage().startswith("delivered:")]
    assert [r.levelno for r in sums] == [logging.INFO, logging.INFO]
    first, last = sums
    assert first.getMessage().startswith("delivered: sent=4 retried=0 failed=1 in the last ")
    assert (first.sent, first.retried, first.failed, first.runs) == (4, 0, 1, 5)
    assert first.seconds >= 0.2 and first.by_destination == {"payments.charge": 5}
    # Closing the deliverer (the worker stopping) sums up the window it was in.
    assert last.getMessage().startswith("delivered: sent=2 retried=0 failed=0 in the last ")
    assert last.by_destination == {"payments.charge": 2}
