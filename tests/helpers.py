"""Helpers shared by the test tiers: one-shot SQL, waiting on a condition, reading what the
relay queued, a free port, an in-process worker, a lookup on the provider simulator, and a TCP
forwarder to PostgreSQL that a test can cut."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from sqlalchemy.orm import Session

import outbox
from outbox.handlers import Handler, registry
from outbox.relay import Relay
from outbox.settings import libpq_url
from outbox.testing import clock
from outbox.testing.embedded import free_port as free_port  # re-exported for the tests
from outbox.worker import run_worker


def sql(services: Any, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement on its own autocommit connection; its rows, or [] if it returns none."""
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def elapse(target: Any, seconds: float, ids: Iterable[int] | None = None) -> int:
    """Make ``seconds`` pass for the rows ``ids`` (all rows when None): the one way a test moves
    time (:func:`outbox.clock.elapse`). ``target``: a psycopg connection, or the services."""
    chosen = list(ids) if ids is not None else None
    if isinstance(target, psycopg.Connection):
        return clock.elapse(target, seconds, ids=chosen)
    with psycopg.connect(libpq_url(target.database_url), autocommit=True) as conn:
        return clock.elapse(conn, seconds, ids=chosen)


def ids_by_state(services: Any) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for row_id, state in sql(services, "SELECT id, state FROM outbox_message"):
        found.setdefault(state, set()).add(row_id)
    return found


def published_row_ids(client: redis.Redis, namespace: str, destinations: Iterable[str]) -> list[int]:
    """Row ids of every message queued, decoded from the Dramatiq messages (duplicates kept)."""
    row_ids: list[int] = []
    for destination in destinations:
        key = f"{namespace}:{destination}"
        mids = client.lrange(key, 0, -1)
        if not mids:
            continue
        bodies = client.hmget(f"{key}.msgs", mids)
        for mid, body in zip(mids, bodies, strict=True):
            assert body is not None, f"{mid!r} is queued but its message is missing"
            message = json.loads(body)
            assert message["message_id"] == mid.decode()
            row_ids.append(message["args"][0])
    return row_ids


def write_rows(engine: Any, destination: str, n: int) -> None:
    """``n`` rows for ``destination`` in one transaction: keys ``destination:i``, step ``send``."""
    with Session(engine) as s, s.begin():
        for i in range(n):
            outbox.write(s, key=f"{destination}:{i}", step="send", destination=destination, payload={"i": i})


def destination_states(services: Any, destination: str) -> dict[str, int]:
    """State -> rows, for one destination."""
    return dict(
        sql(
            services,
            "SELECT state, count(*) FROM outbox_message WHERE destination = %s GROUP BY 1",
            (destination,),
        )
    )


def unacked(services: Any, *queues: str) -> int:
    """Messages fetched from ``queues`` and not acked, by every worker (Dramatiq's ack sets), read
    in one transaction: two reads apart would count a slot twice (acked on one queue, then
    fetched on the other)."""
    client = redis.Redis.from_url(services.redis_url)
    try:
        keys = [k for q in queues for k in client.scan_iter(f"{services.namespace}:__acks__.*.{q}")]
        if not keys:
            return 0
        with client.pipeline(transaction=True) as pipe:
            for key in keys:
                pipe.scard(key)
            return sum(int(n) for n in pipe.execute())
    finally:
        client.close()


def wait_for(predicate: Callable[[], Any], timeout_seconds: float, what: str, *, every: float = 0.05) -> Any:
    """Poll ``predicate`` every ``every`` seconds until it returns something truthy, and return
    that; past the timeout fail with "timed out after N s waiting for <what>"."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds} s waiting for {what}")
        time.sleep(every)


def relay_once(services: Any) -> int:
    """Publish every due row, as ``outbox relay --once`` would; how many went out."""
    relay = Relay(
        database_url=services.database_url, redis_url=services.redis_url, namespace=services.namespace
    )
    try:
        return relay.drain()
    finally:
        relay.close()


@contextlib.contextmanager
def worker_thread(
    services: Any, *, threads: int, handlers: Mapping[str, Any] | None = None, **options: Any
) -> Iterator[threading.Thread]:
    """A Dramatiq worker (``run_worker``) on every registered destination, in a thread for the
    duration of the block; on exit it is told to stop and joined (30 s at most)."""
    stop = threading.Event()
    kwargs: dict[str, Any] = dict(
        database_url=services.database_url,
        redis_url=services.redis_url,
        namespace=services.namespace,
        handlers=registry() if handlers is None else handlers,
        queues=None,
        concurrency=threads,
        stop=stop,
    )
    thread = threading.Thread(target=run_worker, kwargs={**kwargs, **options})
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(30)


@contextlib.contextmanager
def relay_thread(services: Any, *, poll_interval_seconds: float = 30) -> Iterator[Any]:
    """A relay (``Relay.run_forever``, the default gathering window) in a thread for the duration
    of the block; on exit it is told to stop and joined (10 s at most)."""
    from outbox.relay import Relay

    relay = Relay(
        database_url=services.database_url,
        redis_url=services.redis_url,
        namespace=services.namespace,
        poll_interval_seconds=poll_interval_seconds,
    )
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        stop.set()
        thread.join(10)


def lookup_on(
    handler: Handler, provider: Any, *, keep_response: bool = False, calls: list[int] | None = None
) -> Handler:
    """Declare ``handler``'s lookup on the provider simulator: its charge for the delivery's
    idempotency key, None on 404. ``keep_response`` also returns ``{"id": ref}`` as the response;
    ``calls`` collects the row id of every lookup. Returns the handler."""

    @handler.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        if calls is not None:
            calls.append(d.id)
        r = d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        ref = r.json()["id"]
        return outbox.Confirmed(ref=ref, response={"id": ref} if keep_response else None)

    return handler


def run_user_project(directory: Path, **env: str) -> tuple[int, str]:
    """A user's project run by pytest in a subprocess, as they would run it (warnings as errors,
    no asyncio plugin): its exit status and output. The environment is ours without any OUTBOX_*
    variable, the project on PYTHONPATH, then ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    environ.update(PYTHONPATH=str(directory), **env)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio", "-W", "error"]
    proc = subprocess.run(
        [*argv, str(directory)], cwd=directory, env=environ, capture_output=True, text=True, timeout=240
    )
    return proc.returncode, proc.stdout + proc.stderr


class Forwarder:
    """127.0.0.1:PORT forwarded to the test's PostgreSQL (TCP); ``cut()`` closes every
    connection and refuses new ones until ``restore()``: the processes using ``url`` lose their
    sessions and cannot open new ones (their server ends the sessions as it reads the close).
    Packets silently dropped, the realistic cut, is tests/acceptance/test_host_cut_off.py."""

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
        self._thread = threading.Thread(target=self._accept, name="forwarder", daemon=True)
        self._thread.start()

    @staticmethod
    def possible(database_url: str) -> bool:
        """Whether ``database_url`` reaches its server over TCP (a Unix socket cannot be cut here)."""
        parts = urlsplit(database_url)
        return bool(parts.hostname) and "host=" not in parts.query

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._open = [s for s in self._open if s.fileno() != -1] + [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), name="forwarder-pump", daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        # Each socket is the source of one pump: closed by it, once nothing reads it any more.
        src.close()

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
