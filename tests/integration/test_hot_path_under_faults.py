"""The hot path's shortcuts stay correct under faults, against real PostgreSQL and Redis: the
relay's take ended by commit()/rollback() (a failed publish, a connection killed between publish
and commit), NOTIFYs read from libpq and the 7 ms gathering window (rows committed at any moment,
the LISTEN connection killed), Statement on a cached RawCursor (a cancelled claim, a refused
record, two connections), the pre-packed ack (killed Redis connections, two queues), the call
thread's lock (an abandoned call), warmed connections the server ended, and the whole path
exactly once. Two writes of one (key, step) at the same instant stay a no-op, and no revision
builds a unique index on outbox_message concurrently (docs/decisions/attack-findings.md)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg
import pytest
import redis
from helpers import ids_by_state, relay_thread, sql, wait_for
from psycopg import pq

import outbox
from outbox import store, transport
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.relay import Relay
from outbox.relay import relay as relay_module
from outbox.settings import libpq_url
from outbox.transport import Broker

pytestmark = pytest.mark.timeout(120)

DEST = "payments.charge"

# What outbox.write sends (outbox.store.application._INSERT), in positional form for the raw pgconn.
_WRITE_SQL = (
    b"INSERT INTO outbox_message (key, step, destination, payload) "
    b"VALUES ($1, 'charge', 'payments.charge', '{}'::jsonb) "
    b"ON CONFLICT (key, step) DO NOTHING RETURNING id"
)


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


# == two writes of one (key, step) at once; no unique index built concurrently ====================
# A withdrawn revision showed the hazard: while CREATE UNIQUE INDEX CONCURRENTLY (key
# text_pattern_ops, step) waited in its last phase (any long read open), the new index was ready
# (maintained, enforced) but not valid, so not an ON CONFLICT (key, step) arbiter: two writes of
# one (key, step) at the same instant raised UniqueViolation on
# outbox_message_key_step_pattern_idx instead of the no-op, within a few dozen tries (and for good
# when a deploy gave up on that migrate: the INVALID index stayed, enforced).
# What stays here: the head keeps the race a no-op, and no revision may bring the hazard back.


def test_two_writes_of_one_key_at_the_same_instant_are_a_no_op_at_head(clean) -> None:
    lib = libpq_url(clean.database_url)
    with psycopg.connect(lib, autocommit=True) as a, psycopg.connect(lib, autocommit=True) as b:
        assert _hammer(a, b, "head", 1.5) == []
        unique = a.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'outbox_message'::regclass AND i.indisunique AND NOT i.indisprimary"
        ).fetchall()
        assert unique == [("outbox_message_key_step_key",)], unique


def test_no_revision_builds_a_unique_index_on_outbox_message_concurrently() -> None:
    """A unique index built CONCURRENTLY on outbox_message, next to the (key, step) constraint,
    makes concurrent duplicate writes raise while it waits to become valid (see above)."""
    import ast
    from importlib import resources

    offenders = []
    for path in sorted(resources.files("outbox.migrations").joinpath("versions").iterdir()):
        if not str(path).endswith(".py"):
            continue
        text = path.read_text()
        if "CREATE UNIQUE INDEX CONCURRENTLY" in text.upper().replace("\n", " "):
            offenders.append(str(path))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "create_index_concurrently",
                "create_index",
            ):
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                unique = any(k.arg == "unique" and getattr(k.value, "value", False) for k in node.keywords)
                concurrent = getattr(node.func, "id", None) == "create_index_concurrently" or any(
                    k.arg == "postgresql_concurrently" and getattr(k.value, "value", False)
                    for k in node.keywords
                )
                if unique and concurrent and "outbox_message" in args:
                    offenders.append(f"{path}:{node.lineno}")
    assert offenders == [], offenders


# == relay: wake-ups under the 7 ms gathering window, libpq NOTIFY reads ===========================


def test_rows_committed_at_any_moment_are_taken_long_before_the_poll(clean, redis_client) -> None:
    """A running relay (default gathering window, a 30 s fallback poll): rows committed one by
    one at random moments, alone or in bursts, while it takes, gathers, waits. Each must go out
    promptly: a lost wake-up would leave a row for the 30 s poll."""
    rng = random.Random(17)
    late: list[tuple[int, float]] = []
    with relay_thread(clean) as relay:
        wait_for(lambda: relay._listen is not None, 10, "the relay to LISTEN")
        with psycopg.connect(libpq_url(clean.database_url)) as conn:
            for i in range(120):
                conn.execute(
                    "INSERT INTO outbox_message (key, step, destination, payload) "
                    "VALUES (%s, 'charge', %s, '{}')",
                    (f"wake:{i}", DEST),
                )
                conn.commit()
                time.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.005, 0.007, 0.008, 0.02]))
        # Every row out within 2 s of the last commit (the poll is 30 s away).
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and ids_by_state(clean).get("pending"):
            time.sleep(0.02)
        pending = ids_by_state(clean).get("pending", set())
        late = [(p, 0.0) for p in sorted(pending)]
    assert not late, f"rows left pending for the fallback poll: {late}"
    assert ids_by_state(clean).keys() == {"dispatched"}
    published = [int(x) for x in _published(redis_client, clean.namespace)]
    assert sorted(set(published)) == sorted(published), "a row published twice in a clean run"


def _published(client: redis.Redis, namespace: str) -> list[int]:
    from helpers import published_row_ids

    return published_row_ids(client, namespace, [DEST])


def test_a_failed_publish_rolls_the_take_back_and_the_connection_stays_usable(
    clean, redis_client, monkeypatch
) -> None:
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "SELECT 'p:' || g, 'charge', %s, '{}' FROM generate_series(1, 5) g",
        (DEST,),
    )
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    real = transport.publish_group
    try:

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise redis.ConnectionError("attack: Redis went away mid-publish")

        monkeypatch.setattr(transport, "publish_group", refuse)
        with pytest.raises(redis.ConnectionError):
            relay.run_once()
        assert ids_by_state(clean) == {"pending": {1, 2, 3, 4, 5}}
        # Not left idle in transaction holding the rows' locks.
        assert relay._conn is not None and relay._conn.info.transaction_status == pq.TransactionStatus.IDLE
        monkeypatch.setattr(transport, "publish_group", real)
        assert relay.run_once().published == 5
        assert relay._conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert ids_by_state(clean) == {"dispatched": {1, 2, 3, 4, 5}}
    finally:
        relay.close()


def test_a_connection_killed_between_publish_and_commit_leaves_rows_pending(
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
    real = transport.publish_group
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

        monkeypatch.setattr(transport, "publish_group", publish_then_kill)
        with pytest.raises(psycopg.OperationalError):
            relay.run_once()
        assert ids_by_state(clean) == {"pending": {1, 2, 3}}
        assert relay._conn is None
        monkeypatch.setattr(transport, "publish_group", real)
        assert relay.run_once().published == 3
        assert ids_by_state(clean) == {"dispatched": {1, 2, 3}}
    finally:
        relay.close()


def test_the_listen_connection_killed_is_noticed_and_rows_still_go_out(clean, redis_client) -> None:
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
            written = outbox.write(s, key=f"{tag}:{i}", step="charge", destination=DEST, payload={"i": i})
            ids.append(written.id)
    return ids


def test_the_cached_cursor_survives_a_cancelled_claim_and_a_refused_record(clean, engine, db) -> None:
    """A claim cancelled by the server (statement_timeout) and a record refused (DataError) on
    the connections whose RawCursor is reused: the next statements on those same connections
    must still claim and record correctly (prepared after 5 runs too)."""

    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"ch_{d.id}", response={"ok": True, "id": d.id})

    ids = _write(engine, 12)
    deliverer = Deliverer(clean.database_url, registry())
    try:
        for row_id in ids[:6]:  # past psycopg's prepare threshold
            assert deliverer.deliver(row_id, DEST) is DeliveryResult.SENT
        # One thread: each pool holds the one connection it has used.
        (claim_conn,) = deliverer._pools["claim_conn"].idle
        (record_conn,) = deliverer._pools["record_conn"].idle
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
            assert deliverer.deliver(ids[6], DEST) is DeliveryResult.SENT
        finally:
            db.execute("DROP TRIGGER outbox_zz17_refuse ON outbox_message")
            db.execute("DROP FUNCTION outbox_zz17_refuse()")
        # A claim cancelled mid-statement on a live connection: it raises, nothing claimed.
        locker = psycopg.connect(libpq_url(clean.database_url))
        try:
            locker.execute("SELECT 1 FROM outbox_message WHERE id = %s FOR UPDATE", (ids[7],))
            # The statement timeout, not the lock timeout (which waits without the connection):
            # shorter than the lock wait the claim sets inside itself.
            claim_conn.execute("SET statement_timeout = 100")
            with pytest.raises(psycopg.errors.QueryCanceled):
                deliverer.deliver(ids[7], DEST)
        finally:
            locker.rollback()
            locker.close()
        assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (ids[7],)) == [("pending",)]
        for row_id in ids[7:]:
            assert deliverer.deliver(row_id, DEST) is DeliveryResult.SENT
        assert deliverer._pools["record_conn"].idle == [record_conn]
        rows = sql(clean, "SELECT id, state, provider_ref FROM outbox_message ORDER BY id")
        assert all(state == "sent" and ref == f"ch_{i}" for i, state, ref in rows), rows
        attempts = sql(
            clean, "SELECT message_id, count(*) FROM outbox_attempt GROUP BY 1 HAVING count(*) > 1"
        )
        assert attempts == [], attempts
    finally:
        deliverer.close()


def test_a_statement_on_two_connections_never_mixes_their_cursors(clean, engine) -> None:
    """Each connection keeps its own cursor: results read on one are that connection's."""
    ids = _write(engine, 2)
    with (
        psycopg.connect(libpq_url(clean.database_url)) as one,
        psycopg.connect(libpq_url(clean.database_url)) as two,
    ):
        first = store.relay.dispatch_due(one, limit=1)
        second = store.relay.dispatch_due(two, limit=1)
        assert {first[0][0], second[0][0]} == set(ids)
        assert one._outbox_cursor is not two._outbox_cursor  # type: ignore[attr-defined]
        one.rollback()
        two.rollback()


