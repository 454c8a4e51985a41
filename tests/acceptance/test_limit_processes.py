"""An in-flight limit with real processes (issue 33, part 1): four `outbox worker` processes of
8 slots each, one SIGKILLed and one added while they deliver, the limit lowered and raised with
`outbox limit` while they run. The provider simulator's own gauge of concurrent charges, sampled
at 20 Hz, never passes the limit that holds once 2 s have passed since it changed, a raised limit
is used within 2 s, and every row is charged once. A killed worker's calls keep their slots until
their leases expire and the wait before their first lookup is over. Real signals, real
PostgreSQL and Redis."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.orm import Session

import outbox

from .support import Processes, kill, states

pytestmark = pytest.mark.timeout(300)

DEST = "payments.charge"
ROWS = 500


def test_a_limit_holds_over_worker_processes_killed_added_lowered_and_raised(
    clean, engine, provider, tmp_path
):
    provider.slow(200)
    with Session(engine) as s, s.begin():
        for n in range(ROWS):
            outbox.write(
                s, key=f"order:{n}", step="charge", destination=DEST, payload={"amount_cents": 100 + n}
            )
    procs = Processes(clean, provider.url, tmp_path)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), provider.stats()["in_flight"]))
            time.sleep(0.05)

    def limit(*args: str) -> tuple[float, float]:
        """When `outbox limit` was started, and when it had exited (its commit is in between)."""
        started = time.monotonic()
        done = procs.start("limit", DEST, *args)
        assert done.wait(30) == 0, procs.log_of(done)
        return started, time.monotonic()

    sampler = threading.Thread(target=sample)
    try:
        _, set_at = limit("--in-flight", "6", "--reason", "provider allows 6")
        procs.relay()
        procs.reconciler()
        workers = [procs.worker(threads=8) for _ in range(4)]
        sampler.start()
        time.sleep(3)
        kill(workers[0])
        workers.append(procs.worker(threads=8))
        time.sleep(3)
        lowering, lowered_at = limit("--in-flight", "2", "--reason", "provider asked for 2")
        time.sleep(4)
        raising, raised_at = limit("--in-flight", "8", "--reason", "provider allows 8 again")
        time.sleep(4)
        limit("--clear")
        deadline = time.monotonic() + 120
        while states(clean).get("sent", 0) < ROWS and time.monotonic() < deadline:
            time.sleep(0.5)
        final = states(clean)
        assert final == {"sent": ROWS}, f"{final}\n{procs.logs()}"
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(10)
        procs.stop_all()

    def most(since: float, until: float) -> int:
        return max((n for t, n in samples if since <= t < until), default=0)

    timeline = " ".join(f"{t - set_at:.2f}:{n}" for t, n in samples)
    marks = f"lowered at {lowered_at - set_at:.2f}, raised at {raised_at - set_at:.2f}: {timeline}"
    assert most(set_at + 2, lowering) <= 6, marks
    assert most(lowered_at + 2, raising) <= 2, f"lowered: in effect within 2 s; {marks}"
    assert most(raised_at, raised_at + 2) > 2, f"raised: used within 2 s; {marks}"
    assert most(raised_at + 2, raised_at + 4) <= 8, marks
    stats = provider.stats()
    assert stats["double_charged"] == [] and stats["charges"] == ROWS
