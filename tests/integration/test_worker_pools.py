"""A worker's threads share a few claim and record connections (outbox.consumer): rows the
application keeps locked hold the threads that want them, never the pools every other thread
shares, and a worker's connections stay few whatever its concurrency."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from helpers import destination_states, relay_once, sql, wait_for, worker_thread, write_rows

import outbox
from outbox import consumer
from outbox.settings import libpq_url


def declare(provider: Any) -> None:
    for destination in ("payments.charge", "mail.send"):

        @outbox.handler(destination, time_limit=2, backoff=(1,))
        def send(d: outbox.Delivery) -> outbox.Confirmed:
            r = d.http.post(
                f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
            r.raise_for_status()
            return outbox.Confirmed(ref=r.json()["id"])


@pytest.mark.timeout(90)
def test_rows_locked_by_the_application_hold_their_threads_not_the_pools(clean, engine, provider, caplog):
    """More rows locked than the worker has claim connections: every other row is still
    delivered while the locks are held, and the locked ones once they are released. (With a
    claim waiting on a lock while it held one of three shared connections, three locked rows
    stopped every delivery of the process.)"""
    declare(provider)
    write_rows(engine, "payments.charge", 4)
    relay_once(clean)
    locker = psycopg.connect(libpq_url(clean.database_url))
    try:
        locked = locker.execute(
            "SELECT id FROM outbox_message WHERE destination = 'payments.charge' FOR UPDATE"
        ).fetchall()
        assert len(locked) == 4
        with worker_thread(clean, threads=8), caplog.at_level(logging.WARNING, logger="outbox.consumer"):
            write_rows(engine, "mail.send", 40)
            relay_once(clean)
            wait_for(
                lambda: destination_states(clean, "mail.send") == {"sent": 40},
                30,
                "the unlocked rows to be sent",
            )
            assert destination_states(clean, "payments.charge") == {"dispatched": 4}
            # Waiting for the locks, the four claims hold no connection: the pools are free.
            waiting = sql(
                clean,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'",
            )[0][0]
            assert waiting <= 4
            locker.rollback()
            wait_for(
                lambda: destination_states(clean, "payments.charge") == {"sent": 4},
                30,
                "the locked rows to be sent",
            )
    finally:
        locker.close()
    assert provider.stats()["double_charged"] == []
    assert provider.charges() == 44


def test_a_worker_holds_few_connections_whatever_its_concurrency(clean, engine, provider):
    declare(provider)
    write_rows(engine, "mail.send", 200)
    mine = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    before = {pid for (pid,) in sql(clean, mine)}
    with worker_thread(clean, threads=64):
        relay_once(clean)
        peak = 0

        def sent() -> bool:
            nonlocal peak
            rows = sql(clean, mine)
            peak = max(peak, len({pid for (pid,) in rows} - before))
            return destination_states(clean, "mail.send") == {"sent": 200}

        wait_for(sent, 60, "200 rows to be sent", every=0.02)
    # 2 claim + 4 record connections, the heartbeat and the failover guard.
    expected = consumer.Deliverer.__init__.__kwdefaults__
    assert expected["claim_connections"] + expected["record_connections"] == 6
    assert peak <= 8, peak
