"""A connection error keeps its cause where on-call reads it: the row's ``last_error``, the
attempt's error ``outbox show`` prints, and the worker's log line name the host, the port and
the OS's error, and nothing else of the URL (no path, no query, no userinfo). Through the
worker's own delivery to a closed port on 127.0.0.1, and real PostgreSQL."""

from __future__ import annotations

import json
import logging
import socket

import outbox
from outbox.cli import main
from outbox.testing.delivery import deliver

from .reconciler.support import DEST, get, write_rows

SECRET = "s3cr3tVALUE"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_names_its_cause_in_the_row_show_and_the_log(clean, engine, db, caplog, capsys):
    port = closed_port()
    url = f"http://ops:{SECRET}@127.0.0.1:{port}/v1/charges?api_key={SECRET}"

    @outbox.handler(DEST, time_limit=5, max_attempts=3, backoff=(30, 60))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(url, json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    [row] = write_rows(engine, 1)
    # A pending run is a DEBUG line (the INFO line is the worker's sum of its runs).
    with caplog.at_level(logging.DEBUG, logger="outbox"):
        assert deliver({DEST: charge}, database_url=clean.database_url) == {row: "pending"}

    cause = f"127.0.0.1:{port}: [Errno 111] Connection refused"
    expected = f"ConnectError: the request did not reach the provider ({cause})"
    assert get(db, row)["last_error"] == expected

    code = main(["show", str(row), "--json", "--database-url", clean.database_url])
    out, _ = capsys.readouterr()
    assert code == 0
    [attempt] = json.loads(out)["attempts"]
    assert attempt["error"] == expected
    code = main(["show", str(row), "--database-url", clean.database_url])
    out, _ = capsys.readouterr()
    assert code == 0 and cause in out

    [record] = [r for r in caplog.records if "-> pending (attempt 1)" in r.getMessage()]
    line = record.getMessage()
    assert record.levelno == logging.DEBUG and line.endswith(expected)
    for text in (get(db, row)["last_error"], out, *(r.getMessage() for r in caplog.records)):
        assert (
            SECRET not in text and "ops:" not in text and "/v1/charges" not in text and "api_key" not in text
        )
