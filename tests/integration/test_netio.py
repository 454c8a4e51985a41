"""The async provider clients' sockets (outbox.netio) against real servers on 127.0.0.1: the
errors httpx raises are those of its default (anyio) backend, a connection the server closed
while idle is not reused, flow control both ways, TLS, and the wiring into Delivery.http."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import socketserver
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox import handlers, netio

TLS = Path(__file__).parent / "tls"
CRLF = b"\r\n"


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def _answer(body: bytes = b"ok", *, close: bool = False) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + CRLF + body


@contextlib.contextmanager
def serving(
    behaviour: Callable[[socket.socket], None], *, tls: bool = False
) -> Iterator[tuple[str, list[int]]]:
    """A threaded TCP server on 127.0.0.1 running ``behaviour`` per connection; yields its URL
    and the list of connections accepted so far (one entry each)."""
    accepted: list[int] = []
    context = None
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(TLS / "cert.pem", TLS / "key.pem")

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            accepted.append(1)
            conn = self.request
            if context is not None:
                try:
                    conn = context.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError):
                    return
            with contextlib.suppress(OSError), conn:
                behaviour(conn)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        scheme = "https" if tls else "http"
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}", accepted
    finally:
        server.shutdown()
        server.server_close()


def _client(*, timeout: float = 5.0, verify: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    context = verify or ssl.create_default_context()
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    return httpx.AsyncClient(
        timeout=timeout, verify=context, limits=limits, transport=netio.transport(context, limits)
    )


def _keep_alive(conn: socket.socket) -> None:
    while _read_request(conn):
        conn.sendall(_answer())


def test_requests_share_a_kept_alive_connection() -> None:
    async def go(url: str) -> list[int]:
        async with _client() as client:
            return [(await client.get(url)).status_code for _ in range(5)]

    with serving(_keep_alive) as (url, accepted):
        assert asyncio.run(go(url)) == [200] * 5
        assert len(accepted) == 1


def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    def answer_then_close(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(_answer())  # keep-alive by default, then closed anyway
        time.sleep(0.05)
        conn.close()

    async def go(url: str) -> list[int]:
        async with _client() as client:
            first = (await client.get(url)).status_code
            await asyncio.sleep(0.3)  # the server's FIN reaches the idle connection
            return [first, (await client.get(url)).status_code]

    with serving(answer_then_close) as (url, accepted):
        assert asyncio.run(go(url)) == [200, 200]
        assert len(accepted) == 2


def test_a_connection_past_its_keepalive_expiry_is_closed_and_a_new_one_opened() -> None:
    """The pool skips httpcore's close step when there is nothing to close; when there is (a
    connection idle past ``keepalive_expiry``), the connection is closed, not leaked."""
    closed: list[bool] = []

    def keep_alive_and_see_the_close(conn: socket.socket) -> None:
        _keep_alive(conn)
        closed.append(True)  # the client closed its side: the read above saw the end

    async def go(url: str) -> list[int]:
        context = ssl.create_default_context()
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=0.1)
        made = netio.transport(context, limits)
        async with httpx.AsyncClient(verify=context, limits=limits, transport=made) as c:
            first = (await c.get(url)).status_code
            await asyncio.sleep(0.3)
            second = (await c.get(url)).status_code
            await asyncio.sleep(0.2)
            assert closed == [True], "the pool closed the expired connection, before the client's close"
            return [first, second]

    with serving(keep_alive_and_see_the_close) as (url, accepted):
        assert asyncio.run(go(url)) == [200, 200]
        assert len(accepted) == 2


def test_a_silent_server_is_a_read_timeout() -> None:
    def silent(conn: socket.socket) -> None:
        _read_request(conn)
        time.sleep(2.0)

    async def go(url: str) -> float:
        async with _client(timeout=0.3) as client:
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await client.get(url)
            return time.monotonic() - started

    with serving(silent) as (url, _):
        assert 0.25 < asyncio.run(go(url)) < 1.5


def test_a_closed_port_is_a_connect_error_whose_cause_on_call_can_read() -> None:
    from outbox import policy

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def go() -> httpx.ConnectError:
        async with _client() as client:
            with pytest.raises(httpx.ConnectError) as raised:
                await client.get(f"http://127.0.0.1:{port}/")
            return raised.value

    error = asyncio.run(go())
    outcome, text, _ = policy.classify_exception(error)
    assert outcome is policy.Outcome.RETRY
    assert f"127.0.0.1:{port}" in text and "refused" in text.lower()


def test_a_body_larger_than_the_read_buffer_arrives_whole() -> None:
    body = bytes(range(256)) * (3 * netio.READ_BUFFER_LIMIT // 256 + 7)

    def big(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(_answer(body))

    async def go(url: str) -> bytes:
        async with _client() as client, client.stream("GET", url) as response:
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                await asyncio.sleep(0)  # the client reads slower than the loop fills the buffer
            return b"".join(chunks)

    with serving(big) as (url, _):
        assert asyncio.run(go(url)) == body


def test_a_server_that_reads_nothing_is_a_write_timeout() -> None:
    stop = threading.Event()

    def deaf(conn: socket.socket) -> None:
        stop.wait(5.0)

    async def go(url: str) -> None:
        async with _client(timeout=0.3) as client:
            with pytest.raises(httpx.WriteTimeout):
                await client.post(url, content=b"x" * (64 * 1024 * 1024))

    with serving(deaf) as (url, _):
        try:
            asyncio.run(go(url))
        finally:
            stop.set()


def test_a_reset_mid_response_is_an_error_not_an_answer() -> None:
    def reset(conn: socket.socket) -> None:
        _read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
        time.sleep(0.05)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    async def go(url: str) -> None:
        async with _client() as client:
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await client.get(url)

    with serving(reset) as (url, _):
        asyncio.run(go(url))


def test_a_cancelled_read_leaves_no_waiter_and_the_client_goes_on() -> None:
    def slow_first(conn: socket.socket) -> None:
        _read_request(conn)
        time.sleep(1.0)

    async def go(url: str) -> None:
        async with _client() as client:
            task = asyncio.ensure_future(client.get(url))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with serving(slow_first) as (url, _):
        asyncio.run(go(url))


def test_tls_with_a_trusted_certificate_and_refused_without() -> None:
    trusted = ssl.create_default_context(cafile=str(TLS / "cert.pem"))

    async def go(url: str) -> int:
        async with _client(verify=trusted) as client:
            answered = (await client.get(url)).status_code
        async with _client() as untrusting:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get(url)
        return answered

    with serving(_keep_alive, tls=True) as (url, _):
        assert asyncio.run(go(url.replace("127.0.0.1", "localhost"))) == 200


def test_delivery_http_of_an_async_handler_uses_these_sockets() -> None:
    with handlers.isolated_registry():

        @handlers.handler("netio.wiring")
        async def wired(d: object) -> None:
            return None

        deliveries = handlers.Deliveries()
        handler = handlers.registered("netio.wiring")
        assert handler is not None
        client = deliveries.client(handler, asynchronous=True)
        try:
            pool = client._transport._pool  # type: ignore[attr-defined]
            assert isinstance(pool._network_backend, netio.AsyncioBackend)
        finally:
            deliveries.give_back(client)
            deliveries.close()


def test_a_client_left_stuck_by_cancelled_requests_is_replaced_before_its_next_call() -> None:
    """httpcore 1.0 can leave a pool's connections taken by requests whose tasks were cancelled
    (as a call past its end bound is): every later request of that client then waits out its
    pool timeout. A client lent to no call that still has a connection in use is replaced."""
    import random

    from outbox import aio

    def answer_late(conn: socket.socket) -> None:
        while _read_request(conn):
            time.sleep(0.02)
            conn.sendall(_answer())

    with handlers.isolated_registry(), serving(answer_late) as (url, _):

        @handlers.handler("netio.stuck", time_limit=2)
        async def stuck(d: object) -> None:
            return None

        handler = handlers.registered("netio.stuck")
        assert handler is not None
        deliveries = handlers.Deliveries(pool_size=handlers.ASYNC_CLIENT_CONNECTIONS)

        async def storm() -> httpx.AsyncClient:
            client = deliveries.client(handler, asynchronous=True)
            chance = random.Random(1)
            # Requests cancelled at random instants, until one left the pool stuck (the first
            # hundred or so here; at most 1,000).
            for i in range(1000):
                task = asyncio.ensure_future(client.post(url, content=b"x"))
                await asyncio.sleep(chance.random() * 0.03)
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                if i % 50 == 49 and handlers._stuck(client):
                    break
            deliveries.give_back(client)
            return client

        async def next_call() -> tuple[httpx.AsyncClient, int]:
            client = deliveries.client(handler, asynchronous=True)
            try:
                return client, (await client.post(url, content=b"y")).status_code
            finally:
                deliveries.give_back(client)

        try:
            first = aio.run(storm(), timeout_seconds=90)
            assert handlers._stuck(first)  # the storm left it so (else this test proves nothing)
            second, status = aio.run(next_call(), timeout_seconds=10)
            assert second is not first and status == 200
            assert deliveries._shards["netio.stuck"].replaced == 1
        finally:
            deliveries.close()


def test_an_async_lookup_gives_its_client_back() -> None:
    """A lookup's client is lent for the lookup only, so that a client left stuck is replaced
    for the lookups too (it is replaced only when no call holds it)."""
    from outbox import settlement

    with handlers.isolated_registry(), serving(_keep_alive) as (url, _):

        @handlers.handler("netio.lookup", time_limit=2)
        async def charge(d: object) -> None:
            return None

        @charge.lookup  # type: ignore[attr-defined]
        async def find(d: handlers.Delivery) -> None:
            await d.http.get(url)
            return None

        handler = handlers.registered("netio.lookup")
        assert handler is not None
        clients = settlement.LookupClients()
        try:
            for _ in range(3):
                _, found = settlement.ask_provider(
                    clients,
                    handler,
                    row_id=1,
                    key="order:1",
                    step="charge",
                    payload={},
                    attempts=1,
                    deadline=None,
                    trace_context=None,
                    payload_version=1,
                )
                assert found is None
            assert set(clients._shards["netio.lookup"].busy) == {0}
        finally:
            clients.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_cookies_are_kept_as_httpx_keeps_them_and_not_looked_for_in_answers_without(
    asynchronous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import http.cookiejar

    from outbox import aio

    looked: list[int] = []
    real = http.cookiejar.CookieJar.extract_cookies

    def counted(self: Any, response: Any, request: Any) -> None:
        looked.append(1)
        real(self, response, request)

    monkeypatch.setattr(http.cookiejar.CookieJar, "extract_cookies", counted)
    sent: list[bytes] = []

    def sets_then_reads(conn: socket.socket) -> None:
        first = True
        while request := _read_request(conn):
            sent.append(request)
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
            if first:
                head += b"Set-Cookie: route=a1; Path=/\r\n"
                first = False
            conn.sendall(head + b"\r\nok")

    with handlers.isolated_registry(), serving(sets_then_reads) as (url, _):
        if asynchronous:

            @handlers.handler("netio.cookies", time_limit=2)
            async def charge(d: object) -> None:
                return None

        else:

            @handlers.handler("netio.cookies", time_limit=2)
            def charge(d: object) -> None:
                return None

        handler = handlers.registered("netio.cookies")
        assert handler is not None
        deliveries = handlers.Deliveries()
        client = deliveries.client(handler, asynchronous=asynchronous)
        try:
            for _ in range(3):
                if asynchronous:
                    aio.run(client.get(url))
                else:
                    client.get(url)
        finally:
            deliveries.give_back(client)
            deliveries.close()
    assert b"cookie: route=a1" not in sent[0].lower()
    assert all(b"cookie: route=a1" in r.lower() for r in sent[1:])
    assert len(looked) == 1  # the answer that set one


def test_an_address_is_connected_to_without_a_lookup_and_a_name_is_looked_up_once_for_many() -> None:
    """A worker's first calls each open a connection: an address needs no lookup in the loop's
    executor (a few threads, a queue at a worker's start), and the connects that want one name
    at the same moment share its lookup."""
    lookups: list[str] = []

    async def go(port: int) -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def counted(host: Any, *args: Any, **kwargs: Any) -> Any:
            lookups.append(host)
            await asyncio.sleep(0.05)  # a slow resolver: the connects overlap it
            return await real(host, *args, **kwargs)

        loop.getaddrinfo = counted  # type: ignore[method-assign]
        async with _client() as client:
            by_address = [
                r.status_code
                for r in await asyncio.gather(*(client.get(f"http://127.0.0.1:{port}/") for _ in range(4)))
            ]
        assert lookups == []
        async with _client() as client:
            by_name = [
                r.status_code
                for r in await asyncio.gather(*(client.get(f"http://localhost:{port}/") for _ in range(4)))
            ]
        return by_address, by_name

    with serving(_keep_alive) as (url, accepted):
        port = int(url.rsplit(":", 1)[1])
        assert asyncio.run(go(port)) == ([200] * 4, [200] * 4)
        assert len(accepted) == 8, "four connections each: one call each"
    assert lookups == ["localhost"]


def test_a_connect_cancelled_during_a_shared_lookup_leaves_the_others_their_answer() -> None:
    async def go(port: int) -> int:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def slow(host: Any, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.1)
            return await real(host, *args, **kwargs)

        loop.getaddrinfo = slow  # type: ignore[method-assign]
        async with _client() as client:
            first = asyncio.create_task(client.get(f"http://localhost:{port}/"))
            second = asyncio.create_task(client.get(f"http://localhost:{port}/"))
            await asyncio.sleep(0.02)
            first.cancel()  # a call past its end bound, while the name is looked up
            with contextlib.suppress(asyncio.CancelledError):
                await first
            return (await second).status_code

    with serving(_keep_alive) as (url, _accepted):
        assert asyncio.run(go(int(url.rsplit(":", 1)[1]))) == 200