# == the pre-packed ack =============================================================================


def test_an_ack_on_a_killed_redis_connection_still_lands(clean, redis_client) -> None:
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
        # Kill every client connection of this Redis database but ours (the broker's pooled
        # sockets); another database's clients belong to other processes on a shared server.
        me = redis_client.client_id()
        db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
        for c in redis_client.client_list():
            if int(c["id"]) != me and c.get("db") == db:
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


def test_an_abandoned_call_is_unknown_and_the_next_call_runs_on_a_new_thread(clean, engine) -> None:
    release = threading.Event()
    calls: list[int] = []

    @outbox.handler(DEST, time_limit=1, lease_seconds=20)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        calls.append(d.id)
        if len(calls) == 1:
            release.wait(5)  # blocks past its time limit (a socket read would)
        return outbox.Confirmed(ref=f"ch_{d.id}")

    ids = _write(engine, 3)
    deliverer = Deliverer(clean.database_url, registry())
    try:
        started = time.monotonic()
        assert deliverer.deliver(ids[0], DEST) is DeliveryResult.UNKNOWN
        assert time.monotonic() - started < 4
        release.set()
        assert deliverer.deliver(ids[1], DEST) is DeliveryResult.SENT
        assert deliverer.deliver(ids[2], DEST) is DeliveryResult.SENT
        assert calls == ids
    finally:
        deliverer.close()


