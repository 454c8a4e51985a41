"""Attacks on the efficiency changes of issue 17 (relay take ended by commit()/rollback(), NOTIFYs
read from libpq, the 7 ms gathering window, Statement on a cached RawCursor, the pre-packed ack,
migration 0021's unique index built CONCURRENTLY, the call thread's lock, warmed threads).

A test marked xfail(strict=True) is a proven break: it fails today for the reason it names."""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
import redis
from databases import fresh_database
from helpers import ids_by_state, sql, wait_for
from psycopg import pq

import outbox
from outbox import db as outbox_db
from outbox import transitions, transport
from outbox.consumer import Executor, RunResult
from outbox.db import make_engine
from outbox.handlers import registry
from outbox.migrate import upgrade
from outbox.settings import libpq_url
from outbox.transport import Broker
from relay import Relay
from relay import relay as relay_module

pytestmark = pytest.mark.timeout(120)

DEST = "payments.charge"
NEW_INDEX = "outbox_message_key_step_pattern_idx"

# What outbox.write sends (outbox.transitions._INSERT), in positional form for the raw pgconn.
_WRITE_SQL = (
    b"INSERT INTO outbox_message (key, step, destination, payload) "
    b"VALUES ($1, 'charge', 'payments.charge', '{}'::jsonb) "
    b"ON CONFLICT (key, step) DO NOTHING RETURNING id"
)


def _index_state(conn: psycopg.Connection[Any], name: str) -> tuple[bool, bool] | None:
    row = conn.execute(
        "SELECT i.indisready, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE c.relname = %s",
        (name,),
    ).fetchone()
    return (bool(row[0]), bool(row[1])) if row else None


def _send(conn: psycopg.Connection[Any], key: str) -> None:
    pgconn = conn.pgconn
    pgconn.send_query_params(_WRITE_SQL, [key.encode()])
    while pgconn.flush():
        time.sleep(0)


def _errors(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    found = []
    while (res := conn.pgconn.get_result()) is not None:
        if res.status == pq.ExecStatus.FATAL_ERROR:
            state = (res.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
            found.append((state, res.get_error_message().strip()))
    return found


def _hammer(a: psycopg.Connection[Any], b: psycopg.Connection[Any], tag: str, seconds: float) -> list[Any]:
    """Two sessions write the same new (key, step) at the same instant, key after key, as two
    application transactions retrying one business operation would: the second must be a no-op
    (ON CONFLICT DO NOTHING), never an error. Stops at the first error."""
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        key = f"{tag}:{i}"
        i += 1
        first, second = (a, b) if i % 2 else (b, a)
        _send(first, key)
        _send(second, key)
        problems = _errors(first) + _errors(second)
        if problems:
            return [(key, i, problems)]
    return []


# == migration 0021: the unique index is built CONCURRENTLY next to the constraint =================


@pytest.mark.xfail(
    strict=True,
    reason="migration 0021 builds a second UNIQUE index on (key, step) CONCURRENTLY; while it is "
    "ready but not yet valid it is not an ON CONFLICT arbiter yet enforces uniqueness, so two "
    "concurrent writes of the same (key, step) raise UniqueViolation instead of the no-op",
)
def test_zz17_same_key_written_twice_during_0021_build_is_a_no_op_not_an_error(services) -> None:
    with fresh_database(services.database_url) as url:
        engine = make_engine(url)
        lib = libpq_url(url)
        # A long read (a report, a backup's snapshot) open when `outbox migrate` runs: CREATE
        # INDEX CONCURRENTLY waits for it in its last phase, its index ready but not valid.
        reader = psycopg.connect(lib)
        a = psycopg.connect(lib, autocommit=True)
        b = psycopg.connect(lib, autocommit=True)
        migration_errors: list[BaseException] = []
        thread = None
        try:
            upgrade(engine, "0020")
            # Control: at 0020 (the constraint alone) the same race is a no-op every time.
            assert _hammer(a, b, "before", 1.5) == []
            reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            reader.execute("SELECT count(*) FROM outbox_key_ledger").fetchone()

            def run() -> None:
                try:
                    upgrade(engine)
                except BaseException as exc:  # reported below
                    migration_errors.append(exc)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            with psycopg.connect(lib, autocommit=True) as admin:
                wait_for(
                    lambda: _index_state(admin, NEW_INDEX) == (True, False),
                    30,
                    "0021's index to be ready and not yet valid",
                )
            found = _hammer(a, b, "during", 12)
            reader.rollback()
            thread.join(60)
            # After the swap: still one row per (key, step), ON CONFLICT still a no-op.
            assert _hammer(a, b, "after", 1.0) == []
            dups = a.execute(
                "SELECT key, step, count(*) FROM outbox_message GROUP BY 1, 2 HAVING count(*) > 1"
            ).fetchall()
            assert dups == [], dups
        finally:
            reader.rollback()
            reader.close()
            if thread is not None:
                thread.join(60)
            a.close()
            b.close()
            engine.dispose()
        assert not migration_errors, migration_errors
        assert found == [], f"a duplicate write raised during the migration: {found}"


# == relay: wake-ups under the 7 ms gathering window, libpq NOTIFY reads ===========================


def test_zz17_rows_committed_at_any_moment_are_taken_long_before_the_poll(clean, redis_client) -> None:
    """A running relay (default gathering window, a 30 s fallback poll): rows committed one by
    one at random moments, alone or in bursts, while it takes, gathers, waits. Each must go out
    promptly: a lost wake-up would leave a row for the 30 s poll."""
    relay = Relay(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        poll_interval_seconds=30,
    )
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
    thread.start()
    rng = random.Random(17)
    late: list[tuple[int, float]] = []
    try:
        wait_for(lambda: relay._listen is not None, 10, "the relay to LISTEN")
        with psycopg.connect(libpq_url(clean.database_url)) as conn:
            for i in range(120):
                (row_id,) = conn.execute(
                    "INSERT INTO outbox_message (key, step, destination, payload) "
                    "VALUES (%s, 'charge', %s, '{}') RETURNING id",
                    (f"wake:{i}", DEST),
                ).fetchone()
                conn.commit()
                time.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.005, 0.007, 0.008, 0.02]))
        # Every row out within 2 s of the last commit (the poll is 30 s away).
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and ids_by_state(clean).get("pending"):
            time.sleep(0.02)
        pending = ids_by_state(clean).get("pending", set())
        late = [(p, 0.0) for p in sorted(pending)]
    finally:
        stop.set()
        thread.join(10)
    assert not late, f"rows left pending for the fallback poll: {late}"
    assert ids_by_state(clean).keys() == {"dispatched"}
    published = [int(x) for x in _published(redis_client, clean.namespace)]
    assert sorted(set(published)) == sorted(published), "a row published twice in a clean run"


