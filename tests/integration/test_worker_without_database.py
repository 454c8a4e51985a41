"""A worker that cannot reach PostgreSQL stops fetching and hands the messages it fetched, and
could not claim, back to their queue (requeued, not acked), for any worker that reaches the
database; it says so once (a WARNING), asks the database every second, and resumes fetching when
it answers (an INFO). Here the worker's connections go through a TCP forwarder the test cuts: every
connection through it closed, every new one refused. (Packets silently dropped, the realistic cut,
is tests/acceptance/test_host_cut_off.py.)"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from helpers import destination_states, relay_once, sql, unacked, wait_for, worker_thread, write_rows

import outbox
from outbox import metrics
from outbox.consumer import LOST_CLAIM_UNREACHABLE_SECONDS

DEST = "payments.charge"


class Forwarder:
    """127.0.0.1:PORT forwarded to the test's PostgreSQL (TCP); ``cut()`` closes every
    connection and refuses new ones until ``restore()``."""

    def __init__(self, database_url: str) -> None:
        parts = urlsplit(database_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        port = self.sock.getsockname()[1]
        userinfo, at, _ = parts.netloc.rpartition("@")
        self.url = urlunsplit((parts.scheme, f"{userinfo}{at}127.0.0.1:{port}", parts.path, parts.query, ""))
        self.cut_off = threading.Event()
        self.connections = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            if self.cut_off.is_set():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            with self._lock:
                self.connections += 1
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.cut_off.set()
        with self._lock:
            socks, self._open = self._open, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.cut()
        self.sock.close()


@pytest.fixture
def forwarder(clean: Any) -> Iterator[Forwarder]:
    parts = urlsplit(clean.database_url)
    if not parts.hostname or "host=" in parts.query:
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
