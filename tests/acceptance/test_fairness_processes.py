"""Fairness with real processes (issue 33, part 3): tenant A has 5,000 rows waiting on a
destination limited to 100 calls/s, then tenant B writes 10 rows, one commit each: each of B's
rows is confirmed (``sent``) within 3 s of its commit, while most of A's backlog still waits.
Two `outbox worker` processes of 16 threads, a relay and a reconciler as subprocesses, the
provider simulator on 127.0.0.1, real PostgreSQL and Redis. Both instants are the database's."""

from __future__ import annotations

import time

import pytest
from helpers import sql
from sqlalchemy import text
from sqlalchemy.orm import Session

import outbox

from .support import Processes

pytestmark = pytest.mark.timeout(300)

DEST = "payments.charge"
A_ROWS = 5000
B_ROWS = 10


def test_a_small_tenant_is_not_queued_behind_a_large_tenants_backlog(clean, engine, provider, tmp_path):
    procs = Processes(clean, provider.url, tmp_path)
    try:
        done = procs.start("limit", DEST, "--per-second", "100", "--reason", "provider allows 100/s")
        assert done.wait(30) == 0, procs.log_of(done)
        with Session(engine) as s, s.begin():
            for n in range(A_ROWS):
                outbox.write(
                    s, key=f"a:{n}", step="charge", destination=DEST, payload={"amount_cents": n},
                    fairness_key="tenant:A",
                )  # fmt: skip
        workers = [procs.worker(threads=16, SHOP_LEASE_SECONDS="10") for _ in range(2)]
        procs.reconciler()
        procs.wait_started(workers)
        procs.relay()
        # A's backlog is flowing at the limit before B writes.
        deadline = time.monotonic() + 60
        while len(provider.arrivals()) < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(provider.arrivals()) >= 300, procs.logs()

        committed: dict[str, float] = {}
        for n in range(B_ROWS):
            with Session(engine) as s:
                with s.begin():
                    outbox.write(
                        s, key=f"b:{n}", step="charge", destination=DEST, payload={"amount_cents": n},
                        fairness_key="tenant:B",
                    )  # fmt: skip
                committed[f"b:{n}"] = float(
                    s.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar()
                )
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sent = sql(clean, "SELECT count(*) FROM outbox_message WHERE key LIKE 'b:%%' AND state = 'sent'")[
                0
            ][0]
            if sent == B_ROWS:
                break
            time.sleep(0.2)
        confirmed = dict(
            sql(
                clean,
                "SELECT key, extract(epoch FROM completed_at) FROM outbox_message "
                "WHERE key LIKE 'b:%%' AND state = 'sent'",
            )
        )
        a_waiting = sql(
            clean, "SELECT count(*) FROM outbox_message WHERE key LIKE 'a:%%' AND state <> 'sent'"
        )[0][0]
    finally:
        procs.stop_all()

    waits = {key: round(float(confirmed[key]) - at, 2) for key, at in committed.items() if key in confirmed}
    report = f"B's waits (s): {waits}; A's rows not yet sent when B was done: {a_waiting}"
    print(report)
    assert len(waits) == B_ROWS, f"{report}\n{procs.logs()}"
    assert max(waits.values()) <= 3.0, report
    # Behind a backlog: most of A still waited when B's rows were all confirmed.
    assert a_waiting > A_ROWS / 2, report
    stats = provider.stats()
    assert stats["double_charged"] == [], report
