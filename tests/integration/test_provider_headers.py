"""A provider header never changes the outcome class: a 503 whose ``Retry-After`` cannot be read
is still a certain "not processed", retried after the handler's own backoff, and the worker
warns once per destination and header. A real HTTP server on 127.0.0.1 sends the header's bytes
as they are (the provider simulator, like ``http.server``, only sends Latin-1), through the
worker's own delivery and real PostgreSQL."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import outbox
from outbox import provider_headers
from outbox.testing.delivery import deliver

from .reconciler.support import DEST, get, write_rows
from .test_retry_after import due_in


@contextlib.contextmanager
def unavailable(retry_after: bytes) -> Iterator[str]:
    """A provider answering every request 503 with ``Retry-After: <retry_after>`` (raw bytes)."""

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.wfile.write(
                b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: "
                + retry_after
                + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            )

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    "retry_after",
    [
        "١٢".encode(),  # Arabic-Indic digits: str.isdigit() says yes, float() reads 12
        "¹²".encode(),  # superscripts: str.isdigit() says yes, float() raises
        b"\xb2",  # a Latin-1 superscript two, not UTF-8: httpx decodes the block as Latin-1
        b"Mon Jan 0 0:0 3000000000 GMT",  # a date whose year overflows the C int
    ],
    ids=["arabic-indic", "superscript", "latin-1", "year-overflow"],
)
def test_a_503_with_an_unreadable_retry_after_is_retried_not_unknown(clean, engine, db, caplog, retry_after):
    provider_headers._warned.clear()  # "once per process": this test is the process

    @outbox.handler(DEST, time_limit=5, max_attempts=3, backoff=(2, 2))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(f"{url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    rows = write_rows(engine, 3)
    with unavailable(retry_after) as url, caplog.at_level(logging.WARNING, logger="outbox"):
        results = deliver({DEST: charge}, database_url=clean.database_url)
    assert results == {row: "pending" for row in rows}
    for row in rows:
        moved = get(db, row)
        assert moved["attempts"] == 1 and "HTTP 503" in moved["last_error"], moved
        assert "Retry-After" not in moved["last_error"]  # treated as absent
        # Due after the handler's own backoff (2 s), not the 12 s the digits might have meant.
        assert 0.5 <= due_in(db, row) <= 2, due_in(db, row)
    warned = [
        r
        for r in caplog.records
        if r.name == "outbox.provider_headers"
        and r.levelno == logging.WARNING
        and "Retry-After" in r.getMessage()
    ]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # three answers, one warning
    assert DEST in warned[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]
