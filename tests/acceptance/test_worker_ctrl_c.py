"""`outbox worker` stopped from a terminal, as a real process and with real signals: on Ctrl-C it
says how many messages it finishes and for how long it waits, and that a second Ctrl-C exits at
once; it ends with a "stopped" line. A second Ctrl-C exits at once (130), leaving the rows it held
where a crash would: claimed, then settled by their leases and the reconciler, each charge made
once. The lines are JSON (OUTBOX_LOG_FORMAT=json): their numbers are fields, not only words."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import relay_once, sql, wait_for

from .support import Processes, states
from .test_crash import write_orders
from .test_worker_process import _children

pytestmark = pytest.mark.timeout(120)

STOPPING = (
    "received SIGINT: outbox worker stopping: finishing 2 messages in hand, waiting up to {} s for them"
)
AGAIN = "; Ctrl-C again exits at once (their rows stay claimed until their leases expire)"


def entries(procs: Processes, proc: Any) -> list[dict[str, Any]]:
    """The process's log lines (each a JSON object); any other line fails the test."""
    return [json.loads(line) for line in procs.log_of(proc).splitlines() if line.strip()]


def said(procs: Processes, proc: Any, start: str) -> list[dict[str, Any]]:
    return [e for e in entries(procs, proc) if e["message"].startswith(start)]


@pytest.fixture
def procs(clean, provider, tmp_path):
    p = Processes(clean, provider.url, tmp_path)
    yield p
    p.stop_all()


def test_ctrl_c_finishes_the_messages_in_hand_says_so_and_ends_with_a_stopped_line(
    clean, engine, provider, procs
):
    provider.configure(latency_ms=1000)
    write_orders(engine, 2)
    relay_once(clean)
    worker = procs.worker(threads=2, OUTBOX_LOG_FORMAT="json")
    wait_for(lambda: provider.stats()["in_flight"] == 2, 30, f"both calls under way\n{procs.logs()}")
    os.kill(worker.pid, signal.SIGINT)
    assert worker.wait(30) == 0, procs.logs()

    log = entries(procs, worker)
    [stopping] = [e for e in log if "outbox worker stopping" in e["message"]]
    assert stopping["message"] == STOPPING.format(3) + AGAIN
    assert stopping["level"] == "INFO"
    assert (stopping["signal"], stopping["in_hand"], stopping["grace_seconds"]) == ("SIGINT", 2, 3)
    assert log[-1]["message"] == "outbox worker stopped", log[-3:]
    assert not said(procs, worker, "received SIGINT, stopping"), "one line says the signal: the worker's"
    # The calls in hand were finished and recorded; at INFO their runs are one sum line.
    assert states(clean) == {"sent": 2}
    assert not [e for e in log if " -> " in e["message"]], "a sent run is a DEBUG line"
    [summary] = said(procs, worker, "delivered:")
    assert summary["message"].startswith("delivered: sent=2 retried=0 failed=0 in the last ")
    assert (summary["level"], summary["sent"], summary["retried"], summary["failed"]) == ("INFO", 2, 0, 0)
    assert summary["by_destination"] == {"payments.charge": 2}


def test_a_second_ctrl_c_exits_at_once_and_the_rows_it_held_are_settled_as_after_a_crash(
    clean, engine, provider, tmp_path
):
    procs = Processes(
        clean, provider.url, tmp_path, timings={"SHOP_TIME_LIMIT": "4", "SHOP_LEASE_SECONDS": "6"}
    )
    try:
        provider.configure(latency_ms=3000)
        write_orders(engine, 2)
        relay_once(clean)
        worker = procs.worker(threads=2, OUTBOX_LOG_FORMAT="json")
        wait_for(lambda: provider.stats()["in_flight"] == 2, 30, f"both calls under way\n{procs.logs()}")
        os.kill(worker.pid, signal.SIGINT)
        wait_for(lambda: said(procs, worker, "received SIGINT: outbox worker stopping"), 10, "the first line")
        [stopping] = said(procs, worker, "received SIGINT: outbox worker stopping")
        assert stopping["message"] == STOPPING.format(6) + AGAIN
        os.kill(worker.pid, signal.SIGINT)
        # At once: the calls (3 s) were not waited for, nor their 6 s of grace.
        assert worker.wait(2) == 128 + signal.SIGINT, procs.logs()
        [forced] = said(procs, worker, "received SIGINT again")
        assert forced["level"] == "WARNING"
        assert forced["message"] == (
            "received SIGINT again: outbox worker exiting now, 2 messages left in hand (their rows "
            "stay claimed until their leases expire; the reconciler settles them)"
        )
        assert forced["in_hand"] == 2
        assert not said(procs, worker, "outbox worker stopped")
        # Where a crash leaves them: claimed, nothing recorded.
        assert states(clean) == {"in_flight": 2}

        # Their leases expire, the reconciler settles them (looked up), a new worker sends
        # what was not charged: each order charged once.
        procs.reconciler()
        procs.relay()
        procs.worker(threads=2)
        provider.configure(latency_ms=0)
        wait_for(lambda: states(clean) == {"sent": 2}, 60, f"both rows sent\n{procs.logs()}")
        assert provider.stats()["double_charged"] == []
        assert sql(clean, "SELECT count(*) FROM outbox_message WHERE provider_ref IS NULL")[0][0] == 0
    finally:
        procs.stop_all()