def _published(client: redis.Redis, namespace: str) -> list[int]:
    from helpers import published_row_ids

    return published_row_ids(client, namespace, [DEST])


def test_zz17_a_failed_publish_rolls_the_take_back_and_the_connection_stays_usable(
    clean, redis_client, monkeypatch
) -> None:
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "SELECT 'p:' || g, 'charge', %s, '{}' FROM generate_series(1, 5) g",
        (DEST,),
    )
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    real = transport.publish_batch
    try:

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise redis.ConnectionError("attack: Redis went away mid-publish")

        monkeypatch.setattr(transport, "publish_batch", refuse)
        with pytest.raises(redis.ConnectionError):
            relay.run_once()
        assert ids_by_state(clean) == {"pending": {1, 2, 3, 4, 5}}
        # Not left idle in transaction holding the rows' locks.
        assert relay._conn is not None and relay._conn.info.transaction_status == pq.TransactionStatus.IDLE
        monkeypatch.setattr(transport, "publish_batch", real)
        assert relay.run_once().published == 5
        assert relay._conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert ids_by_state(clean) == {"dispatched": {1, 2, 3, 4, 5}}
    finally:
        relay.close()


def test_zz17_a_connection_killed_between_publish_and_commit_leaves_rows_pending(
    clean, redis_client, monkeypatch
) -> None:
    """Published, then the take's backend dies before COMMIT: the rows must be pending (published
    again later; the claim makes the duplicate harmless), never dispatched without a publish."""
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "SELECT 'k:' || g, 'charge', %s, '{}' FROM generate_series(1, 3) g",
        (DEST,),
    )
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    real = transport.publish_batch
    try:

        def publish_then_kill(client: Any, namespace: str, rows: Any) -> Any:
            out = real(client, namespace, rows)
            pid = relay._conn.info.backend_pid  # type: ignore[union-attr]
            sql(clean, "SELECT pg_terminate_backend(%s)", (pid,))
            wait_for(
                lambda: not sql(clean, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)),
                5,
                "the take's backend to go",
            )
            return out

        monkeypatch.setattr(transport, "publish_batch", publish_then_kill)
        with pytest.raises(psycopg.OperationalError):
            relay.run_once()
        assert ids_by_state(clean) == {"pending": {1, 2, 3}}
        assert relay._conn is None
        monkeypatch.setattr(transport, "publish_batch", real)
        assert relay.run_once().published == 3
        assert ids_by_state(clean) == {"dispatched": {1, 2, 3}}
    finally:
        relay.close()


