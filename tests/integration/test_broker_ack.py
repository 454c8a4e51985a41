"""The worker's broker (outbox.transport.Broker) sends Dramatiq's ack as one pre-packed EVALSHA
of Dramatiq's own dispatch script (issue 17): it must do exactly what Dramatiq's ack does, on a
real Redis, including after Redis lost the script."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker

from outbox import transport
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


@pytest.mark.parametrize("flush_scripts", [False, True], ids=["script loaded", "after SCRIPT FLUSH"])
def test_ack_removes_exactly_what_dramatiqs_ack_removes(clean, redis_client, flush_scripts) -> None:
    ns = f"{clean.namespace}-ack"
    queue = "payments.charge"
    theirs = RedisBroker(url=clean.redis_url, namespace=ns)
    ours = Broker(url=clean.redis_url, namespace=ns)
    try:
        for broker in (theirs, ours):
            broker.declare_queue(queue)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=queue, broker=theirs)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(6):
            deliver.send(i)
        consumer, messages = fetch_all(ours, queue, 6)
        assert len(messages) == 6
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
        consumer.close()
    finally:
        for broker in (theirs, ours):
            broker.close()
            broker.client.connection_pool.disconnect()  # close() leaves the pool's sockets
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)


@pytest.mark.parametrize("flush_scripts", [False, True], ids=["script loaded", "after SCRIPT FLUSH"])
def test_acks_in_one_round_trip_remove_what_each_ack_removes(
    clean, redis_client, flush_scripts, monkeypatch
) -> None:
    ns = f"{clean.namespace}-acks"
    queue = "payments.charge"
    theirs = RedisBroker(url=clean.redis_url, namespace=ns)
    ours = Broker(url=clean.redis_url, namespace=ns)
    try:
        for broker in (theirs, ours):
            broker.declare_queue(queue)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=queue, broker=theirs)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(6):
            deliver.send(i)
        consumer, messages = fetch_all(ours, queue, 6)
        assert len(messages) == 6
        acks = f"{ns}:__acks__.{ours.broker_id}.{queue}"
        if flush_scripts:
            redis_client.script_flush()
        sends: list[int] = []
        real_send = transport._send_packed

        def counted(client: Any, payload: bytes, replies: int) -> Any:
            sends.append(replies)
            return real_send(client, payload, replies)

        monkeypatch.setattr(transport, "_send_packed", counted)
        errors = ours.do_acks([(queue, m.options["redis_message_id"]) for m in messages[:5]])
        assert errors == [None] * 5
        assert sends == [5]  # one round trip (and, after a flush, Dramatiq's own path per ack)
        assert redis_client.scard(acks) == 1
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 1
        assert ours.do_acks([(queue, messages[5].options["redis_message_id"])]) == [None]
        assert redis_client.scard(acks) == 0
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 0
        consumer.close()
    finally:
        for broker in (theirs, ours):
            broker.close()
            broker.client.connection_pool.disconnect()
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)


def test_the_runner_acks_what_other_threads_asked_for_while_it_acked(clean, redis_client) -> None:
    """The first thread to ack sends the acks the others asked for meanwhile, in one round trip;
    the others do not wait for it; every slot comes back and Redis holds none of the messages."""
    import threading

    from outbox.runner import Runner

    ns = f"{clean.namespace}-combine"
    queue = "payments.charge"
    theirs = RedisBroker(url=clean.redis_url, namespace=ns)
    ours = Broker(url=clean.redis_url, namespace=ns)
    try:
        for broker in (theirs, ours):
            broker.declare_queue(queue)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=queue, broker=theirs)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(6):
            deliver.send(i)
        consumer, messages = fetch_all(ours, queue, 6)
        runner = Runner(ours, None, {}, [], concurrency=6)  # type: ignore[arg-type]
        runner._consumers[queue] = consumer
        runner._running.set()
        assert runner.slots.take_open(queue) == 6
        batches: list[int] = []
        first_in, release = threading.Event(), threading.Event()
        real = runner._ack_batch

        def slow_first(batch: list[Any]) -> None:
            batches.append(len(batch))
            if len(batches) == 1:
                first_in.set()
                assert release.wait(10)
            real(batch)

        runner._ack_batch = slow_first  # type: ignore[method-assign]
        leader = threading.Thread(target=runner._ack_soon, args=(messages[0], queue))
        leader.start()
        assert first_in.wait(10)
        for message in messages[1:]:
            runner._ack_soon(message, queue)  # returns at once: the leader acks it
        assert batches == [1]
        release.set()
        leader.join(10)
        assert batches == [1, 5]
        assert runner.slots.in_hand() == 0
        assert redis_client.scard(f"{ns}:__acks__.{ours.broker_id}.{queue}") == 0
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 0
        consumer.close()
    finally:
        for broker in (theirs, ours):
            broker.close()
            broker.client.connection_pool.disconnect()
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)