def test_a_warmed_connection_the_server_ended_costs_no_call_and_loses_no_row(clean, engine) -> None:
    """warm_thread opens the claim connection at boot; the server ends it while the thread idles
    (idle_session_timeout, a restart, a proxy's idle cut). The first claim meets a dead socket:
    it is taken for a claim whose reply was lost, settled (no call), and the row stays claimable:
    delivered later exactly once. (The worker then acks its message: the row waits for the
    reconciler's re-queue, a delay, not a loss.)"""
    calls: list[int] = []

    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        calls.append(d.id)
        return outbox.Confirmed(ref=f"ch_{d.id}")

    ids = _write(engine, 2)
    deliverer = Deliverer(clean.database_url, registry())
    results: list[Any] = []
    states: list[dict[int, str]] = []

    def run() -> None:
        deliverer.warm_thread()
        (warmed,) = deliverer._pools["claim_conn"].idle
        sql(clean, "SELECT pg_terminate_backend(%s)", (warmed.info.backend_pid,))
        time.sleep(0.2)
        results.append(deliverer.deliver(ids[0], DEST))
        states.append(dict(sql(clean, "SELECT id, state FROM outbox_message")))
        results.append(deliverer.deliver(ids[1], DEST))
        results.append(deliverer.deliver(ids[0], DEST))  # the re-queued message

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    try:
        assert results[0] in (DeliveryResult.SENT, DeliveryResult.EMPTY), results
        if results[0] is DeliveryResult.EMPTY:
            assert states[0][ids[0]] == "pending", states
        assert results[1:] == [
            DeliveryResult.SENT,
            DeliveryResult.SENT if results[0] is DeliveryResult.EMPTY else DeliveryResult.EMPTY,
        ]
        assert sorted(calls) == sorted(ids), calls
        assert dict(sql(clean, "SELECT id, state FROM outbox_message")) == {i: "sent" for i in ids}
    finally:
        deliverer.close()


# == the whole path with every change at once =======================================================


