"""Through PgBouncer in transaction mode (tests/pgbouncer.py): consecutive transactions of one
client may run on different backends, and one backend serves many clients. The worker's claims,
records and heartbeat and the relay's takes go through it; LISTEN and the failover guard go to
PostgreSQL itself. A claim whose reply was lost is fenced by its token, not by ending a backend."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import destination_states, sql, wait_for, worker_thread, write_rows

import outbox
from outbox import store
from outbox.consumer import LOCK_WAIT_MS, Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.relay import Relay
from outbox.settings import libpq_url
from outbox.testing.pgbouncer import MISSING, PGBOUNCER, pgbouncer

pytestmark = pytest.mark.skipif(PGBOUNCER is None, reason=MISSING)

#: Server connections PgBouncer may open to the test database: fewer than the deliveries the
#: tests run at once, so that clients share backends transaction by transaction.
POOL_SIZE = 2


@pytest.fixture
def pooled_url(clean: Any) -> Iterator[str]:
    with pgbouncer(clean.database_url, pool_size=POOL_SIZE) as url:
        yield url


def relay_through(services: Any, pooled_url: str) -> int:
    relay = Relay(
        database_url=pooled_url,
        direct_database_url=services.database_url,
        pooled=True,
        redis_url=services.redis_url,
        namespace=services.namespace,
    )
    try:
        return relay.drain()
    finally:
        relay.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_delivers_every_row_once_through_the_pooler(clean, engine, pooled_url, kind):
    """Twenty deliveries at once over two server connections: every row sent once. Each claim
    statement runs far more than psycopg's five executions before it prepares a statement on
    the server; a statement prepared on one backend is unknown on the next, so this fails unless
    pooled connections never prepare. PgBouncer refuses startup options: the lock wait is set
    inside the statements."""
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            calls[key] = calls.get(key, 0) + 1

    if kind == "sync":

        @outbox.handler("payments.charge", time_limit=10)
        def charge(d: outbox.Delivery) -> outbox.Confirmed:
            count(d.key)
            time.sleep(0.02)
            return outbox.Confirmed(ref=f"ch_{d.payload['i']}")

    else:

        @outbox.handler("payments.charge", time_limit=10)
        async def charge_async(d: outbox.Delivery) -> outbox.Confirmed:
            import asyncio

            count(d.key)
            await asyncio.sleep(0.02)
            return outbox.Confirmed(ref=f"ch_{d.payload['i']}")

    write_rows(engine, "payments.charge", 300)
    assert relay_through(clean, pooled_url) == 300
    with worker_thread(
        clean,
        threads=20,
        database_url=pooled_url,
        direct_database_url=clean.database_url,
        pooled=True,
    ):
        wait_for(
            lambda: destination_states(clean, "payments.charge").get("sent") == 300, 90, "every row sent"
        )
    assert len(calls) == 300 and set(calls.values()) == {1}
    (attempts,) = sql(clean, "SELECT count(*), count(*) FILTER (WHERE outcome = 'sent') FROM outbox_attempt")
    assert attempts == (300, 300)


def test_the_lock_wait_holds_through_the_pooler_and_stays_in_its_transaction(clean, engine, pooled_url):
    """A claim through the pooler on a row another transaction holds is refused after the lock
    wait (not held until the lock goes), and the setting does not outlive its transaction on
    the backend that the next client gets."""
    write_rows(engine, "payments.charge", 1)
    ((row_id,),) = sql(clean, "SELECT id FROM outbox_message")
    with psycopg.connect(libpq_url(clean.database_url)) as holder:
        holder.execute("SELECT 1 FROM outbox_message WHERE id = %s FOR UPDATE", (row_id,))
        with psycopg.connect(libpq_url(pooled_url), autocommit=True, prepare_threshold=None) as conn:
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                store.delivery.claim(
                    conn, row_id=row_id, destination="payments.charge", lease_seconds=30, token=uuid.uuid4()
                )
            waited = time.monotonic() - started
            assert LOCK_WAIT_MS / 1000 * 0.9 <= waited < 5
            # Both server connections of the pool: neither kept the claim's lock wait.
            for _ in range(2 * POOL_SIZE):
                assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
        holder.rollback()
    assert sql(clean, "SELECT state, attempts FROM outbox_message") == [("pending", 0)]


def _claim(conn: psycopg.Connection[Any], row_id: int, token: uuid.UUID) -> Any:
    return store.delivery.claim(
        conn, row_id=row_id, destination="payments.charge", lease_seconds=30, token=token
    )


def test_a_fenced_claim_that_arrives_late_can_never_commit(clean, engine):
    """The claim's reply was lost before the claim ran (queued in a pooler): the worker fences
    its token; when the claim finally runs it rolls back whole, and the row is untouched."""
    write_rows(engine, "payments.charge", 1)
    ((row_id,),) = sql(clean, "SELECT id FROM outbox_message")
    token = uuid.uuid4()
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.fence_lost_claim(conn, row_id=row_id, token=token) is True
        # Asked again (the fence's own reply lost): still fenced, one fence row.
        assert store.delivery.fence_lost_claim(conn, row_id=row_id, token=token) is True
        with pytest.raises(psycopg.errors.UniqueViolation):
            _claim(conn, row_id, token)
    assert sql(clean, "SELECT state, attempts, claim_token FROM outbox_message") == [("pending", 0, None)]
    assert sql(clean, "SELECT attempt, outcome FROM outbox_attempt") == [(0, "released")]
    # The row is claimed and delivered by the next claim as if nothing happened.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert _claim(conn, row_id, uuid.uuid4()) is not None
    assert sql(clean, "SELECT state, attempts FROM outbox_message") == [("in_flight", 1)]


def test_the_fence_waits_for_a_running_claim_and_then_says_whether_it_committed(clean, engine):
    write_rows(engine, "payments.charge", 2)
    first, second = (r for (r,) in sql(clean, "SELECT id FROM outbox_message ORDER BY id"))
    for row_id, end in ((first, "commit"), (second, "rollback")):
        token = uuid.uuid4()
        with psycopg.connect(libpq_url(clean.database_url)) as claiming:
            assert _claim(claiming, row_id, token) is not None  # inside an open transaction
            with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
                # Still running: the fence is refused after the lock wait, and tried again.
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    store.delivery.fence_lost_claim(conn, row_id=row_id, token=token)
                getattr(claiming, end)()
                fenced = store.delivery.fence_lost_claim(conn, row_id=row_id, token=token)
        assert fenced is (end == "rollback")
    assert sql(clean, "SELECT id, state, attempts FROM outbox_message ORDER BY id") == [
        (first, "in_flight", 1),
        (second, "pending", 0),
    ]


def test_any_error_of_a_pooled_claim_is_a_lost_reply(clean, engine, pooled_url, monkeypatch):
    """Through a pooler the connection may look alive after an error that was the pooler's
    (the claim sent on, or still queued): the worker fences the claim instead of raising."""

    @outbox.handler("payments.charge", time_limit=10)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("no call may be made for a claim whose reply was lost")

    write_rows(engine, "payments.charge", 1)
    ((row_id,),) = sql(clean, "SELECT id FROM outbox_message")
    real_claim = store.delivery.claim
    tokens: list[uuid.UUID] = []

    def claim_then_pooler_error(conn: Any, **kw: Any) -> Any:
        tokens.append(kw["token"])
        real_claim(conn, **kw)  # committed: the pooler's error came after
        raise psycopg.OperationalError("query_wait_timeout (simulated pooler error)")

    monkeypatch.setattr(store.delivery, "claim", claim_then_pooler_error)
    deliverer = Deliverer(pooled_url, registry(), pooled=True)
    try:
        assert deliverer.deliver(row_id, "payments.charge") is DeliveryResult.RELEASED
    finally:
        deliverer.close()
    assert sql(clean, "SELECT state, attempts, releases FROM outbox_message") == [("pending", 0, 1)]
    assert sql(clean, "SELECT claim_token, outcome FROM outbox_attempt") == [(tokens[0], "released")]


def test_a_lost_claims_fence_row_is_no_call_for_cancel_or_the_audit(clean, engine):
    """A fence row (attempt 0) marks a claim that never committed: the row was never called, so
    the application may still cancel it, and a fence written after a real call (a duplicate
    message whose claim's reply was lost on a row already sent) is no second call for the audit."""
    from sqlalchemy.orm import Session

    from outbox.ops.audit import audit

    write_rows(engine, "payments.charge", 2)
    fenced, charged = (r for (r,) in sql(clean, "SELECT id FROM outbox_message ORDER BY id"))
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.fence_lost_claim(conn, row_id=fenced, token=uuid.uuid4()) is True
        token = uuid.uuid4()
        claimed = _claim(conn, charged, token)
        assert claimed is not None
        # Recorded as sent (the record's own statement needs its whole decision; its effect here).
        conn.execute(
            "UPDATE outbox_message SET state = 'sent', completed_at = now(), provider_ref = 'ch_1' "
            "WHERE id = %s",
            (charged,),
        )
        conn.execute(
            "UPDATE outbox_attempt SET outcome = 'sent', finished_at = now() WHERE claim_token = %s", (token,)
        )
        # A duplicate message of the sent row: its claim's reply lost, the worker fences it.
        assert store.delivery.fence_lost_claim(conn, row_id=charged, token=uuid.uuid4()) is True
    with engine.connect() as conn:
        report = audit(conn)
    assert report.totals.violations == 0 and report.violations == [], report
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="payments.charge:0", step="send") is True
    assert sql(clean, "SELECT id, state FROM outbox_message ORDER BY id") == [
        (fenced, "cancelled"),
        (charged, "sent"),
    ]


