"""Retry-After honoured to the second, on the database's clock (issue 13 part 2): the provider
simulator answers 503 with a Retry-After (seconds, or an HTTP date against its own Date header)
and the row is due again exactly that much later; a Retry-After past the row's deadline fails it.
Real PostgreSQL and the simulator on 127.0.0.1, through the worker's own delivery."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import outbox
from outbox.testing.delivery import deliver

from .reconciler.support import DEST, get, write_rows


def due_in(db: Any, row_id: int) -> float:
    return float(
        db.execute(
            "SELECT EXTRACT(EPOCH FROM available_at - now()) FROM outbox_message WHERE id = %s", (row_id,)
        ).fetchone()[0]
    )


def charge_handler(provider: Any, *, raise_own: bool = False) -> Any:
    @outbox.handler(DEST, time_limit=5, max_attempts=3, backoff=(2, 2))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if raise_own and r.status_code == 503:
            raise outbox.RetryableError("provider busy")  # its own error: the header is noted anyway
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


@pytest.mark.parametrize(
    ("retry_after", "raise_own", "expected"),
    [("120", False, 120), ("+90", False, 90), ("45", True, 45), ("1", False, 2)],
    ids=["seconds", "http-date", "handler-raises-its-own-error", "backoff-is-longer"],
)
def test_a_503_with_retry_after_is_retried_no_earlier_than_it_says(
    clean, engine, db, provider, retry_after, raise_own, expected
):
    charge = charge_handler(provider, raise_own=raise_own)
    [row] = write_rows(engine, 1)
    provider.unavailable(times=1, retry_after=retry_after)
    assert deliver({DEST: charge}, database_url=clean.database_url)[row] == "pending"
    # The delay is added to the database's now() by the record; allow for the statement's own time.
    assert expected - 1.5 <= due_in(db, row) <= expected, due_in(db, row)
    moved = get(db, row)
    assert (moved["attempts"] == 1 and "503" in moved["last_error"]) or "busy" in moved["last_error"]
    assert provider.charges() == 0


def test_a_retry_after_past_the_deadline_fails_the_row(clean, engine, db, provider):
    charge = charge_handler(provider)
    [row] = write_rows(engine, 1, deadline=datetime.now(UTC) + timedelta(seconds=60))
    provider.unavailable(times=1, retry_after="120")
    assert deliver({DEST: charge}, database_url=clean.database_url)[row] == "failed"
    assert "deadline" in get(db, row)["last_error"]
    assert provider.charges() == 0


def test_a_destination_wide_retry_after_pauses_the_destination_that_long(clean, engine, db, provider):
    """retry_after_scope="destination": the provider's Retry-After holds every row back, not
    only the one that got it; an operator's longer pause is never shortened."""
    from outbox import pauses
    from outbox.consumer import DeliveryResult

    @outbox.handler(DEST, time_limit=5, backoff=(2, 2), retry_after_scope="destination")
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        headers = {"Idempotency-Key": d.idempotency_key}
        r = d.http.post(f"{provider.url}/charges", json=d.payload, headers=headers)
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    first, second = write_rows(engine, 2)
    provider.unavailable(times=1, retry_after="60")
    results = deliver({DEST: charge}, database_url=clean.database_url)
    assert results == {first: DeliveryResult.PENDING, second: DeliveryResult.PAUSED}
    assert provider.stats()["requests"] == 1, "the second row was not called"
    with engine.connect() as conn:
        [held] = pauses.paused(conn)
    assert held.by is not None and held.by.startswith("worker ") and "Retry-After 60 s" in (held.reason or "")
    left = db.execute("SELECT EXTRACT(EPOCH FROM paused_until - now()) FROM outbox_destination").fetchone()[0]
    assert 58.5 <= float(left) <= 60

    # An operator's indefinite pause stays indefinite, with its reason.
    with engine.begin() as conn:
        pauses.pause(conn, DEST, by="ana", reason="incident INC-7")
    with db.transaction():
        assert not pauses.hold(db, DEST, seconds=30, by="worker x", reason="Retry-After 30 s")
    with engine.connect() as conn:
        [kept] = pauses.paused(conn)
    assert kept.until is None and kept.reason == "incident INC-7"


def test_a_retry_after_scope_must_be_row_or_destination():
    with pytest.raises(outbox.ConfigError, match="retry_after_scope must be 'row' or 'destination'"):
        outbox.handler("payments.refund", retry_after_scope="everyone")
