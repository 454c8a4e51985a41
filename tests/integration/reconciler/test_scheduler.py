"""The ``Reconciler`` running every job: one reconciler acts per job at a time, and a whole run
takes an expired claim through to `sent`."""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from helpers import elapse, relay_once

from outbox import store
from outbox.reconciler import Job, scheduler
from outbox.reconciler.scheduler import JOB_LOCK_IDS, LOCK_CLASS
from outbox.settings import libpq_url

from .support import (
    DEST,
    TIME_LIMIT,
    charge_at_provider,
    declare_charge,
    expire_lease_now,
    fence_outcomes,
    get,
    make_unknown,
    settle,
    write_rows,
)

#: The jobs of a reconciler without a metrics port (database_metrics runs only with one).
JOBS = [job for job in JOB_LOCK_IDS if job != "database_metrics"]

# -- only one reconciler acts at a time ------------------------------------------------------------


def test_a_job_whose_lock_is_held_elsewhere_is_skipped(clean, engine, db, reconcilers):
    (row_id,) = write_rows(engine, 1)
    assert store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
    expire_lease_now(db, row_id)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_CLASS, JOB_LOCK_IDS["expire_leases"]))
        assert reconcilers().run_job("expire_leases") == {"skipped": 1}
        assert get(db, row_id)["state"] == "in_flight"
    assert reconcilers().run_job("expire_leases") == {"expired": 1}