def test_the_fence_of_a_row_that_is_gone_says_fenced(clean, engine):
    write_rows(engine, "payments.charge", 1)
    ((row_id,),) = sql(clean, "SELECT id FROM outbox_message")
    sql(clean, "DELETE FROM outbox_message")
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.fence_lost_claim(conn, row_id=row_id, token=uuid.uuid4()) is True


def test_the_aftercare_statements_wait_no_longer_than_the_claim_for_a_destination_row(clean, pooled_url):
    """A breaker's count and a Retry-After hold on a destination row another transaction holds
    (an operator's pause in a slow transaction): refused after the lock wait, as on a direct
    connection, instead of holding one of the pooler's few server connections until the lock
    goes (every destination's deliveries wait for those)."""
    sql(clean, "INSERT INTO outbox_destination (destination) VALUES ('payments.charge')")
    count = {"destination": "payments.charge", "threshold": 5, "open": 10.0, "window": 60.0, "reason": "503"}
    hold = {"destination": "payments.charge", "seconds": 30.0, "by": "worker", "reason": "Retry-After"}
    with psycopg.connect(libpq_url(clean.database_url)) as holder:
        holder.execute("SELECT 1 FROM outbox_destination WHERE destination = 'payments.charge' FOR UPDATE")
        with psycopg.connect(libpq_url(pooled_url), autocommit=True, prepare_threshold=None) as conn:
            for statement in (
                lambda: store.delivery.count_breaker_failure(conn, count),
                lambda: store.delivery.hold_destination(conn, hold),
            ):
                started = time.monotonic()
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    statement()
                assert time.monotonic() - started < 5
        holder.rollback()
