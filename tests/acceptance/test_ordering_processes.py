"""Per-key ordering with real processes (issue 15): two `outbox relay` processes, worker
processes SIGKILLed every half second while they deliver, and a reconciler re-dispatching what
the kills left; the provider (no deduplication) charges every row once, and within each
ordering key in the order the rows were written. Real signals, real PostgreSQL and Redis."""

from __future__ import annotations

import random
import time

import pytest
from helpers import sql
from sqlalchemy.orm import Session

import outbox

from .support import Processes, kill, states

pytestmark = pytest.mark.timeout(300)

KEYS = 30
ROWS_PER_KEY = 30


def write_ordered(engine) -> None:
    """Rows of KEYS customers interleaved, one transaction each, as their changes would come."""
    for n in range(ROWS_PER_KEY):
        for k in range(KEYS):
            with Session(engine) as s, s.begin():
                outbox.write(
                    s,
                    key=f"customer:{k}:change:{n}",
                    step="charge",
                    destination="payments.charge",
                    payload={"amount_cents": 1000 + n, "currency": "EUR"},
                    ordering_key=f"customer:{k}",
                )


def test_workers_killed_under_two_relays_keep_each_keys_order_and_charge_once(
    clean, engine, provider, tmp_path
):
    total = KEYS * ROWS_PER_KEY
    procs = Processes(clean, provider.url, tmp_path)
    try:
        write_ordered(engine)
        procs.relay()
        procs.relay()
        procs.reconciler()
        workers = [procs.worker(threads=4) for _ in range(2)]
        rng = random.Random(15)
        kills = 0  # while rows were still waiting
        chaos_until = time.monotonic() + 12
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            if states(clean).get("sent", 0) == total:
                break
            if time.monotonic() < chaos_until:
                i = rng.randrange(len(workers))
                kill(workers[i])
                kills += 1
                workers[i] = procs.worker(threads=4)
            time.sleep(0.5)
        final = states(clean)
        assert kills >= 5, f"chaos did not run long enough to mean anything ({kills} kills)"
        assert final == {"sent": total}, f"{final}\n{procs.logs()}"
    finally:
        procs.stop_all()
    stats = provider.stats()
    assert stats["double_charged"] == [] and stats["charges"] == total
    # The provider's own order of first charges (insertion-ordered), per ordering key.
    order = {key: n for n, key in enumerate(stats["effects"])}
    for k in range(KEYS):
        charged = [order[f"customer:{k}:change:{n}:charge"] for n in range(ROWS_PER_KEY)]
        assert charged == sorted(charged), f"customer:{k} charged out of order: {charged}"
    # And the database agrees: within a key, each row confirmed after the one before it.
    (disorder,) = sql(
        clean,
        "SELECT count(*) FROM (SELECT completed_at < lag(completed_at) OVER "
        "(PARTITION BY ordering_key ORDER BY id) AS early FROM outbox_message) t WHERE early",
    )[0]
    assert disorder == 0
