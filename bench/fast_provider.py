#!/usr/bin/env python
"""A no-op payment provider for benchmarks: a real HTTP/1.1 keep-alive server on 127.0.0.1.

``outbox.testing.provider`` is a stdlib ``ThreadingHTTPServer`` (a thread per connection, the
``http.server`` parser, about 3k requests/s on this machine): in an end-to-end bench on two
cores it takes CPU from both systems under test. This one is a single asyncio protocol that
parses just enough of HTTP/1.1 (request line, ``Content-Length``, ``Idempotency-Key``,
keep-alive) to answer every ``POST /charges`` with ``{"id": "ch_N", "status": "succeeded"}``,
after ``--latency-ms`` (default 0: at once) like a slow provider, without a thread per request.

It counts what a provider would (requests, distinct idempotency keys, keys seen more than once,
requests without a key) and answers ``GET /_stats`` and ``POST /_reset``. Anything else gets a
404; a malformed request gets a 400 and the connection is closed.

    python bench/fast_provider.py --port 0 --ready-file /tmp/provider.url
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

_MAX_HEAD = 16 * 1024
_MAX_BODY = 1 << 20


class Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.charges = 0
        self.missing_key = 0
        self.keys: dict[bytes, int] = {}
        #: Charges received and not answered yet (a slow provider's concurrent requests).
        self.in_flight = 0
        self.max_in_flight = 0

    def as_json(self) -> bytes:
        repeated = sum(1 for n in self.keys.values() if n > 1)
        return json.dumps(
            {
                "requests": self.requests,
                "charges": self.charges,
                "distinct_keys": len(self.keys),
                "keys_seen_more_than_once": repeated,
                "missing_key": self.missing_key,
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
            }
        ).encode()


def _response(status: bytes, body: bytes, *, close: bool = False) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + (b"\r\nConnection: close" if close else b"")
        + b"\r\n\r\n"
        + body
    )


class Http(asyncio.Protocol):
    stats: Stats

    def __init__(self, stats: Stats, latency_seconds: float = 0.0) -> None:
        self.stats = stats
        self.latency_seconds = latency_seconds
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out: list[bytes] = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._bad(out)
                break
            head = self.buf[:end]
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ")
            if len(parts) != 3:
                self._bad(out)
                return
            method, target = parts[0], parts[1]
            length = 0
            key = None
            close = parts[2] == b"HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    try:
                        length = int(value.strip())
                    except ValueError:
                        self._bad(out)
                        return
                elif name == b"idempotency-key":
                    key = value.strip()
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
            if length < 0 or length > _MAX_BODY:
                self._bad(out)
                return
            total = end + 4 + length
            if len(self.buf) < total:
                break  # wait for the body
            self.buf = self.buf[total:]
            answer = self._answer(method, target, key, close)
            if self.latency_seconds > 0 and method == b"POST" and target == b"/charges":
                # One request at a time per connection (no pipelining from the clients): the
                # late answer cannot overtake another on the same connection.
                self._flush(out)
                self.stats.in_flight += 1
                self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
                asyncio.get_running_loop().call_later(self.latency_seconds, self._late, answer, close)
                if close:
                    return
                continue
            out.append(answer)
            if close:
                self._flush(out)
                assert self.transport is not None
                self.transport.close()
                return
        self._flush(out)

    def _answer(self, method: bytes, target: bytes, key: bytes | None, close: bool) -> bytes:
        s = self.stats
        if method == b"POST" and target == b"/charges":
            s.requests += 1
            if key is None:
                s.missing_key += 1
                return _response(b"400 Bad Request", b'{"error":"Idempotency-Key required"}', close=close)
            seen = s.keys.get(key, 0)
            s.keys[key] = seen + 1
            s.charges += 1
            return _response(b"200 OK", b'{"id":"ch_%d","status":"succeeded"}' % s.charges, close=close)
        if method == b"GET" and target == b"/_stats":
            return _response(b"200 OK", s.as_json(), close=close)
        if method == b"POST" and target == b"/_reset":
            s.reset()
            return _response(b"200 OK", b'{"reset":true}', close=close)
        return _response(b"404 Not Found", b'{"error":"not found"}', close=close)

    def _late(self, answer: bytes, close: bool) -> None:
        self.stats.in_flight -= 1
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)
            if close:
                self.transport.close()

    def _bad(self, out: list[bytes]) -> None:
        out.append(_response(b"400 Bad Request", b'{"error":"malformed request"}', close=True))
        self._flush(out)
        assert self.transport is not None
        self.transport.close()
        self.buf = b""

    def _flush(self, out: list[bytes]) -> None:
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))
            out.clear()


def _write_ready_file(path: Path, url: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(url)
    os.replace(tmp, path)


async def serve(port: int, ready_file: Path | None, latency_seconds: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    server = await loop.create_server(lambda: Http(stats, latency_seconds), "127.0.0.1", port, backlog=4096)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file is not None:
        _write_ready_file(ready_file, url)
    print(f"fast provider listening on {url}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="answer each charge this late")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.ready_file, args.latency_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