def test_two_reconcilers_at_once_act_once_per_job(clean, engine, db, provider, reconcilers, caplog):
    declare_charge(provider)
    # expire_leases: 4 claims whose lease expired (no charge at the provider).
    expired = write_rows(engine, 4)
    for row_id in expired:
        assert store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        expire_lease_now(db, row_id)
    # resolve_unknown: 3 unknown rows the provider did charge.
    unknown = write_rows(engine, 3, start=4)
    for i, row_id in enumerate(unknown, start=4):
        make_unknown(db, row_id)
        charge_at_provider(provider, f"order:{i}:charge")
    # redispatch: 3 dispatched rows whose messages are gone.
    lost = write_rows(engine, 3, start=7)
    assert relay_once(clean) == 3
    elapse(db, 60, lost)
    # purge: 5 old sent rows. alerts: 2 failed rows.
    old = write_rows(engine, 5, start=10)
    for row_id in old:
        settle(db, row_id, "sent", ref="ch")
    elapse(db, 30 * 86400, old)
    failed = write_rows(engine, 2, start=15)
    for row_id in failed:
        settle(db, row_id, "failed", error="card declined")

    # Each job, once it holds its lock, waits until the other reconciler has tried the same job:
    # the two overlap on every job, whatever the thread scheduling.
    tried: dict[tuple[str, str], threading.Event] = {
        (who, job): threading.Event() for who in "AB" for job in JOBS
    }
    overlapped: list[bool] = []

    class Tried(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            key = (getattr(record, "reconciler", None), getattr(record, "job", None))
            if key in tried:
                tried[key].set()

    alerts: dict[str, list[int]] = {"A": [], "B": []}
    pair = {"A": "B", "B": "A"}
    instances = {
        who: reconcilers(name=who, alert_hook=lambda row, who=who: alerts[who].append(row.id)) for who in "AB"
    }
    for who, rec in instances.items():
        for name, job in list(rec.jobs.items()):

            def waiting(conn: psycopg.Connection[Any], run=job.run, key=(pair[who], name)) -> dict[str, int]:
                overlapped.append(tried[key].wait(10))
                return run(conn)

            rec.jobs[name] = Job(name, job.lock_id, waiting)

    handler = Tried()
    logging.getLogger("outbox.reconciler").addHandler(handler)
    results: dict[str, dict[str, dict[str, int]]] = {}
    try:
        # DEBUG: a job another reconciler holds is logged at DEBUG (an idle run), and Tried needs it.
        with caplog.at_level(logging.DEBUG, logger="outbox.reconciler"):
            threads = [
                threading.Thread(target=lambda who=who: results.__setitem__(who, instances[who].run_once()))
                for who in "AB"
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        logging.getLogger("outbox.reconciler").removeHandler(handler)

    assert set(results) == {"A", "B"}
    assert overlapped == [True] * len(JOBS)
    acted: dict[str, dict[str, int]] = {}
    for job in JOBS:
        pair_results = [results["A"][job], results["B"][job]]
        assert pair_results.count({"skipped": 1}) == 1, (job, pair_results)
        acted[job] = next(r for r in pair_results if r != {"skipped": 1})
    assert acted == {
        "expire_leases": {"expired": 4},
        # The expired rows' first lookup waits one time_limit: not in this run.
        "resolve_unknown": {"sent": 3},
        "redispatch": {"missing": 3},
        "purge": {"purged": 5, "batches": 1},
        "alerts": {"alerts": 2},
        # No worker heartbeat in this test: its waiting rows' destination has no consumer (one
        # destination, alerted only after OUTBOX_NO_CONSUMER_CYCLES runs).
        "no_consumer": {"no_consumer": 1},
        # Nothing paused, no breaker open: nothing to do.
        "held_destinations": {},
        # No row resolved sent without the handler module.
        "chains": {},
        # No batch.
        "batches": {},
    }
    # No row moved twice: one fence closing per expired claim, one lookup entry per resolved row,
    # one alert per failed row.
    assert [fence_outcomes(db, r) for r in expired] == [["lease_expired"]] * 4
    assert [get(db, r)["state"] for r in expired] == ["unknown"] * 4
    histories = [len(get(db, r)["history"]) for r in expired + unknown]
    assert histories == [0] * 4 + [1] * 3
    assert sorted(alerts["A"] + alerts["B"]) == failed
    assert [get(db, r)["state"] for r in lost] == ["pending"] * 3


# -- the whole run ---------------------------------------------------------------------------------


def test_run_once_takes_an_expired_claim_through_to_sent(clean, engine, db, provider, reconcilers):
    declare_charge(provider)
    (row_id,) = write_rows(engine, 1)
    assert relay_once(clean) == 1
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    # The worker charged, then died before recording.
    charge_at_provider(provider, "order:0:charge")
    expire_lease_now(db, row_id)

    reconciler = reconcilers()
    result = reconciler.run_once()
    assert result["expire_leases"] == {"expired": 1}
    # The worker might still have been in its call: the first lookup waits one time_limit.
    assert result["resolve_unknown"] == {}
    assert set(result) == set(JOBS)
    elapse(db, TIME_LIMIT, [row_id])
    assert reconciler.run_once()["resolve_unknown"] == {"sent": 1}
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"]) == ("sent", "ch_1")
    assert fence_outcomes(db, row_id) == ["lease_expired"]
    assert provider.stats()["charges"] == 1


# -- an idle reconciler is quiet -------------------------------------------------------------------


def test_an_idle_reconciler_logs_at_debug_with_one_info_heartbeat_per_interval(
    clean, engine, db, reconcilers, caplog
):
    rec = reconcilers()
    cycles = 20

    def info_lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("outbox.reconciler") and r.levelno >= logging.INFO
        ]

    with caplog.at_level(logging.DEBUG, logger="outbox.reconciler"):
        for _ in range(cycles):
            results = rec.run_once()
            assert all(counts == {} for counts in results.values()), results
        # Every job run is still logged, at DEBUG, and nothing at INFO.
        debug = [
            r
            for r in caplog.records
            if r.name == "outbox.reconciler.scheduler" and r.levelno == logging.DEBUG
        ]
        assert len(debug) >= cycles * len(JOBS)
        assert info_lines() == []

        # Ten quiet minutes later, the next idle run says once that the reconciler is alive.
        caplog.clear()
        rec._last_info -= scheduler.IDLE_HEARTBEAT_SECONDS
        rec.run_once()
        rec.run_once()
        assert len(info_lines()) == 1
        assert info_lines()[0].startswith("reconciler idle: ")

        # A run that moves a row logs at INFO as before.
        caplog.clear()
        (row_id,) = write_rows(engine, 1)
        assert store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        expire_lease_now(db, row_id)
        assert rec.run_job("expire_leases") == {"expired": 1}
        assert info_lines() == ["reconciler expire_leases: expired=1"]
