"""The endpoints of outbox.probes against real PostgreSQL and Redis, and the database reading
behind the row gauges: what it counts, and that one reconciler at a time takes it."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers import free_port, wait_for
from sqlalchemy.orm import Session

import outbox
from outbox import metrics
from outbox.probes import Liveness, ProbeServer, Readiness
from outbox.reconciler.scheduler import JOB_LOCK_IDS, LOCK_CLASS, Reconciler


@pytest.fixture
def server(clean):
    servers: list[ProbeServer] = []

    def start(liveness: Liveness, redis_url: str | None = None, database_url: str | None = None) -> str:
        readiness = Readiness(database_url or clean.database_url, redis_url or clean.redis_url)
        s = ProbeServer(0, process="test", liveness=liveness, readiness=readiness, host="127.0.0.1")
        servers.append(s.start())
        return f"http://127.0.0.1:{s.port}"

    yield start
    for s in servers:
        s.stop()


def test_healthz_goes_stale_when_the_loop_stops_beating(server):
    liveness = Liveness(stale_after_seconds=0.3)
    url = server(liveness)
    assert httpx.get(f"{url}/healthz").status_code == 200
    time.sleep(0.5)
    stale = httpx.get(f"{url}/healthz")
    assert stale.status_code == 503 and stale.json()["status"] == "stale"
    liveness.beat()
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_readyz_names_what_does_not_answer(server, clean):
    assert httpx.get(f"{server(Liveness(30))}/readyz").json() == {"status": "ready", "problems": []}
    nobody = free_port()
    down = httpx.get(f"{server(Liveness(30), redis_url=f'redis://127.0.0.1:{nobody}/0')}/readyz", timeout=10)
    assert down.status_code == 503
    [problem] = down.json()["problems"]
    assert problem.startswith("Redis: ")
    bad_db = clean.database_url.rsplit("/", 1)[0] + "/no_such_database_here"
    down = httpx.get(f"{server(Liveness(30), database_url=bad_db)}/readyz", timeout=10)
    assert down.status_code == 503 and down.json()["problems"][0].startswith("PostgreSQL: ")


def test_metrics_endpoint_serves_the_registry(server):
    metrics.count_relay_failure()
    body = httpx.get(f"{server(Liveness(30))}/metrics")
    assert body.status_code == 200
    assert 'outbox_relay_batches_total{result="failed"}' in body.text


def write(engine, key: str, destination: str) -> None:
    with Session(engine) as s, s.begin():
        outbox.write(s, key=key, step="charge", destination=destination, payload={})


def test_the_reading_counts_each_state_by_destination(clean, engine, db):
    from helpers import elapse, relay_once

    write(engine, "a:1", "payments.charge")
    write(engine, "a:2", "payments.charge")
    write(engine, "b:1", "mail.send")
    assert relay_once(clean) == 3
    elapse(db, 5)
    write(engine, "a:3", "payments.charge")
    reading = metrics.read_database(db)
    assert reading.rows == {
        ("payments.charge", "dispatched"): 2,
        ("payments.charge", "pending"): 1,
        ("mail.send", "dispatched"): 1,
    }
    assert 4 < reading.ages[("payments.charge", "dispatched")] < 60
    assert reading.ages[("payments.charge", "pending")] is not None
    assert reading.no_consumer == ["mail.send", "payments.charge"]


def metrics_reconciler(clean) -> Reconciler:
    """A reconciler with the database_metrics job (no handlers)."""
    return Reconciler(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        handlers={},
        module="none",
        namespace=clean.namespace,
        database_metrics_interval_seconds=10,
    )


def test_one_reconciler_at_a_time_reads_the_database(clean, engine, db):
    write(engine, "a:1", "payments.charge")
    metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)  # forget earlier tests
    reconciler = metrics_reconciler(clean)
    try:
        db.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_CLASS, JOB_LOCK_IDS["database_metrics"]))
        assert reconciler.run_job("database_metrics") == {"skipped": 1}
        assert metrics.DATABASE.reading() is None
        db.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_CLASS, JOB_LOCK_IDS["database_metrics"]))
        assert reconciler.run_job("database_metrics") == {}
        reading = metrics.DATABASE.reading()
        assert reading is not None and reading.rows == {("payments.charge", "pending"): 1}
    finally:
        reconciler.close()


def test_a_port_in_use_is_a_clear_configuration_error(clean):
    import socket

    from outbox.exceptions import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve the metrics and probes on 127.0.0.1:{port}"):
            ProbeServer(
                port,
                process="test",
                liveness=Liveness(30),
                readiness=Readiness(clean.database_url, None),
                host="127.0.0.1",
            )


def test_the_reading_reconciler_keeps_the_job_and_the_other_exports_nothing(clean, engine, db):
    write(engine, "a:1", "payments.charge")
    first, second = metrics_reconciler(clean), metrics_reconciler(clean)
    try:
        # Turn after turn, as replicas on their own schedules would: the first keeps the lock.
        for _ in range(3):
            assert first.run_job("database_metrics") == {}
            assert second.run_job("database_metrics") == {"skipped": 1}
        first.close()  # it stops: its lock goes with its connection, and the other takes over
        # once the server has ended that connection's backend (asynchronous to the close: a busy
        # server took longer than the next statement here, in a CI run beside benchmarks).
        wait_for(lambda: second.run_job("database_metrics") == {}, 10, "the lock released")
    finally:
        first.close()
        second.close()


def test_a_destination_with_nothing_waiting_is_exported_as_zeros(clean, engine, db):
    from outbox.reconciler.jobs.database_metrics import DatabaseMetrics

    DatabaseMetrics(10, ("payments.charge",)).run_once(db)
    body = metrics.render()[1].decode()
    assert 'outbox_rows{destination="payments.charge",state="pending"} 0.0' in body
    assert 'outbox_destination_without_consumer{destination="payments.charge"} 0.0' in body


def test_a_metrics_failure_never_stops_a_delivery(clean, engine, provider, monkeypatch, caplog):
    from outbox.testing.delivery import deliver

    @outbox.handler("payments.charge", time_limit=5)
    def charge(d):
        r = d.http.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": d.idempotency_key})
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(metrics.DELIVERIES, "labels", broken)
    monkeypatch.setattr(metrics, "_last_failure_log", 0.0)
    write(engine, "a:1", "payments.charge")
    assert deliver({"payments.charge": charge}, database_url=clean.database_url) == {1: "sent"}
    assert "metrics not updated (OSError: No space left on device)" in caplog.text


def test_a_multiprocess_directory_that_is_not_writable_is_refused_at_start(monkeypatch, tmp_path):
    from outbox.exceptions import ConfigError

    monkeypatch.setenv(metrics.MULTIPROCESS_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a writable directory"):
        metrics.check_environment()
    monkeypatch.setenv(metrics.MULTIPROCESS_ENV, str(tmp_path))
    metrics.check_environment()


def test_readyz_answers_within_its_bound_when_postgresql_stops_answering(server, db):
    import os
    import signal

    url = server(Liveness(30))
    assert httpx.get(f"{url}/readyz").status_code == 200
    [pid] = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-probe'").fetchone()
    os.kill(pid, signal.SIGSTOP)  # the probe's backend accepts nothing more, and says nothing
    try:
        started = time.monotonic()
        stuck = httpx.get(f"{url}/readyz", timeout=10)
        assert time.monotonic() - started < 5
        assert stuck.status_code == 503 and stuck.json()["problems"] == ["PostgreSQL: no answer within 2 s"]
        # The next probe connects afresh, to a backend that answers.
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
