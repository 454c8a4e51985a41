"""Chaos with the database going away: while rows flow through real `outbox relay`, `outbox
worker` and `outbox reconcile` processes, PostgreSQL is stopped (`-m fast`: every connection
dropped) and later crashed (`-m immediate`: no checkpoint, asynchronously committed records may
be lost) and started again, while workers are SIGKILLed every half second.

The server is one the test owns (a pgserver instance on a Unix socket in a temporary directory),
never the machine's shared one. The provider simulator does NOT deduplicate, so its own counters
are the proof: every key charged exactly once, every row `sent` with the provider's reference,
`outbox audit` clean, and every process the test did not kill survived both outages and stops
cleanly."""

from __future__ import annotations

import dataclasses
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy.exc
from helpers import sql
from sqlalchemy.orm import Session

import outbox
from outbox.db import make_engine
from outbox.migrate import check_database, upgrade

from .support import HANDLERS, OwnedPostgres, Processes, kill, states

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 800
#: Seconds between two SIGKILLs of a worker (each restart costs a Python start-up).
KILL_EVERY = 1.0
#: Seconds the server stays down each time: long enough for every process to notice (the
#: relay's first reconnect comes after 0.5 s, the records' retries give up after 0.6 s).
DOWNTIME = 2.5
#: Wider than the other acceptance tests' timings: on a loaded 2-core machine a 2 s call limit
#: is hit by calls that never left the worker, and rows then fail their five attempts without a
#: charge; and re-publishing every 3 s a backlog that booting workers have not reached yet only
#: multiplies it.
TIMINGS = {
    "SHOP_TIME_LIMIT": "5",
    "SHOP_LEASE_SECONDS": "10",
    "OUTBOX_REDISPATCH_AFTER": "15",
}