def test_zz17_the_listen_connection_killed_is_noticed_and_rows_still_go_out(clean, redis_client) -> None:
    """_read_notifies reads libpq directly: a LISTEN backend terminated by the server must be
    seen as broken (not an endless silent wait), and rows committed meanwhile still go out."""
    relay = Relay(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        poll_interval_seconds=30,
    )
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay._listen is not None, 10, "the relay to LISTEN")
        pid = relay._listen.info.backend_pid  # type: ignore[union-attr]
        sql(clean, "SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(0.2)
        sql(
            clean,
            "INSERT INTO outbox_message (key, step, destination, payload) VALUES ('l:1', 'charge', %s, '{}')",
            (DEST,),
        )
        wait_for(lambda: ids_by_state(clean) == {"dispatched": {1}}, 8, "the row to go out")
    finally:
        stop.set()
        thread.join(10)


# == Statement on the connection's cached RawCursor =================================================


def _write(engine: Any, n: int, tag: str = "order") -> list[int]:
    from sqlalchemy.orm import Session

    ids = []
    with Session(engine) as s, s.begin():
        for i in range(n):
            ids.append(outbox.write(s, key=f"{tag}:{i}", step="charge", destination=DEST, payload={"i": i}).id)
    return ids


def test_zz17_the_cached_cursor_survives_a_cancelled_claim_and_a_refused_record(clean, engine, db) -> None:
    """A claim cancelled by the server (statement_timeout) and a record refused (DataError) on
    the connections whose RawCursor is reused: the next statements on those same connections
    must still claim and record correctly (prepared after 5 runs too)."""

    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"ch_{d.id}", response={"ok": True, "id": d.id})

    ids = _write(engine, 12)
    executor = Executor(clean.database_url, registry())
    try:
        for row_id in ids[:6]:  # past psycopg's prepare threshold
            assert executor.deliver(row_id, DEST) is RunResult.SENT
        claim_conn = executor._local.claim_conn
        record_conn = executor._local.record_conn
        # A record the database refuses once (DataError), retried on the same cursor.
        db.execute(
            """
            CREATE OR REPLACE FUNCTION outbox_zz17_refuse() RETURNS trigger AS $$
            BEGIN
              IF NEW.response ? 'ok' THEN
                RAISE EXCEPTION 'refused' USING ERRCODE = 'data_exception';
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql
            """
        )
        db.execute(
            "CREATE TRIGGER outbox_zz17_refuse BEFORE UPDATE ON outbox_message "
            "FOR EACH ROW EXECUTE FUNCTION outbox_zz17_refuse()"
        )
        try:
            assert executor.deliver(ids[6], DEST) is RunResult.SENT
        finally:
            db.execute("DROP TRIGGER outbox_zz17_refuse ON outbox_message")
            db.execute("DROP FUNCTION outbox_zz17_refuse()")
        # A claim cancelled mid-statement on a live connection: it raises, nothing claimed.
        locker = psycopg.connect(libpq_url(clean.database_url))
        try:
            locker.execute("SELECT 1 FROM outbox_message WHERE id = %s FOR UPDATE", (ids[7],))
            claim_conn.execute("SET statement_timeout = 300")
            with pytest.raises(psycopg.errors.QueryCanceled):
                executor.deliver(ids[7], DEST)
        finally:
            locker.rollback()
            locker.close()
        assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (ids[7],)) == [("pending",)]
        for row_id in ids[7:]:
            assert executor.deliver(row_id, DEST) is RunResult.SENT
        assert executor._local.record_conn is record_conn
        rows = sql(clean, "SELECT id, state, provider_ref FROM outbox_message ORDER BY id")
        assert all(state == "sent" and ref == f"ch_{i}" for i, state, ref in rows), rows
        attempts = sql(clean, "SELECT message_id, count(*) FROM outbox_attempt GROUP BY 1 HAVING count(*) > 1")
        assert attempts == [], attempts
    finally:
        executor.close()


