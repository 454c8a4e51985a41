"""A Redis that answers LOADING (a restarted server reading its dataset back; a demoted primary
loading its new primary's copy) on the pre-packed fast paths: the relay's publish and the
worker's ack. LOADING is an outage, never "Redis refused this destination" nor an ack dropped:
the caller sees a connection error and tries again, and once the data is loaded both go
through. A real server, slowed with its own test settings: ``key-load-delay`` so that its loading
lasts long enough to be asked, ``loading-process-events-interval-bytes`` so that it answers at
once while loading (Redis 7; Redis 6.2 answers every few megabytes, seconds apart)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from dramatiq.errors import ConnectionClosed
from redis.backoff import NoBackoff
from redis.retry import Retry
from sentinel_servers import redis_server

from outbox import transport
from outbox.testing.embedded import die_with_parent, free_port

from .test_redis_sentinel import NS, QUEUE, fetched_through

pytestmark = pytest.mark.timeout(90)

#: Keys of padding in the dump and their size (random: the dump is compressed).
PADDING_KEYS = 20_000
PADDING_BYTES = 1_000
#: Microseconds Redis sleeps per key loaded: 20,000 keys take about 3 s.
KEY_LOAD_DELAY_US = 150


class RestartingRedis:
    """One redis-server on a free port with its dump in a directory of its own, that can be
    stopped and started again (with a slow load) on the same port."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-loading-"))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        args = [redis_server(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory)]
        args += ["--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", *extra]
        log = open(self.directory / "redis.log", "ab")
        with log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(signal.SIGKILL)
            )

    def answers(self) -> str:
        """ "PONG", "LOADING" or "DOWN"."""
        client = redis.Redis(
            port=self.port, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
        )
        try:
            client.ping()
            return "PONG"
        except redis.BusyLoadingError:
            return "LOADING"
        except redis.ConnectionError:
            return "DOWN"
        finally:
            client.close()

    def wait_for(self, *wanted: str, seconds: float = 20) -> str:
        deadline = time.monotonic() + seconds
        while (answer := self.answers()) not in wanted:
            assert time.monotonic() < deadline, f"redis answered {answer}, not {wanted}"
            time.sleep(0.02)
        return answer

    def save_and_restart_slowly(self) -> None:
        """Pad the dataset, save it, stop, and start again reading it back slowly: returns once
        the server answers LOADING."""
        client = redis.Redis(port=self.port)
        try:
            pipe = client.pipeline(transaction=False)
            for i in range(PADDING_KEYS):
                pipe.set(f"padding:{i}", os.urandom(PADDING_BYTES))
            pipe.execute()
            client.save()
        finally:
            client.close()
        self.stop()
        self.start(
            "--key-load-delay", str(KEY_LOAD_DELAY_US), "--loading-process-events-interval-bytes", "1024"
        )
        assert self.wait_for("LOADING", "PONG") == "LOADING", "the load ended before it was asked"

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _major_version() -> int:
    out = subprocess.run([redis_server(), "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"v=(\d+)\.", out).group(1))  # type: ignore[union-attr]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[RestartingRedis]:
    if _major_version() < 7:
        pytest.skip(
            "this redis-server answers clients seconds apart while loading (no "
            "loading-process-events-interval-bytes before Redis 7): put Redis 7 on PATH"
        )
    monkeypatch.setattr(transport, "_primary_policy", None)
    s = RestartingRedis()
    try:
        s.start()
        s.wait_for("PONG")
        yield s
    finally:
        s.close()


def without_retries(client: redis.Redis) -> redis.Redis:
    """What the fast paths make of one LOADING answer, without redis-py's retries riding it out."""
    client.set_retry(Retry(NoBackoff(), 0))
    return client


def test_a_publish_to_a_loading_redis_is_an_outage_then_goes_through(server: RestartingRedis) -> None:
    client = without_retries(transport.connect(server.url, socket_timeout=5))
    try:
        assert transport.publish_group(client, NS, [(1, QUEUE, datetime.now(UTC))]).count == 1
        server.save_and_restart_slowly()
        # The pooled connection died with the old process; its successor is answered LOADING.
        with pytest.raises(redis.ConnectionError, match="loading"):
            transport.publish_group(
                client, NS, [(2, QUEUE, datetime.now(UTC)), (3, "other.queue", datetime.now(UTC))]
            )
        server.wait_for("PONG")
        published = transport.publish_group(client, NS, [(2, QUEUE, datetime.now(UTC))])
        assert published.failed == {} and published.count == 1
        assert client.llen(f"{NS}:{QUEUE}") == 2, "the saved message and the one sent after the load"
    finally:
        client.close()


def test_an_ack_to_a_loading_redis_is_a_lost_connection_then_goes_through(server: RestartingRedis) -> None:
    with fetched_through(server.url, 2) as (broker, consumer, messages):
        without_retries(broker.client)
        acks = f"{NS}:__acks__.{broker.broker_id}.{QUEUE}"
        server.save_and_restart_slowly()
        # Dramatiq's consumer turns a redis.ConnectionError into ConnectionClosed, which the
        # runner's ack thread tries again (outbox.runner); any other error would drop the ack.
        with pytest.raises(ConnectionClosed, match="loading"):
            consumer.ack(messages[0])
        server.wait_for("PONG")
        consumer.ack(messages[0])
        assert broker.client.scard(acks) == 1
        assert broker.client.hlen(f"{NS}:{QUEUE}.msgs") == 1
