"""The pre-packed fast paths (the relay's publish, the worker's ack) on a Redis that stopped being
the primary, with real servers: one primary, one replica, three sentinels (tests/sentinel_servers).

A READONLY answer is a failover, never "Redis refused this destination" nor a failed ack: through
Sentinel the commands go again to the primary the sentinels name; on a plain URL the caller sees
a connection error, an outage it already waits out. A primary a failover promotes is used only
once it passes the start-up checks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.errors import ConnectionClosed
from sentinel_servers import SentinelDeployment, sentinel_deployment

from outbox import transport
from outbox.wakes import Wakes

pytestmark = pytest.mark.timeout(90)

NS = "outboxtest"
QUEUE = "payments.charge"


@pytest.fixture
def deployment(monkeypatch: pytest.MonkeyPatch) -> Iterator[SentinelDeployment]:
    # The start-up check's policy is the process's; each test here sets its own, or none.
    monkeypatch.setattr(transport, "_primary_policy", None)
    with sentinel_deployment() as d:
        yield d


def ports(d: SentinelDeployment) -> tuple[int, int]:
    primary = d.primary_port()
    assert primary is not None
    (replica,) = [p for p in d.nodes if p != primary]
    return primary, replica


def row(row_id: int) -> tuple[int, str, datetime]:
    return (row_id, QUEUE, datetime.now(UTC))


def test_a_publish_answered_readonly_goes_to_the_new_primary_not_to_the_refusals(deployment, caplog) -> None:
    client = transport.connect(deployment.url(), socket_timeout=5)
    try:
        assert transport.publish_group(client, NS, [row(1)]).count == 1
        assert client.wait(1, 5000) == 1  # the replica has it before it takes over
        # The client's pooled connection stays open to the old primary, now a replica.
        old, new = deployment.swap_behind_their_back()
        published = transport.publish_group(client, NS, [row(2), row(3)])
        assert published.failed == {} and published.count == 2
        assert deployment.error_replies(old) >= 1
        on_new = deployment.client(new)
        try:
            # The first message came over by replication, the others were sent there.
            assert on_new.llen(f"{NS}:{QUEUE}") == 3 and on_new.hlen(f"{NS}:{QUEUE}.msgs") == 3
        finally:
            on_new.close()
        assert f"is now 127.0.0.1:{new} (was 127.0.0.1:{old})" in caplog.text
    finally:
        client.close()


def test_a_publish_to_a_replica_on_a_plain_url_is_an_outage_not_a_refusal(deployment) -> None:
    _, replica = ports(deployment)
    client = transport.connect(f"redis://127.0.0.1:{replica}/0", socket_timeout=5)
    try:
        with pytest.raises(redis.ConnectionError, match="not the primary any more") as info:
            transport.publish_group(client, NS, [row(1), (2, "other.queue", datetime.now(UTC))])
        assert isinstance(info.value.__cause__, redis.exceptions.ReadOnlyError)
    finally:
        client.close()


@contextlib.contextmanager
def fetched_through(url: str, n: int) -> Iterator[tuple[transport.Broker, Any, list[Any]]]:
    """``n`` messages sent by Dramatiq's own broker and fetched (unacked) by ours, both on
    ``url``: our broker, its consumer, the messages."""
    theirs = RedisBroker(client=transport.connect(url), namespace=NS)
    ours = transport.Broker(client=transport.connect(url), namespace=NS)
    try:
        for broker in (theirs, ours):
            broker.declare_queue(QUEUE)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=QUEUE, broker=theirs)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(n):
            deliver.send(i)
        consumer = ours.consume(QUEUE, prefetch=n, timeout=100)
        messages: list[Any] = []
        for _ in range(50):
            message = next(consumer)
            if message is not None:
                messages.append(message)
            if len(messages) == n:
                break
        assert len(messages) == n
        yield ours, consumer, messages
        consumer.close()
    finally:
        for broker in (theirs, ours):
            broker.close()
            broker.client.close()


def test_an_ack_answered_readonly_is_sent_to_the_new_primary(deployment) -> None:
    with fetched_through(deployment.url(), 2) as (broker, consumer, messages):
        acks = f"{NS}:__acks__.{broker.broker_id}.{QUEUE}"
        assert broker.client.wait(1, 5000) == 1
        old, new = deployment.swap_behind_their_back()
        on_new = deployment.client(new)
        try:
            assert on_new.scard(acks) == 2
            consumer.ack(messages[0])  # no exception: acked on the new primary
            assert deployment.error_replies(old) >= 1
            assert on_new.scard(acks) == 1
            assert on_new.hlen(f"{NS}:{QUEUE}.msgs") == 1
        finally:
            on_new.close()


def test_an_ack_to_a_replica_on_a_plain_url_is_a_lost_connection(deployment) -> None:
    primary, replica = ports(deployment)
    with fetched_through(f"redis://127.0.0.1:{primary}/0", 1) as (broker, consumer, messages):
        broker.client.close()
        broker.client.connection_pool = redis.ConnectionPool.from_url(f"redis://127.0.0.1:{replica}/0")
        # Dramatiq's consumer turns a redis.ConnectionError into ConnectionClosed, which the
        # runner's ack thread tries again (outbox.runner); any other error would drop the ack.
        with pytest.raises(ConnectionClosed, match="not the primary any more"):
            consumer.ack(messages[0])


def test_a_promoted_primary_is_used_only_once_it_passes_the_start_up_checks(deployment, caplog) -> None:
    primary, replica = ports(deployment)
    url = deployment.url()
    transport.check_at_start(url, NS)
    client = transport.connect(url, socket_timeout=5)
    on_replica = deployment.client(replica)
    try:
        assert transport.publish_group(client, NS, [row(1)]).count == 1
        # The replica would evict queued messages once it is the primary.
        on_replica.config_set("maxmemory", "100mb")
        on_replica.config_set("maxmemory-policy", "allkeys-lru")
        deployment.kill_primary()
        assert deployment.wait_promoted(primary) == replica
        for _ in range(3):
            with pytest.raises(transport.UnsafePrimary, match="allkeys-lru"):
                transport.publish_group(client, NS, [row(2)])
        # Said once, however many tries.
        assert caplog.text.count(f"at 127.0.0.1:{replica} is not used: Redis maxmemory-policy") == 1
        assert on_replica.llen(f"{NS}:{QUEUE}") == 1
        on_replica.config_set("maxmemory-policy", "noeviction")
        assert transport.publish_group(client, NS, [row(3)]).count == 1
        assert on_replica.llen(f"{NS}:{QUEUE}") == 2
        assert f"is now 127.0.0.1:{replica} (was 127.0.0.1:{primary})" in caplog.text
    finally:
        client.close()
        on_replica.close()


def test_the_wakes_subscriber_follows_a_failover(deployment) -> None:
    """The worker's Pub/Sub subscriber (outbox.wakes) reconnects to the promoted replica by
    itself: a call's end published there after the failover still wakes the held deliveries."""
    listening = Wakes(deployment.url(), NS).start()
    sending = Wakes(deployment.url(), NS).start()
    try:
        deadline = time.monotonic() + 10
        while listening.received == 0 and time.monotonic() < deadline:
            sending.freed(QUEUE)  # until the subscription is in place
            time.sleep(0.1)
        assert listening.received >= 1
        old = deployment.kill_primary()
        deployment.wait_promoted(old)
        before = listening.received
        deadline = time.monotonic() + 20
        while listening.received == before and time.monotonic() < deadline:
            sending.freed(QUEUE)
            time.sleep(0.2)
        assert listening.received > before
    finally:
        listening.stop()
        sending.stop()
