"""The sockets of the async provider clients: an httpcore network backend on asyncio's own
transports.

httpx's default async transport reaches its sockets through anyio: every read and write opens a
cancel scope (``fail_after``), and every time httpcore's pool looks for a connection it asks each
idle one whether its socket is readable, which anyio answers by building a dictionary of the
socket's attributes and polling the socket. With many calls in flight that layer is a large
share of the async worker's CPU (docs/decisions/hot-path-costs.md). Here a read waits on a future
with one timer, and an idle connection is readable when its protocol has been handed bytes or the
end of the stream (the loop reads every socket it watches), without a system call.

Only for clients of the process's event loop (:mod:`outbox.aio`); the exceptions are httpcore's
own, as its anyio backend raises them, so httpx maps them to the same ``httpx`` errors.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

#: Bytes a connection buffers before it stops reading its socket until the client reads them.
READ_BUFFER_LIMIT = 256 * 1024


class _Protocol(asyncio.Protocol):
    """What the loop has read from one connection, and whether it may write more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.lost = False
        self.paused_reading = False
        self.paused_writing = False
        self.readable: asyncio.Future[bool] | None = None
        self.writable: asyncio.Future[bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_BUFFER_LIMIT and self.transport is not None and not self.paused_reading:
            self.paused_reading = True
            self.transport.pause_reading()
        _wake(self.readable)

    def eof_received(self) -> bool:
        self.eof = True
        _wake(self.readable)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        _wake(self.readable)
        _wake(self.writable)

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        _wake(self.writable)


def _wake(waiter: asyncio.Future[bool] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(True)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def _wait(protocol: _Protocol, which: str, timeout: float | None) -> bool:
    """Wait until the protocol wakes its ``which`` waiter; False when ``timeout`` (seconds)
    passed first."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()
    setattr(protocol, which, waiter)
    timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
    try:
        return await waiter
    finally:
        setattr(protocol, which, None)
        if timer is not None:
            timer.cancel()


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection (plain, or TLS after :meth:`start_tls`)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        protocol = self._protocol
        if not protocol.buffer and not protocol.eof and not await _wait(protocol, "readable", timeout):
            raise httpcore.ReadTimeout("timed out")
        if protocol.buffer:
            data = bytes(protocol.buffer[:max_bytes])
            del protocol.buffer[:max_bytes]
            if protocol.paused_reading and len(protocol.buffer) <= READ_BUFFER_LIMIT // 2:
                protocol.paused_reading = False
                if not protocol.lost:
                    self._transport.resume_reading()
            return data
        if protocol.error is not None:
            raise httpcore.ReadError(str(protocol.error) or type(protocol.error).__name__)
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        protocol = self._protocol
        if protocol.lost or self._transport.is_closing():
            raise httpcore.WriteError(str(protocol.error) if protocol.error else "connection closed")
        self._transport.write(buffer)
        if protocol.paused_writing and not await _wait(protocol, "writable", timeout):
            raise httpcore.WriteTimeout("timed out")
        if protocol.lost and protocol.error is not None:
            raise httpcore.WriteError(str(protocol.error))

    async def aclose(self) -> None:
        # As anyio's: closed politely (a TLS connection starts its shutdown), then, one turn of
        # the loop later, for good, so the socket is closed even if the loop stops next.
        transport = self._transport
        if transport.is_closing():
            transport.abort()
            return
        transport.close()
        try:
            await asyncio.sleep(0)
        finally:
            transport.abort()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(
                    self._transport, self._protocol, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError as exc:
            self._transport.abort()
            raise httpcore.ConnectTimeout("timed out") from exc
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            self._transport.abort()
            raise httpcore.ConnectError(str(exc)) from exc
        if transport is None:  # the connection ended during the handshake
            raise httpcore.ConnectError("connection closed during the TLS handshake")
        self._protocol.transport = transport
        return AsyncioStream(transport, self._protocol)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # Idle and readable: the server closed it, or sent what no request asked for.
            return bool(self._protocol.buffer) or self._protocol.eof
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        if info == "socket":
            return self._transport.get_extra_info("socket")
        return None


_Address = tuple[Any, ...]  # (family, type, proto, canonname, sockaddr), as getaddrinfo gives
#: Name lookups under way, shared by the connects that want the same name at once.
_resolving: dict[tuple[asyncio.AbstractEventLoop, str, int], asyncio.Task[Any]] = {}


def _literal(host: str, port: int) -> list[_Address] | None:
    if "%" in host:  # a scoped IPv6 address: the system's lookup reads the scope
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if ip.version == 4:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (str(ip), port))]
    return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (str(ip), port, 0, 0))]


async def _addresses(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[_Address]:
    """``host``'s addresses. An address needs no lookup; a name is looked up in the loop's
    executor (a few threads), once for all the connects that want it at the same moment. A
    worker's first calls open a connection each: with a lookup each, queued for those threads,
    an async worker's first calls at 400/s reached the provider ~180 ms after their claim,
    ~145 ms without."""
    literal = _literal(host, port)
    if literal is not None:
        return literal
    key = (loop, host, port)
    pending = _resolving.get(key)
    if pending is None:
        pending = loop.create_task(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        _resolving[key] = pending

        def done(task: asyncio.Task[Any]) -> None:
            _resolving.pop(key, None)
            if not task.cancelled():
                task.exception()  # retrieved: every connect that wanted it may have gone

        pending.add_done_callback(done)
    # Shielded: a connect cancelled (its call's end bound) leaves the lookup to the others.
    addresses: list[_Address] = await asyncio.shield(pending)
    return addresses


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Opens :class:`AsyncioStream` connections on the running loop."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        # Each address in turn, each with the whole connect timeout, as httpx's sync client
        # (socket.create_connection) does. Not asyncio's happy eyeballs: on Python 3.11 a
        # connect cancelled inside it (a call past its end bound) leaves its socket open.
        loop = asyncio.get_running_loop()
        try:
            addresses = await _addresses(loop, host, port)
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        failure: httpcore.ConnectError | httpcore.ConnectTimeout = httpcore.ConnectError(
            f"no address for {host}"
        )
        cause: BaseException | None = None
        for family, _type, _proto, _name, address in addresses:
            try:
                async with asyncio.timeout(timeout):
                    transport, protocol = await loop.create_connection(
                        _Protocol,
                        str(address[0]),
                        int(address[1]),
                        family=family,
                        local_addr=(local_address, 0) if local_address else None,
                    )
            except TimeoutError as exc:
                failure, cause = httpcore.ConnectTimeout("timed out"), exc
            except OSError as exc:
                # asyncio words a refusal "Connect call failed (address)"; on-call reads the
                # system's words, as the sync client's error gives them.
                cause = OSError(exc.errno, os.strerror(exc.errno)) if exc.errno else exc
                failure = httpcore.ConnectError(str(cause))
            else:
                return _opened(transport, protocol, socket_options)
        raise failure from cause

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_unix_connection(_Protocol, path)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout("timed out") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _opened(transport, protocol, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _opened(
    transport: asyncio.BaseTransport,
    protocol: _Protocol,
    socket_options: Iterable[httpcore.SOCKET_OPTION] | None,
) -> AsyncioStream:
    assert isinstance(transport, asyncio.Transport)
    sock: socket.socket | None = transport.get_extra_info("socket")
    if sock is not None:
        for option in socket_options or ():
            sock.setsockopt(*option)
    return AsyncioStream(transport, protocol)


class _Pool(httpcore.AsyncConnectionPool):
    async def _close_connections(self, closing: list[httpcore.AsyncConnectionInterface]) -> None:
        # httpcore enters an anyio shielded cancel scope here on every request and at every
        # response's end, nearly always with nothing to close: 2-3% of an async worker's CPU.
        if closing:
            await super()._close_connections(closing)


def transport(ssl_context: ssl.SSLContext, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """An ``httpx.AsyncHTTPTransport`` (HTTP/1.1, ``limits`` an ``httpx.Limits``) whose
    connections are :class:`AsyncioStream`: httpx's transport maps httpcore's exceptions to
    its own, as for its default pool, which it gives no way to choose the backend of."""
    made = httpx.AsyncHTTPTransport(verify=ssl_context, limits=limits)
    made._pool = _Pool(
        ssl_context=ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        http1=True,
        http2=False,
        network_backend=AsyncioBackend(),
    )
    return made
