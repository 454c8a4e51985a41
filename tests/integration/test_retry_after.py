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