def test_ctrl_c_to_a_supervisor_stops_its_processes_and_each_says_so(clean, provider, procs):
    worker = procs.start(
        "worker", "examples.shop.handlers", "--processes", "2", "--concurrency", "1", OUTBOX_LOG_FORMAT="json"
    )
    wait_for(
        lambda: len(said(procs, worker, "outbox worker started")) == 2, 30, f"two processes\n{procs.logs()}"
    )
    os.kill(worker.pid, signal.SIGINT)
    assert worker.wait(30) == 0, procs.logs()
    log = entries(procs, worker)
    [parent] = [e for e in log if e["message"].startswith("received SIGINT: outbox worker stopping")]
    assert parent["message"] == (
        "received SIGINT: outbox worker stopping: 2 worker processes finishing the messages in hand; "
        "Ctrl-C again stops them at once (their rows stay claimed until their leases expire)"
    )
    assert parent["processes"] == 2
    # The children hear the supervisor's SIGTERM; a second one would not force them out (a
    # process group, or a systemd unit's cgroup, signalled as a whole gets one from both).
    children = [e for e in log if e["message"].startswith("received SIGTERM: outbox worker stopping")]
    assert len(children) == 2, children
    for child in children:
        assert child["message"].startswith("received SIGTERM: outbox worker stopping: finishing ")
        assert child["message"].endswith(" in hand, waiting up to 3 s for them"), "no second SIGTERM hint"
    assert len(said(procs, worker, "outbox worker stopped")) == 3
    assert log[-1]["message"] == "outbox worker stopped"


def test_a_supervisor_and_its_processes_signalled_together_stop_cleanly(clean, engine, provider, procs):
    """SIGTERM to the whole process group (a systemd unit's stop, `kill -TERM -PGID`): each child
    gets it from the group and then from its supervisor, and still finishes its call. (Here one
    after the other, as two signals sent together may arrive as one.)"""
    provider.configure(latency_ms=1000)
    write_orders(engine, 2)
    relay_once(clean)
    worker = procs.start(
        "worker", "examples.shop.handlers", "--processes", "2", "--concurrency", "1", OUTBOX_LOG_FORMAT="json"
    )
    wait_for(lambda: provider.stats()["in_flight"] == 2, 30, f"both calls under way\n{procs.logs()}")
    for child in _children(worker.pid):
        os.kill(child, signal.SIGTERM)
    wait_for(lambda: len(said(procs, worker, "received SIGTERM: outbox worker stopping")) == 2, 10, "2 lines")
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait(30) == 0, procs.logs()
    assert not said(procs, worker, "received SIGTERM again: outbox worker exiting now")
    assert len(said(procs, worker, "received SIGTERM again, still stopping")) == 2, procs.logs()
    children = said(procs, worker, "received SIGTERM: outbox worker stopping: finishing 1 message in hand")
    assert len(children) == 2, procs.logs()
    assert len(said(procs, worker, "outbox worker stopped")) == 3
    assert states(clean) == {"sent": 2}, "each child finished its call"


def test_a_second_ctrl_c_during_the_start_up_checks_exits_at_once(procs, tmp_path):
    # A PostgreSQL that accepts the connection and never answers (a frozen host, a hung pooler):
    # the start-up check waits on it up to OUTBOX_CONNECT_TIMEOUT (15 s), and a stop must not.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        worker = procs.worker(OUTBOX_DATABASE_URL=f"postgresql://outbox@127.0.0.1:{port}/outbox")
        time.sleep(2)  # imported, and waiting on the database
        assert worker.poll() is None, procs.logs()
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker.poll() is None, "the first Ctrl-C is a clean stop, after the check"
        os.kill(worker.pid, signal.SIGINT)
        assert worker.wait(10) == 130, procs.logs()
        assert "received SIGINT again: outbox worker exiting now, 0 messages left in hand" in procs.log_of(
            worker
        )
    finally:
        silent.close()


def test_a_database_that_accepts_and_never_answers_is_given_up_after_the_connect_timeout(procs):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        started = time.monotonic()
        worker = procs.worker(
            OUTBOX_DATABASE_URL=f"postgresql://outbox@127.0.0.1:{port}/outbox", OUTBOX_CONNECT_TIMEOUT="2s"
        )
        code = worker.wait(30)
        waited = time.monotonic() - started
        assert code not in (0, None), procs.logs()
        assert "timeout expired" in procs.log_of(worker), procs.logs()
        assert waited < 20, f"gave up after {waited:.1f} s"
    finally:
        silent.close()


def test_the_processes_of_a_supervisor_do_not_import_the_applications_files_named_like_a_library(
    procs, tmp_path
):
    # Run from the application's directory, which holds its handler module and, by chance, files
    # named like modules outbox imports: only MODULE is imported from there.
    app = tmp_path / "app"
    (app / "myapp").mkdir(parents=True)
    (app / "myapp" / "__init__.py").write_text("")
    (app / "myapp" / "handlers.py").write_text(
        "import outbox\n\n\n@outbox.handler('shadow.test')\n"
        "def charge(d: outbox.Delivery) -> outbox.Confirmed:\n    return outbox.Confirmed(ref='x')\n"
    )
    for shadow in ("redis.py", "httpx.py", "psycopg.py"):
        (app / shadow).write_text("raise SystemExit(77)\n")
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [str(Path(sys.executable).with_name("outbox")), "worker", "myapp.handlers", "--processes", "2"],
            cwd=app,
            env=procs.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    procs.running.append(worker)
    try:
        wait_for(
            lambda: log_path.read_text().count("outbox worker started") == 2,
            60,
            f"two processes started\n{log_path.read_text()}",
        )
        assert "exited with 77" not in log_path.read_text()
    finally:
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(30) == 0, log_path.read_text()
