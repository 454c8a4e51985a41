"""A Redis failover under Sentinel, with the real processes: ``outbox relay``, ``outbox worker``
and ``outbox reconcile`` reach Redis through ``redis+sentinel://`` (one primary, one replica,
three sentinels, all started here: tests/sentinel_servers). The primary is SIGKILLed while rows
are dispatched and in flight to a slow provider; the sentinels promote the replica; nobody is
restarted.

What must hold, by the provider's own counters and the processes' ids: every row ends ``sent``,
each key was charged exactly once, and the relay, worker and reconciler that started are the
ones that finish. Replication is asynchronous, so the last writes to the old primary may be
gone: a message (the relay's publish) lost that way is published again by the reconciler's
redispatch, here after ``OUTBOX_REDISPATCH_AFTER=3`` s (FAST, tests/acceptance/support.py), and
an ack lost that way only hands the message to an empty claim."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from helpers import wait_for
from sentinel_servers import DOWN_AFTER_MS, SentinelDeployment, sentinel_deployment
from sqlalchemy.orm import Session

import outbox

from .support import FAST, Processes, states

pytestmark = pytest.mark.timeout(150)

#: The redispatch setting this test runs with: a dispatched row whose message is not in Redis
#: after this long is published again by the reconciler.
REDISPATCH_AFTER = "3"
BEFORE, AFTER = 60, 20


@pytest.fixture
def deployment() -> Iterator[SentinelDeployment]:
    with sentinel_deployment() as d:
        yield d


def write_orders(engine, start: int, n: int) -> None:
    with Session(engine) as s, s.begin():
        for i in range(start, start + n):
            outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination="payments.charge",
                payload={"amount_cents": 1000 + i, "currency": "EUR"},
            )


def test_the_primary_killed_mid_run_every_row_is_sent_once_and_nobody_restarts(
    clean, engine, provider, deployment, tmp_path
) -> None:
    assert FAST["OUTBOX_REDISPATCH_AFTER"] == REDISPATCH_AFTER
    started = time.monotonic()
    procs = Processes(
        clean,
        provider.url,
        tmp_path,
        timings={"OUTBOX_REDIS_URL": deployment.url(), "OUTBOX_REDISPATCH_AFTER": REDISPATCH_AFTER},
    )
    # Each call takes 300 ms: with 4 threads, the backlog takes some 5 s to drain, so that the
    # kill finds rows sent, rows in flight (the provider answering) and rows dispatched (queued).
    provider.configure(latency_ms=300)
    try:
        worker = procs.worker(threads=4)
        relay = procs.relay()
        reconciler = procs.reconciler()
        everyone = {"worker": worker, "relay": relay, "reconciler": reconciler}
        pids = {name: p.pid for name, p in everyone.items()}
        procs.wait_started([worker])

        write_orders(engine, 0, BEFORE)
        wait_for(
            lambda: states(clean).get("sent", 0) >= 8 and states(clean).get("in_flight", 0) >= 1,
            30,
            f"rows sent and in flight\n{procs.logs()}",
        )
        at_kill = states(clean)
        old = deployment.kill_primary()
        new = deployment.wait_promoted(old, timeout=10 + DOWN_AFTER_MS / 1000)
        assert at_kill.get("sent", 0) < BEFORE, at_kill
        assert at_kill.get("in_flight", 0) + at_kill.get("dispatched", 0) >= 1, at_kill

        write_orders(engine, BEFORE, AFTER)  # published to the new primary only
        total = BEFORE + AFTER
        wait_for(
            lambda: states(clean) == {"sent": total},
            60,
            f"every row sent (states {states(clean)})\n{procs.logs()}\n{deployment.logs()}",
            every=0.2,
        )

        stats = provider.stats()
        assert stats["effects"] == {f"order:{i}:charge": 1 for i in range(total)}
        assert stats["double_charged"] == []
        # No restart: the processes that started are the ones running, each started once.
        for name, proc in everyone.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{procs.log_of(proc)}"
            assert proc.pid == pids[name]
        assert procs.log_of(worker).count("outbox worker started") == 1
        # The worker's connections went over to the promoted replica.
        assert f"is now 127.0.0.1:{new} (was 127.0.0.1:{old})" in procs.log_of(worker)
        assert time.monotonic() - started < 90
    finally:
        procs.stop_all()
