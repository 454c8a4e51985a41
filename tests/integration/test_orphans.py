"""Issue 9 class 7: orphan destinations. Re-dispatch replaces, never adds; a message still in
its queue is never re-published; workers record heartbeats in the database; a destination with
rows waiting and no live consumer is alerted once per episode and shown by `status` and
`doctor`; an operator cancels its rows. Real PostgreSQL, real Redis, Dramatiq's own fetch."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from dramatiq.brokers.redis import RedisBroker
from helpers import relay_once, wait_for, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import ops, transport
from outbox.alerts import AlertRow
from outbox.cli import main
from outbox.cli.render import render
from outbox.db import make_engine
from outbox.handlers import registry
from outbox.heartbeat import Heartbeat
from outbox.ops.doctor import run_checks
from outbox.reconciler.jobs.redispatch import redispatch
from outbox.reconciler.scheduler import Reconciler
from outbox.settings import Settings, libpq_url

DEST = "payments.charge"
TYPO = "paymnets.charge"


@pytest.fixture
def db(clean: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_process, outbox_no_consumer")
        yield conn
        conn.execute("TRUNCATE outbox_process, outbox_no_consumer")


@pytest.fixture
def beats(clean: Any) -> Iterator[Callable[..., Heartbeat]]:
    made: list[Heartbeat] = []

    def start(queues: list[str], **kw: Any) -> Heartbeat:
        made.append(Heartbeat(clean.database_url, kind="worker", queues=queues, **kw).start())
        return made[-1]

    yield start
    for h in made:
        h.stop()


def declare() -> None:
    @outbox.handler(DEST, time_limit=5, backoff=(1, 2))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref=f"ch_{d.id}")


def write(engine: Any, n: int, destination: str, start: int = 0) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(s, key=f"order:{i}", step=destination, destination=destination, payload={"n": i}).id
            for i in range(start, start + n)
        ]


def copies(client: Any, namespace: str, destination: str) -> tuple[int, int]:
    key = transport.queue_key(namespace, destination)
    return int(client.llen(key)), int(client.hlen(f"{key}.msgs"))


def dispatched_at(db: psycopg.Connection[Any], ids: list[int]) -> dict[int, Any]:
    rows = db.execute("SELECT id, state, dispatched_at FROM outbox_message WHERE id = ANY(%s)", (ids,))
    return {r[0]: (r[1], r[2]) for r in rows}


def cfg(services: Any) -> Settings:
    return Settings(
        database_url=services.database_url, redis_url=services.redis_url, namespace=services.namespace
    )


def status_report(services: Any) -> ops.StatusReport:
    engine = make_engine(services.database_url)
    try:
        with engine.connect() as conn:
            return ops.status(conn)
    finally:
        engine.dispose()


def test_a_typo_destination_is_never_copied_alerted_once_shown_and_cancelled(
    clean, engine, db, redis_client, beats, capsys
):
    declare()
    ns = clean.namespace
    beats([DEST], interval_seconds=0.2)  # a live worker serving the real destination only
    typo_ids = write(engine, 3, TYPO)
    write(engine, 2, DEST, start=10)
    assert relay_once(clean) == 5
    before = dispatched_at(db, typo_ids)
    alerts: list[AlertRow] = []
    reconciler = Reconciler(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        handlers=registry(),
        module="tests",
        namespace=ns,
        # Everything is old enough to be re-published, if re-publishing were allowed.
        redispatch_after_seconds=0.001,
        redispatch_grace_seconds=0,
        alert_hook=alerts.append,
        no_consumer_cycles=3,
    )
    try:
        for cycle in range(1, 9):
            result = reconciler.run_once()
            assert "error" not in result["redispatch"] and "error" not in result["no_consumer"]
            # Never a second copy of a message still waiting in its queue, whatever its age.
            assert copies(redis_client, ns, TYPO) == (3, 3), cycle
            assert dispatched_at(db, typo_ids) == before, cycle
            assert len(alerts) == (0 if cycle < 3 else 1), cycle
        (alert,) = alerts
        assert (alert.destination, alert.state, alert.id) == (TYPO, "no_consumer", typo_ids[0])
        assert f"no consumer for {TYPO} since " in alert.reason and "3 rows waiting" in alert.reason

        # Shown by status and doctor, read from the database alone.
        report = status_report(clean)
        assert [(g.destination, g.rows_waiting) for g in report.no_consumer] == [(TYPO, 3)]
        assert f"no consumer for {TYPO} since " in render(report)
        assert report.to_dict()["no_consumer"][0]["rows_waiting"] == 3
        checks = {c.name: c for c in run_checks(cfg(clean))}
        assert checks["consumers"].status == "FAIL"
        assert f"no consumer for {TYPO} since " in checks["consumers"].detail
        assert "3 rows waiting" in checks["consumers"].detail and DEST not in checks["consumers"].detail

        # Redis loses everything: re-published once each, and still one copy after more cycles.
        transport.delete_namespace(redis_client, ns)
        assert reconciler.run_once()["redispatch"]["missing"] == 5
        assert relay_once(clean) == 5
        for _ in range(3):
            reconciler.run_once()
            assert copies(redis_client, ns, TYPO) == (3, 3)
        assert len(alerts) == 1, "one alert per episode"

        # The operator previews, then cancels exactly the previewed rows.
        flags = ["--database-url", clean.database_url]
        assert (
            main(["cancel", "--destination", TYPO, "--reason", "typo in release 42", *flags, "--json"]) == 0
        )
        preview = json.loads(capsys.readouterr().out)
        assert preview["applied"] is False and [r["id"] for r in preview["to_cancel"]] == typo_ids
        assert {s for s, _ in dispatched_at(db, typo_ids).values()} == {"dispatched"}, (
            "a preview changes nothing"
        )
        late = write(engine, 1, TYPO, start=20)  # written after the preview: not cancelled
        code = main(
            [
                "cancel",
                "--destination",
                TYPO,
                "--reason",
                "typo in release 42",
                "--yes",
                "--max-id",
                str(preview["max_id"]),
                *flags,
            ]
        )
        assert code == 0
        assert f"cancelled 3 row(s) of {TYPO}" in capsys.readouterr().out
        states = dispatched_at(db, typo_ids + late)
        assert [states[i][0] for i in typo_ids] == ["cancelled"] * 3 and states[late[0]][0] == "pending"
        history = db.execute("SELECT history, last_error FROM outbox_message WHERE id = %s", (typo_ids[0],))
        entry, last_error = history.fetchone()
        assert entry[-1]["action"] == "cancel" and entry[-1]["reason"] == "typo in release 42"
        assert "typo in release 42" in last_error
        assert main(["cancel", str(late[0]), "--reason", "typo", *flags]) == 0
        capsys.readouterr()

        # Nothing waits any more: the episode ends, and status and doctor say so.
        assert reconciler.run_once()["no_consumer"].get("ended") == 1
        assert status_report(clean).no_consumer == []
        assert {c.name: c.status for c in run_checks(cfg(clean))}["consumers"] == "ok"
    finally:
        reconciler.close()


def test_cancel_refuses_a_row_that_was_claimed(clean, engine, db, capsys):
    declare()
    ids = write(engine, 2, DEST)
    from outbox import store

    store.delivery.claim(db, row_id=ids[0], destination=DEST, lease_seconds=30)
    code = main(["cancel", *map(str, ids), "--reason", "r", "--database-url", clean.database_url])
    out = capsys.readouterr()
    assert code == 1
    assert f"row {ids[0]} is in_flight: only pending or dispatched rows can be cancelled" in out.err
    assert (
        dispatched_at(db, ids)[ids[0]][0] == "in_flight" and dispatched_at(db, ids)[ids[1]][0] == "cancelled"
    )
    assert main(["cancel", str(ids[1]), "--database-url", clean.database_url]) == 2  # no reason


def test_a_healthy_long_queue_is_never_republished(clean, engine, db, redis_client, beats):
    declare()
    beats([DEST], interval_seconds=0.2)  # served, but busy elsewhere: its queue only grows
    ids = write(engine, 300, DEST)
    assert relay_once(clean) == 300
    before = dispatched_at(db, ids)
    for _ in range(5):
        counts = redispatch(
            db,
            redis_client,
            registry(),
            namespace=clean.namespace,
            redispatch_after_seconds=0.001,
            grace_seconds=0,
        )
        assert counts == {"waiting": 300}
    assert copies(redis_client, clean.namespace, DEST) == (300, 300)
    assert dispatched_at(db, ids) == before


def test_a_message_fetched_by_a_worker_that_died_is_replaced_not_copied(clean, engine, db, redis_client):
    declare()
    ns = clean.namespace
    ids = write(engine, 3, DEST)
    assert relay_once(clean) == 3
    # A Dramatiq worker fetches two messages (Dramatiq's own code moves them to its ack set),
    # then dies before it claims them.
    broker = RedisBroker(url=clean.redis_url, namespace=ns)
    try:
        fetched = broker.do_fetch(DEST, 2)
    finally:
        broker.client.connection_pool.disconnect()
    assert len(fetched) == 2 and copies(redis_client, ns, DEST) == (1, 3)
    # Younger than OUTBOX_REDISPATCH_AFTER, or held by a live worker: it may still run them.
    args = dict(namespace=ns, grace_seconds=0)
    assert redispatch(db, redis_client, registry(), redispatch_after_seconds=3600, **args) == {"waiting": 3}
    assert redispatch(db, redis_client, registry(), redispatch_after_seconds=0.001, **args) == {"waiting": 3}
    # The worker dies: no Redis command for two minutes, as Dramatiq's heartbeats record it.
    heartbeats = f"{ns}:__heartbeats__"
    seconds, _ = redis_client.time()
    redis_client.zadd(heartbeats, {broker.broker_id: (seconds - 120) * 1000})
    # Older: unknowable. Removed from Redis (body and ack set), then the rows are re-queued.
    counts = redispatch(db, redis_client, registry(), redispatch_after_seconds=0.001, **args)
    assert counts == {"unacked": 2, "waiting": 1}
    after = sorted(state for state, _ in dispatched_at(db, ids).values())
    assert after == ["dispatched", "pending", "pending"]
    assert copies(redis_client, ns, DEST) == (1, 1)
    assert not any(redis_client.smembers(k) for k in redis_client.scan_iter(f"{ns}:__acks__.*"))
    assert relay_once(clean) == 2
    assert copies(redis_client, ns, DEST) == (3, 3), "one message per row, never two"
    assert redispatch(db, redis_client, registry(), redispatch_after_seconds=0.001, **args) == {"waiting": 3}


def test_worker_heartbeat_and_clock_skew(clean, engine, db, beats):
    declare()
    with worker_thread(clean, threads=1):
        row = wait_for(
            lambda: db.execute(
                "SELECT kind, queues, pid, stopped_at FROM outbox_process WHERE kind = 'worker'"
            ).fetchone(),
            10,
            "the worker's first heartbeat",
        )
        assert row[0] == "worker" and row[1] == [DEST] and row[3] is None
        checks = {c.name: c for c in run_checks(cfg(clean))}
        assert checks["clocks"].status == "ok" and "worker" in checks["clocks"].detail
    assert db.execute("SELECT stopped_at IS NOT NULL FROM outbox_process").fetchone() == (True,)

    # A process whose clock is 5 s ahead of the database's is warned about; doctor still passes it.
    beats([DEST], interval_seconds=0.2, clock=lambda: datetime.now(UTC) + timedelta(seconds=5))
    wait_for(
        lambda: db.execute("SELECT count(*) FROM outbox_process WHERE stopped_at IS NULL").fetchone()[0],
        5,
        "beat",
    )
    checks = {c.name: c for c in run_checks(cfg(clean))}
    assert checks["clocks"].status == "WARN" and checks["clocks"].ok
    name = f"worker {socket.gethostname()}:{os.getpid()}"
    assert re.search(rf"{re.escape(name)} \+(4\.9[5-9]\d|5\.0[0-4]\d) s", checks["clocks"].detail)
    assert "OUTBOX_CLOCK_SKEW_WARN" in checks["clocks"].detail
