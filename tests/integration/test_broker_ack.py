"""The worker's broker (outbox.transport.Broker) sends Dramatiq's ack as one pre-packed EVALSHA
of Dramatiq's own dispatch script (issue 17): it must do exactly what Dramatiq's ack does, on a
real Redis, including after Redis lost the script."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker

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
