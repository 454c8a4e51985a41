"""`outbox worker` as a real process: several processes deliver, SIGTERM stops them all with 0."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import relay_once, sql, wait_for

from .support import Processes
from .test_crash import write_orders

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def procs(clean, provider, tmp_path):
    p = Processes(clean, provider.url, tmp_path)
    yield p
    p.stop_all()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def test_worker_processes_deliver_and_stop_cleanly_on_sigterm(clean, engine, provider, procs):
    write_orders(engine, 40)
    relay_once(clean)
    worker = procs.start("worker", "examples.shop.handlers", "--processes", "2", "--concurrency", "2")
    wait_for(lambda: len(_children(worker.pid)) == 2, 20, "the two worker processes to start")
    children = _children(worker.pid)
    wait_for(
        lambda: sql(clean, "SELECT count(*) FROM outbox_message WHERE state = 'sent'")[0][0] == 40,
        60,
        f"the rows to be delivered\n{procs.logs()}",
    )
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, procs.logs()
    for child in children:
        assert not os.path.exists(f"/proc/{child}"), "a worker process outlived its supervisor"
    assert provider.stats()["charges"] == 40


def test_worker_without_urls_names_the_variable(clean, provider, procs, tmp_path):
    proc = procs.start("worker", "examples.shop.handlers", OUTBOX_REDIS_URL="")
    assert proc.wait(30) == 2
    log = procs.logs()
    assert "OUTBOX_REDIS_URL" in log and "Traceback" not in log


def test_worker_with_unknown_module_says_so(clean, provider, procs):
    proc = procs.start("worker", "no_such_module_anywhere")
    assert proc.wait(30) == 2
    assert "cannot import handler module 'no_such_module_anywhere'" in procs.logs()


def test_sigterm_while_worker_processes_are_still_starting_exits_0(clean, provider, procs):
    """A child that gets the forwarded SIGTERM before it took any message is a clean stop too."""
    worker = procs.start("worker", "examples.shop.handlers", "--processes", "2", "--concurrency", "1")
    wait_for(lambda: len(_children(worker.pid)) == 2, 20, "the two worker processes to start")
    children = _children(worker.pid)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, procs.logs()
    for child in children:
        assert not os.path.exists(f"/proc/{child}"), "a worker process outlived its supervisor"


CRASHING_CHILD = """
import sys

import outbox
from outbox import Confirmed

# The parent (--processes 2) loads this module and lives; each child (--processes 1) dies at once.
if sys.argv[sys.argv.index("--processes") + 1] == "1":
    raise SystemExit(3)


@outbox.handler("payments.charge")
def charge(d):
    return Confirmed(ref="x")
"""


def test_a_worker_whose_children_keep_dying_gives_up_with_exit_1(clean, procs, tmp_path):
    (tmp_path / "crashing_handlers.py").write_text(CRASHING_CHILD)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{procs.env()['PYTHONPATH']}"}
    worker = procs.start("worker", "crashing_handlers", "--processes", "2", **env)
    # Two children die at once, again 1 s later, again 2 s later: six deaths in the window.
    assert worker.wait(60) == 1, procs.log_of(worker)
    log = procs.log_of(worker)
    assert "restarting it in 1 s" in log and "restarting it in 2 s" in log
    assert "giving up" in log
    assert _children(worker.pid) == []


FREEZE_REPORTING = """
import gc
import os

from dramatiq.middleware import Middleware

import outbox
from outbox import Confirmed


class ReportFreeze(Middleware):
    def after_process_boot(self, broker):
        with open(os.environ["FREEZE_REPORT"], "w") as f:
            f.write(str(gc.get_freeze_count()))


outbox.worker_middleware(ReportFreeze())


@outbox.handler("payments.charge")
def charge(d):
    return Confirmed(ref="x")
"""


def test_a_worker_process_keeps_what_it_built_at_start_out_of_the_collector(clean, procs, tmp_path):
    """The objects of start-up (modules, handlers) are frozen (gc.freeze) in every process that
    delivers, so that a full collection, which stops every thread, walks only what deliveries
    made: an async worker's longest pauses halved (bench/README.md)."""
    (tmp_path / "freeze_handlers.py").write_text(FREEZE_REPORTING)
    report = tmp_path / "frozen"
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{procs.env()['PYTHONPATH']}", "FREEZE_REPORT": str(report)}
    worker = procs.start("worker", "freeze_handlers", **env)
    wait_for(report.exists, 30, f"the worker to boot\n{procs.logs()}")
    wait_for(lambda: report.read_text() != "", 5, "the report")
    assert int(report.read_text()) > 10_000, "start-up's objects are frozen, the modules' included"
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, procs.logs()
