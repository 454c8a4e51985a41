"""A provider's (or a handler's) text in the worker's and the reconciler's WARNING lines is cut to
``outbox.logs.MAX_PROVIDER_TEXT_CHARS`` characters, card numbers masked: such a text often
echoes the request, and log lines travel further than the row (which keeps its own bounded,
sanitised copy for `outbox show`). Real PostgreSQL."""

from __future__ import annotations

import logging

import outbox
from outbox.consumer import DeliveryResult
from outbox.logs import MAX_PROVIDER_TEXT_CHARS
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown

from .reconciler.support import DEST, get, make_unknown, write_rows

# Long, echoing the request, with a card number in it; past every bound.
ECHO = "declined: " + '{"email": "alice@example.com", "card": "4111 1111 1111 1111"} ' * 60


def provider_text_of(record: logging.LogRecord, prefix: str) -> str:
    message = record.getMessage()
    assert message.startswith(prefix), message
    return message[len(prefix) :]


def test_the_outcome_line_of_a_delivery_carries_a_capped_provider_text(clean, engine, consumer, caplog):
    @outbox.handler(DEST, time_limit=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise outbox.PermanentError(ECHO)

    (row_id,) = write_rows(engine, 1)
    with caplog.at_level(logging.INFO, logger="outbox"):
        assert consumer().deliver(row_id, DEST) is DeliveryResult.FAILED
    [line] = [r for r in caplog.records if r.getMessage().startswith("outbox order:0:charge -> failed")]
    assert line.levelno == logging.WARNING
    said = provider_text_of(line, "outbox order:0:charge -> failed (attempt 1): ")
    assert len(said) == MAX_PROVIDER_TEXT_CHARS and said.endswith("…")
    assert said.startswith('declined: {"email": "alice@example.com", "card": "[card ****1111]"}')
    # The row keeps more of it, for `outbox show`.
    assert len(get_row_error(clean, row_id)) > MAX_PROVIDER_TEXT_CHARS


def get_row_error(services, row_id: int) -> str:
    import psycopg

    from outbox.settings import libpq_url

    with psycopg.connect(libpq_url(services.database_url)) as conn:
        (error,) = conn.execute("SELECT last_error FROM outbox_message WHERE id = %s", (row_id,)).fetchone()
    return str(error)


def test_the_reconciler_line_of_a_failed_lookup_carries_a_capped_text(clean, engine, db, caplog):
    @outbox.handler(DEST, time_limit=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("not called")

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        raise RuntimeError(ECHO)

    (row_id,) = write_rows(engine, 1)
    make_unknown(db, row_id)
    with caplog.at_level(logging.WARNING, logger="outbox.reconciler"):
        assert resolve_unknown(db, {DEST: charge}) == {"lookup_failed": 1}
    [line] = [r for r in caplog.records if r.getMessage().startswith("outbox order:0:charge on ")]
    assert line.levelno == logging.WARNING
    said = provider_text_of(line, f"outbox order:0:charge on {DEST}: ")
    assert len(said) == MAX_PROVIDER_TEXT_CHARS and said.startswith("lookup failed: RuntimeError")
    assert "4111 1111 1111 1111" not in said
    assert len(get(db, row_id)["last_error"]) > MAX_PROVIDER_TEXT_CHARS
