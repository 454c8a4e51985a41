"""Issue 9 class 12: a relay, worker or reconciler that finds the database on another history
(system identifier or timeline changed: a failover, a restore) stops until an operator accepts.
The shared server cannot fail over, so the recorded identity is changed instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import published_row_ids, relay_once, sql
from sqlalchemy.orm import Session

import outbox
from outbox import cli, failover, store, transport
from outbox.consumer import Deliverer, DeliveryResult
from outbox.failover import FailoverGuard
from outbox.handlers import close_http_clients, registry
from outbox.reconciler import Reconciler
from outbox.relay import Relay
from outbox.settings import libpq_url

DEST = "payments.charge"


@pytest.fixture
def guard(clean: Any) -> Iterator[FailoverGuard]:
    sql(clean, "DELETE FROM outbox_db_identity")
    g = FailoverGuard(clean.database_url, process="test", interval_seconds=3600)
    yield g
    g.stop()
    # Other tests (and the worker threads they start) check against the server as it is.
    sql(clean, "DELETE FROM outbox_db_identity")


def server_identity(services: Any) -> failover.Identity:
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        identity, problems = failover.read_identity(conn)
    assert problems == [], problems  # PostgreSQL 15/16 let any role read both by default
    return identity


def write(engine: Any, n: int) -> list[int]:
    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"ch_{d.id}")

    with Session(engine) as s, s.begin():
        return [
            outbox.write(s, key=f"order:{i}", step="charge", destination=DEST, payload={}).id
            for i in range(n)
        ]


def test_first_check_records_the_identity_and_a_later_one_agrees(clean: Any, guard: FailoverGuard) -> None:
    assert guard.check_now() is False
    current = server_identity(clean)
    assert current.system_identifier and current.timeline
    recorded = sql(clean, "SELECT system_identifier, timeline, mismatch FROM outbox_db_identity")
    assert recorded == [(current.system_identifier, current.timeline, None)]
    assert guard.check_now() is False


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE outbox_db_identity SET timeline = timeline - 1",  # a promotion, a PITR
        "UPDATE outbox_db_identity SET system_identifier = '123'",  # another cluster
    ],
)
def test_a_changed_identity_stops_relay_worker_and_reconciler_until_accepted(
    clean: Any, engine: Any, guard: FailoverGuard, redis_client: Any, capsys: Any, change: str
) -> None:
    ids = write(engine, 3)
    assert guard.check_now() is False
    relay_once(clean)  # row ids[0..2] dispatched before the "failover"
    sql(clean, change)
    # The restored database lost the dispatch of ids[2]: pending again, as the relay's own undo
    # leaves a row whose publication failed.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        store.relay.undispatch(db, ids=[ids[2]], retry_after_seconds=0, error="refused")
    # Every queued message lost; the database OUTBOX_TEST_REDIS_URL names may hold others' keys.
    transport.delete_namespace(redis_client, clean.namespace)

    assert guard.check_now() is True
    assert sql(
        clean, "SELECT mismatch IS NOT NULL, mismatch_seen_at IS NOT NULL FROM outbox_db_identity"
    ) == [(True, True)]

    # The worker claims nothing: no attempt row, no call, the row stays as it was.
    consumer = Deliverer(clean.database_url, registry(), failover_guard=guard)
    try:
        assert consumer.deliver(ids[0], DEST) is DeliveryResult.HALTED
    finally:
        consumer.close()
        close_http_clients()
    assert sql(clean, "SELECT count(*) FROM outbox_attempt") == [(0,)]
    # The relay publishes nothing.
    relay = Relay(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        failover_guard=guard,
    )
    try:
        assert relay.drain() == 0
    finally:
        relay.close()
    assert published_row_ids(redis_client, clean.namespace, [DEST]) == []
    # The reconciler runs no job.
    with Reconciler(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        handlers=registry(),
        module="tests",
        namespace=clean.namespace,
        failover_guard=guard,
    ) as reconciler:
        assert set(map(str, reconciler.run_once().values())) == {"{'halted_by_failover': 1}"}

    # The operator sees it, and must say why accepting is safe.
    assert cli.main(["failover", "--database-url", clean.database_url]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert cli.main(["failover", "--database-url", clean.database_url, "--json"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["same"] is False and shown["differences"]
    assert shown["error"]["exit_code"] == 1 and "identity changed" in shown["error"]["message"]
    assert cli.main(["failover", "--database-url", clean.database_url, "--accept"]) == 2
    assert (
        cli.main(["failover", "--database-url", clean.database_url, "--accept", "--reason", "checked"]) == 0
    )
    assert "accepted" in capsys.readouterr().out

    assert guard.check_now() is False
    assert cli.main(["failover", "--database-url", clean.database_url]) == 0
    assert sql(clean, "SELECT note, mismatch FROM outbox_db_identity") == [("checked", None)]
    assert relay_once(clean) == 1  # the pending row goes out again
    consumer = Deliverer(clean.database_url, registry(), failover_guard=guard)
    try:
        assert consumer.deliver(ids[2], DEST) is DeliveryResult.SENT
    finally:
        consumer.close()
        close_http_clients()


def test_a_new_connection_is_checked_before_its_first_claim_or_batch(
    clean: Any, engine: Any, guard: FailoverGuard
) -> None:
    ids = write(engine, 1)
    assert guard.check_now() is False
    # A failover breaks every connection; the periodic check (an hour away here) is not awaited.
    sql(clean, "UPDATE outbox_db_identity SET timeline = timeline + 1")
    relay = Relay(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        failover_guard=guard,
    )
    try:
        assert relay.drain() == 0
    finally:
        relay.close()
    assert guard.halted
    # Dispatched by a relay that had not noticed yet.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        assert [r[0] for r in store.relay.dispatch_due(db, limit=1)] == [ids[0]]
    consumer = Deliverer(clean.database_url, registry(), failover_guard=guard)
    try:
        assert consumer.deliver(ids[0], DEST) is DeliveryResult.HALTED
    finally:
        consumer.close()
        close_http_clients()
    assert sql(clean, "SELECT state, attempts FROM outbox_message") == [("dispatched", 0)]


def test_processes_recording_the_identity_at_once_both_start(clean: Any) -> None:
    """The relay, a worker and the reconciler start together on a fresh database (the demo): one
    records the identity row; the other's INSERT waits for that commit and conflicts, and its
    statement's snapshot predates the row. It must read the row, not crash (it did: "unexpected
    AssertionError" from `outbox relay`)."""
    import threading

    sql(clean, "DELETE FROM outbox_db_identity")
    url = libpq_url(clean.database_url)
    with psycopg.connect(url) as first, psycopg.connect(url, autocommit=True) as second:
        identity, _ = failover.read_identity(first)
        params = {"sysid": identity.system_identifier, "timeline": identity.timeline, "by": "first"}
        assert store.processes.record_identity(first, params) is not None  # not committed yet
        verdicts: list[Any] = []
        errors: list[BaseException] = []

        def check() -> None:
            try:
                verdicts.append(failover.check(second, process="second"))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=check)
        thread.start()
        # The second check is waiting on the first one's uncommitted row.
        wait = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        for _ in range(200):
            if sql(clean, wait)[0][0] >= 1:
                break
            threading.Event().wait(0.02)
        first.commit()
        thread.join(10)
    assert errors == [] and len(verdicts) == 1
    assert verdicts[0].ok and verdicts[0].recorded == identity