def test_streamed_writes_reach_the_provider_exactly_once(clean, engine, provider, monkeypatch) -> None:
    """Writes committed one by one while a relay (7 ms gathering, libpq NOTIFY reads, take on a
    cached RawCursor, commit()) and a worker (warmed threads, Statement claim/record, pre-packed
    ack, lock handoff) run: every row sent, one call each, every message acked."""
    import importlib

    from helpers import worker_thread
    from sqlalchemy.orm import Session

    monkeypatch.setenv("SHOP_PROVIDER_URL", provider.url)
    import outbox.demo.handlers as shop

    importlib.reload(shop)
    handlers = registry()
    rng = random.Random(1717)
    n = 40
    with relay_thread(clean):
        with worker_thread(clean, threads=4, handlers=handlers):
            for i in range(n):
                with Session(engine) as s, s.begin():
                    outbox.write(
                        s,
                        key=f"order:{i}",
                        step="charge",
                        destination="payments.charge",
                        payload={"amount_cents": 100 + i, "currency": "EUR"},
                    )
                time.sleep(rng.choice([0, 0.001, 0.004, 0.007, 0.01]))
            wait_for(
                lambda: ids_by_state(clean).keys() == {"sent"} and len(ids_by_state(clean)["sent"]) == n,
                20,
                "every row sent",
            )
    stats = provider.stats()
    assert stats["charges"] == n and stats["double_charged"] == [], stats
    assert sql(clean, "SELECT count(*) FROM outbox_attempt") == [(n,)]
    # Every message acked: nothing left in the queue, the acks sets or the message hash.
    leftovers = [
        k
        for k in redis_client_keys(clean)
        if (k.endswith(".msgs") or "__acks__" in k or k.endswith(":payments.charge"))
    ]
    assert leftovers == [], leftovers


def redis_client_keys(services: Any) -> list[str]:
    client = redis.Redis.from_url(services.redis_url)
    try:
        found = []
        for key in client.scan_iter(f"{services.namespace}:*"):
            name = key.decode()
            kind = client.type(key).decode()
            if kind == "hash" and client.hlen(key) == 0:
                continue
            if kind in ("set", "list", "zset") and not (
                client.scard(key) if kind == "set" else client.llen(key) if kind == "list" else 1
            ):
                continue
            found.append(name)
        return found
    finally:
        client.close()


def test_notifies_read_from_libpq_do_not_pile_up_in_psycopgs_backlog(clean) -> None:
    """_read_notifies takes NOTIFYs from libpq directly; psycopg must not also keep each one in
    its backlog deque (read only at reconnect): a relay up for weeks would grow it without end."""
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    try:
        listen = relay._ensure_listening()
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as writer:
            for i in range(200):
                writer.execute(
                    "INSERT INTO outbox_message (key, step, destination, payload) "
                    "VALUES (%s, 'charge', %s, '{}')",
                    (f"n:{i}", DEST),
                )
        read = 0
        deadline = time.monotonic() + 5
        while read < 200 and time.monotonic() < deadline:
            read += relay_module._read_notifies(listen)
            time.sleep(0.01)
        assert read == 200
        backlog = listen._notifies_backlog  # type: ignore[attr-defined]
        assert backlog is not None and len(backlog) == 0, len(backlog or ())
    finally:
        relay.close()


def test_acks_from_two_queues_at_once_each_remove_their_own_message(clean, redis_client) -> None:
    """Dramatiq acks on one consumer thread per queue: the per-queue packed parts and the pooled
    connections must never send one queue's ack with another's arguments."""
    import dramatiq

    ns = f"{clean.namespace}-zz17b"
    queues = ["payments.charge", "mail.send"]
    broker = Broker(url=clean.redis_url, namespace=ns)
    try:
        for q in queues:
            broker.declare_queue(q)
        actors = {
            q: dramatiq.actor(actor_name=f"outbox_deliver_{i}", queue_name=q, broker=broker)(lambda n: None)
            for i, q in enumerate(queues)
        }
        for q in queues:
            for i in range(60):
                actors[q].send(i)
        fetched: dict[str, tuple[Any, list[Any]]] = {}
        for q in queues:
            consumer = broker.consume(q, prefetch=60, timeout=100)
            got: list[Any] = []
            for _ in range(200):
                m = next(consumer)
                if m is not None:
                    got.append(m)
                if len(got) == 60:
                    break
            assert len(got) == 60
            fetched[q] = (consumer, got)
        errors: list[BaseException] = []

        def ack_all(q: str) -> None:
            consumer, got = fetched[q]
            try:
                for m in got:
                    consumer.ack(m)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ack_all, args=(q,)) for q in queues]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        for q in queues:
            assert redis_client.scard(f"{ns}:__acks__.{broker.broker_id}.{q}") == 0
            assert redis_client.hlen(f"{ns}:{q}.msgs") == 0
            fetched[q][0].close()
    finally:
        broker.close()
        broker.client.connection_pool.disconnect()
        for key in redis_client.scan_iter(f"{ns}:*"):
            redis_client.delete(key)