@pytest.fixture
def owned_pg() -> Iterator[OwnedPostgres]:
    pg = OwnedPostgres()
    try:
        engine = make_engine(pg.url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        yield pg
    finally:
        pg.close()


@pytest.fixture
def chaos(clean: Any, owned_pg: OwnedPostgres) -> Any:
    """The session's Redis namespace (emptied by ``clean``), the test's own database."""
    return dataclasses.replace(clean, database_url=owned_pg.url)


@pytest.fixture
def procs(chaos: Any, provider: Any, tmp_path: Any) -> Iterator[Processes]:
    p = Processes(chaos, provider.url, tmp_path, TIMINGS)
    yield p
    p.stop_all()


def write_orders(database_url: str, n: int) -> list[str]:
    engine = make_engine(database_url)
    try:
        with Session(engine) as s, s.begin():
            for i in range(n):
                outbox.write(
                    s,
                    key=f"order:{i}",
                    step="charge",
                    destination="payments.charge",
                    payload={"amount_cents": 1000 + i, "currency": "EUR"},
                )
    finally:
        engine.dispose()
    return [f"order:{i}:charge" for i in range(n)]


def sent_count(services: Any) -> int:
    return states(services).get("sent", 0)


def test_postgres_stopped_and_crashed_mid_run_charges_each_key_once(chaos, owned_pg, provider, procs):
    # Each call takes a little while, so that calls are under way when the server goes away
    # and their records fail (or, after the crash, are lost).
    provider.configure(latency_ms=50)
    idempotency_keys = write_orders(chaos.database_url, ROWS)

    relay = procs.relay()
    reconciler = procs.reconciler()
    # A supervisor whose children are never killed by the test: it must ride out both outages.
    supervisor = procs.start("worker", HANDLERS, "--processes", "2", "--concurrency", "2")
    workers = [procs.worker(threads=4) for _ in range(2)]
    rng = random.Random(9)
    kills = 0
    t0 = time.monotonic()
    timeline: list[str] = []

    def note(event: str) -> None:
        timeline.append(f"{time.monotonic() - t0:.1f}s {event}")
        print(timeline[-1], flush=True)

    last_kill = time.monotonic()

    def kill_a_worker(restart: bool = True) -> int | None:
        """SIGKILL a worker that has booted (on a loaded machine a start-up takes seconds, and
        killing a process still importing proves nothing); start a new one unless told not to."""
        nonlocal kills, last_kill
        last_kill = time.monotonic()
        booted = [i for i, w in enumerate(workers) if "outbox worker started" in procs.log_of(w)]
        if not booted:
            return None
        i = rng.choice(booted)
        kill(workers[i])
        kills += 1
        if restart:
            workers[i] = procs.worker(threads=4)
        return i

    restarts: list[tuple[str, int]] = []
    for mode, progress in (("fast", 0.15), ("immediate", 0.5)):
        # Rows must be flowing when the server goes: wait for some progress, killing as we go.
        deadline = time.monotonic() + 120
        while sent_count(chaos) < ROWS * progress:
            assert time.monotonic() < deadline, f"no progress before the {mode} stop\n{procs.logs()}"
            if time.monotonic() - last_kill >= KILL_EVERY:
                kill_a_worker()
            time.sleep(0.2)
        sent_before = sent_count(chaos)
        note(f"stop -m {mode} at sent={sent_before}")
        owned_pg.stop(mode)
        # A worker killed while the server is down (its calls' records had nowhere to go) is
        # started again only once the server is back, as a process manager with backoff would.
        down_killed = kill_a_worker(restart=False)
        time.sleep(DOWNTIME)
        owned_pg.start()
        note("started")
        if down_killed is not None:
            workers[down_killed] = procs.worker(threads=4)
        restarts.append((mode, sent_before))

    chaos_until = time.monotonic() + 3 * KILL_EVERY
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if time.monotonic() < chaos_until and time.monotonic() - last_kill >= KILL_EVERY:
            kill_a_worker()
        if sent_count(chaos) == ROWS:
            break
        time.sleep(0.2)

    final = states(chaos)
    note(f"final {final}")
    stats = provider.stats()
    outcomes = dict(sql(chaos, "SELECT outcome, count(*) FROM outbox_attempt GROUP BY outcome"))
    summary = f"kills={kills} timeline={timeline} final={final} fence={outcomes}"
    assert all(0 < sent < ROWS for _, sent in restarts), f"rows were not flowing: {summary}"
    assert kills >= 2, f"the workers were not killed: {summary}"
    assert final == {"sent": ROWS}, f"{summary}\n{procs.logs()}"
    assert stats["double_charged"] == [], summary
    assert stats["charges"] == ROWS, summary
    assert sorted(stats["effects"]) == sorted(idempotency_keys), summary

    # A sent row holds the reference of the one charge the provider made for its key: checked
    # for every row whose history is not one clean claim (killed, expired, looked up, recorded
    # late), and for a sample of the others.
    provider.configure(latency_ms=0)
    refs = dict(sql(chaos, "SELECT key || ':' || step, provider_ref FROM outbox_message"))
    eventful = {
        key
        for (key,) in sql(
            chaos,
            "SELECT m.key || ':' || m.step FROM outbox_message m JOIN outbox_attempt a"
            " ON a.message_id = m.id WHERE a.outcome IS DISTINCT FROM 'sent'",
        )
    }
    checked = sorted(eventful | set(rng.sample(idempotency_keys, 50)))
    with httpx.Client(base_url=provider.url, timeout=5) as client:
        for key in checked:
            charge = client.get("/charges", params={"idempotency_key": key})
            assert charge.status_code == 200, key
            assert refs[key] == charge.json()["id"], key
    note(f"{len(checked)} refs checked ({len(eventful)} rows with an eventful history)")

    audit = subprocess.run(
        [sys.executable, "-m", "outbox", "audit"],
        env=procs.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert audit.returncode == 0, f"{audit.stdout}\n{audit.stderr}"
    note("audit clean")

    # Nothing the test did not kill died: each process survived both outages and stops cleanly.
    survivors = [relay, reconciler, supervisor, *workers]
    assert [p.poll() for p in survivors] == [None] * len(survivors), procs.logs()
    for p in survivors:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(60) for p in survivors]
    assert codes == [0] * len(survivors), f"exit codes {codes}\n{procs.logs()}"
    note("all stopped")
    # The outages really reached the processes: the relay said so, and came back.
    relay_log = procs.log_of(relay)
    assert relay_log.count("relay cannot reach PostgreSQL") >= len(restarts), relay_log[-3000:]
    assert relay_log.count("relay reconnected") >= len(restarts), relay_log[-3000:]


def test_owned_postgres_restarts_on_the_same_url(owned_pg):
    """The helper itself: a crash drops the clients, and the server comes back where it was."""
    with psycopg.connect(owned_pg.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE survivor (n int)")
        conn.execute("INSERT INTO survivor VALUES (1)")
        owned_pg.stop("immediate")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    owned_pg.start()
    with psycopg.connect(owned_pg.url, autocommit=True) as conn:
        assert conn.execute("SELECT n FROM survivor").fetchall() == [(1,)]


def test_a_process_starting_while_postgres_restarts_waits_for_it(owned_pg):
    """The start-up check of relay, worker and reconciler: a server that is down or starting up
    is waited for (a worker restarted by its supervisor during a database restart used to exit 3
    at once), a wrong database name fails at once."""
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            check_database(owned_pg.url)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    owned_pg.stop("immediate")
    thread = threading.Thread(target=check)
    thread.start()
    try:
        time.sleep(1.5)
        assert outcome == [], f"gave up while the server was down: {outcome}"
    finally:
        owned_pg.start()
        thread.join(60)
    assert outcome == [None]

    base, _, query = owned_pg.url.partition("?")
    wrong = base.rsplit("/", 1)[0] + "/no_such_database" + (f"?{query}" if query else "")
    started = time.monotonic()
    with pytest.raises(sqlalchemy.exc.OperationalError, match="no_such_database"):
        check_database(wrong)
    assert time.monotonic() - started < 5