def test_zz17_a_statement_on_two_connections_never_mixes_their_cursors(clean, engine) -> None:
    """Each connection keeps its own cursor: results read on one are that connection's."""
    ids = _write(engine, 2)
    with (
        psycopg.connect(libpq_url(clean.database_url)) as one,
        psycopg.connect(libpq_url(clean.database_url)) as two,
    ):
        first = transitions.dispatch_due(one, limit=1)
        second = transitions.dispatch_due(two, limit=1)
        assert {first[0][0], second[0][0]} == set(ids)
        assert one._outbox_cursor is not two._outbox_cursor  # type: ignore[attr-defined]
        one.rollback()
        two.rollback()


# == the pre-packed ack =============================================================================


def test_zz17_an_ack_on_a_killed_redis_connection_still_lands(clean, redis_client) -> None:
    """The pooled connection the ack uses was killed by Redis (CLIENT KILL, a failover, an idle
    timeout): the ack must still remove the message (retried on a new connection)."""
    import dramatiq

    ns = f"{clean.namespace}-zz17"
    queue = DEST
    broker = Broker(url=clean.redis_url, namespace=ns)
    try:
        broker.declare_queue(queue)

        @dramatiq.actor(actor_name="outbox_deliver", queue_name=queue, broker=broker)
        def deliver(row_id: int) -> None:  # pragma: no cover - never run
            pass

        for i in range(3):
            deliver.send(i)
        consumer = broker.consume(queue, prefetch=3, timeout=100)
        got = []
        for _ in range(50):
            m = next(consumer)
            if m is not None:
                got.append(m)
            if len(got) == 3:
                break
        assert len(got) == 3
        consumer.ack(got[0])
        # Kill every client connection of this Redis but ours (the broker's pooled sockets).
        me = redis_client.client_id()
        for c in redis_client.client_list():
            if int(c["id"]) != me:
                redis_client.client_kill_filter(_id=int(c["id"]))
        consumer.ack(got[1])
        consumer.ack(got[2])
        acks = f"{ns}:__acks__.{broker.broker_id}.{queue}"
        assert redis_client.scard(acks) == 0
        assert redis_client.hlen(f"{ns}:{queue}.msgs") == 0
        consumer.close()
    finally:
        broker.close()
        broker.client.connection_pool.disconnect()
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)


# == the call thread's lock (time-limit abandonment) ===============================================


def test_zz17_an_abandoned_call_is_unknown_and_the_next_call_runs_on_a_new_thread(clean, engine) -> None:
    release = threading.Event()
    calls: list[int] = []

    @outbox.handler(DEST, time_limit=1, lease_seconds=20)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        calls.append(d.id)
        if len(calls) == 1:
            release.wait(5)  # blocks past its time limit (a socket read would)
        return outbox.Confirmed(ref=f"ch_{d.id}")

    ids = _write(engine, 3)
    executor = Executor(clean.database_url, registry())
    try:
        started = time.monotonic()
        assert executor.deliver(ids[0], DEST) is RunResult.UNKNOWN
        assert time.monotonic() - started < 4
        release.set()
        assert executor.deliver(ids[1], DEST) is RunResult.SENT
        assert executor.deliver(ids[2], DEST) is RunResult.SENT
        assert calls == ids
    finally:
        executor.close()


def test_zz17_warm_thread_then_delivery_uses_the_warmed_connections(clean, engine) -> None:
    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"ch_{d.id}")

    ids = _write(engine, 2)
    executor = Executor(clean.database_url, registry())
    results: list[Any] = []

    def run() -> None:
        executor.warm_thread()
        warmed = (executor._local.claim_conn, executor._local.record_conn)
        # The server ends the warmed claim connection while the thread idles before its first
        # message (an idle timeout, a restart): the first delivery must not be lost or doubled.
        sql(clean, "SELECT pg_terminate_backend(%s)", (warmed[0].info.backend_pid,))
        time.sleep(0.2)
        results.append(executor.deliver(ids[0], DEST))
        results.append(executor.deliver(ids[1], DEST))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    try:
        # The first claim met a dead connection: released or empty (never a call on a claim
        # whose reply was lost); the row is not lost: it is pending or dispatched for later.
        states = dict(sql(clean, "SELECT id, state FROM outbox_message"))
        assert results[1] is RunResult.SENT
        assert states[ids[1]] == "sent"
        assert results[0] in (RunResult.SENT, RunResult.RELEASED, RunResult.EMPTY), results
        assert states[ids[0]] in ("sent", "pending", "dispatched"), states
    finally:
        executor.close()


_ = (uuid, outbox_db, relay_module)
