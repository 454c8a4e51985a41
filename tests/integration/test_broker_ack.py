"""The worker's broker (outbox.transport.Broker) sends Dramatiq's ack as one pre-packed EVALSHA
of Dramatiq's own dispatch script (issue 17): it must do exactly what Dramatiq's ack does, on a
real Redis, including after Redis lost the script."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from outbox.runner import Runner
from outbox.transport import Broker


def fetch_all(broker: RedisBroker, queue: str, n: int) -> list[Any]:
    consumer = broker.consume(queue, prefetch=n, timeout=100)
    got: list[Any] = []
    for _ in range(50):
        message = next(consumer)
        if message is not None:
            got.append(message)
        if len(got) == n:
            break
    return [consumer, got]


@contextlib.contextmanager
def fetched(clean: Any, redis_client: Any, n: int) -> Iterator[tuple[Broker, Any, list[Any], str]]:
    """``n`` messages fetched (unacked) from a namespace of their own: our broker, its consumer,
    the messages, and the namespace."""
    ns = f"{clean.namespace}-{uuid.uuid4().hex[:8]}"
    queue = "payments.charge"
    theirs = RedisBroker(url=clean.redis_url, namespace=ns)
    ours = Broker(url=clean.redis_url, namespace=ns)
    try:
        for broker in (theirs, ours):
            broker.declare_queue(queue)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=queue, broker=theirs)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(n):
            deliver.send(i)
        consumer, messages = fetch_all(ours, queue, n)
        assert len(messages) == n
        yield ours, consumer, messages, ns
        consumer.close()
    finally:
        for broker in (theirs, ours):
            broker.close()
            broker.client.connection_pool.disconnect()  # close() leaves the pool's sockets
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)


@pytest.mark.parametrize("flush_scripts", [False, True], ids=["script loaded", "after SCRIPT FLUSH"])
def test_ack_removes_exactly_what_dramatiqs_ack_removes(clean, redis_client, flush_scripts) -> None:
    queue = "payments.charge"
    with fetched(clean, redis_client, 6) as (ours, consumer, messages, ns):
        acks = f"{ns}:__acks__.{ours.broker_id}.{queue}"
        assert redis_client.scard(acks) == 6
        if flush_scripts:
            redis_client.script_flush()
        for message in messages[:4]:
            consumer.ack(message)
        assert redis_client.scard(acks) == 2
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 2
        # The heartbeat the dispatch script keeps for this broker is refreshed by the ack too.
        assert redis_client.zscore(f"{ns}:__heartbeats__", ours.broker_id) is not None
        for message in messages[4:]:
            consumer.ack(message)
        assert redis_client.scard(acks) == 0
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 0


def runner_for(broker: Broker, consumer: Any, queue: str, n: int) -> Runner:
    runner = Runner(broker, None, {}, [], concurrency=n)  # type: ignore[arg-type]
    runner._consumers[queue] = consumer
    runner._running.set()
    assert runner.slots.take_open(queue) == n
    return runner


def unacked(redis_client: Any, ns: str, broker: Broker, queue: str = "payments.charge") -> int:
    return int(redis_client.scard(f"{ns}:__acks__.{broker.broker_id}.{queue}"))


def test_a_blocking_after_ack_hook_holds_its_own_slot_only(clean, redis_client) -> None:
    queue = "payments.charge"
    with fetched(clean, redis_client, 6) as (broker, consumer, messages, ns):
        blocked, release = threading.Event(), threading.Event()
        first = messages[0].message_id

        class Stuck(Middleware):
            def after_ack(self, broker: Any, message: Any) -> None:
                if message.message_id == first:
                    blocked.set()
                    release.wait(10)

        broker.add_middleware(Stuck())
        runner = runner_for(broker, consumer, queue, 6)
        stuck = threading.Thread(target=runner._finish, args=(messages[0], queue, None, threading.Lock()))
        stuck.start()
        try:
            assert blocked.wait(10)
            for message in messages[1:]:
                runner._finish(message, queue, None, threading.Lock())
            assert runner.slots.in_hand() == 1
            assert unacked(redis_client, ns, broker) == 0
        finally:
            release.set()
            stuck.join(10)
        assert runner.slots.in_hand() == 0


def test_an_ack_that_cannot_be_sent_fails_alone(clean, redis_client, caplog) -> None:
    queue = "payments.charge"
    with fetched(clean, redis_client, 3) as (broker, consumer, messages, ns):
        runner = runner_for(broker, consumer, queue, 3)
        del messages[1].options["redis_message_id"]  # written by hand, not by Dramatiq
        for message in messages:
            runner._finish(message, queue, None, threading.Lock())
        assert runner.slots.in_hand() == 0
        assert unacked(redis_client, ns, broker) == 1
        assert "KeyError" in caplog.text
