"""``resolve_unknown`` against real PostgreSQL and the provider simulator."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from helpers import elapse

import outbox
from outbox import store
from outbox.consumer import DeliveryResult
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import libpq_url

from .support import (
    DEST,
    TIME_LIMIT,
    charge_at_provider,
    declare_charge,
    get,
    make_unknown,
    write_rows,
)

# -- 2. resolve_unknown ----------------------------------------------------------------------------


def test_resolve_unknown_settles_found_not_found_and_exhausted_rows(clean, engine, db, provider, consumer):
    handler = declare_charge(provider, max_attempts=2)
    ids = write_rows(engine, 3)
    # Row 3's deadline is about to pass: no time for a retry.
    ids += write_rows(engine, 1, start=3, deadline=datetime.now(UTC) + timedelta(seconds=5))
    # Row 0: the provider charged, then the connection dropped: a real ambiguous outcome.
    provider.configure(fault_keys={"order:0:charge": "drop_after"})
    assert consumer().deliver(ids[0], DEST) is DeliveryResult.UNKNOWN
    # Its first lookup waits one time_limit (the provider may still be executing the call);
    # pretend that time has passed.
    assert get(db, ids[0])["available_at"] > datetime.now(UTC)
    elapse(db, TIME_LIMIT, [ids[0]])
    # Row 1: timed out before the provider processed it. Row 2: the same, on its last attempt.
    make_unknown(db, ids[1])
    retried = store.delivery.claim(db, row_id=ids[2], destination=DEST, lease_seconds=30)
    assert retried is not None  # its first attempt got a 503, retried at once
    assert store.delivery.record(
        db, row_id=ids[2], token=retried.token, state="pending", outcome="retry", delay_seconds=0
    ).state
    make_unknown(db, ids[2])
    # Row 3: timed out, but its deadline is about to pass: no time for a retry.
    make_unknown(db, ids[3])

    before = datetime.now(UTC)
    assert resolve_unknown(db, {DEST: handler}) == {"sent": 1, "pending": 1, "failed": 2}

    sent = get(db, ids[0])
    assert sent["state"] == "sent" and sent["provider_ref"] == "ch_1"
    assert sent["response"] == {"id": "ch_1"} and sent["completed_at"] is not None
    assert sent["unknown_since"] is None
    assert [(h["by"], h["action"], h["result"], h["provider_ref"]) for h in sent["history"]] == [
        ("reconciler", "lookup", "found", "ch_1")
    ]
    pending = get(db, ids[1])
    assert pending["state"] == "pending" and pending["dispatched_at"] is None
    # The next attempt waits the handler's first backoff (30 s), as any retry does.
    assert before + timedelta(seconds=25) < pending["available_at"] < before + timedelta(seconds=40)
    assert "no record" in pending["last_error"]
    assert [h["result"] for h in pending["history"]] == ["not_found"]
    exhausted = get(db, ids[2])
    assert exhausted["state"] == "failed" and exhausted["completed_at"] is not None
    assert exhausted["last_error"].startswith("gave up after 2 attempts")
    assert get(db, ids[3])["last_error"].startswith("deadline")
    # The lookups charged nobody: only the one real call did.
    assert provider.stats()["effects"] == {"order:0:charge": 1}


def test_failing_lookups_keep_rows_unknown_with_growing_backoff(clean, engine, db, provider):
    handler = declare_charge(provider)
    ids = write_rows(engine, 5)
    for row_id in ids:
        make_unknown(db, row_id)
    elapse(db, 600, [ids[0]])
    provider.configure(lookup_fail=True)

    # After three failures in a row the destination's other rows are not asked this run.
    assert resolve_unknown(db, {DEST: handler}) == {"lookup_failed": 3, "deferred": 2}
    now = datetime.now(UTC)
    rows = [get(db, i) for i in ids]
    assert all(r["state"] == "unknown" for r in rows)
    assert rows[1]["last_error"] == "lookup failed: HTTP 503 from 127.0.0.1"
    assert rows[4]["last_error"] == "ReadTimeout"  # deferred, not looked up: reason kept
    # The wait grows with how long the row has been unknown: 10 s at first, here ~10 min.
    assert timedelta(seconds=5) < rows[1]["available_at"] - now < timedelta(seconds=15)
    assert timedelta(seconds=590) < rows[0]["available_at"] - now < timedelta(seconds=610)
    assert resolve_unknown(db, {DEST: handler}) == {}


def test_lookups_of_a_destination_run_at_once_up_to_the_limit(clean, engine, db, provider):
    """A worker killed with its calls in flight leaves as many `unknown` rows: asked one at a
    time, a 300 ms provider would settle three a second. The run asks up to
    ``lookup_concurrency`` of them at once (one, then doubling while they answer), counted by
    the provider itself, and settles every row on its answer."""
    handler = declare_charge(provider)
    ids = write_rows(engine, 40)
    for row_id in ids:
        make_unknown(db, row_id)
    for i in range(0, 40, 2):
        charge_at_provider(provider, f"order:{i}:charge")
    elapse(db, 600)
    provider.configure(latency_ms=300)

    started = time.monotonic()
    assert resolve_unknown(db, {DEST: handler}, lookup_concurrency=8) == {"sent": 20, "pending": 20}
    elapsed = time.monotonic() - started

    stats = provider.stats()
    assert stats["lookups"] == 40
    assert stats["most_lookups_in_flight"] == 8
    # 1 + 2 + 4 + 8 rows, then 8 at a time: 7 rounds of 300 ms, where one at a time takes 12 s.
    assert elapsed < 6.0, elapsed
    assert {get(db, i)["state"] for i in ids[0::2]} == {"sent"}
    assert {get(db, i)["state"] for i in ids[1::2]} == {"pending"}
    assert stats["charges"] == 20


def test_a_failing_destination_is_asked_one_at_a_time_beside_a_healthy_one(clean, engine, db, provider):
    """A destination whose lookups fail goes back to one lookup in flight after each failure,
    and is left alone after three in a row; another destination's lookups run at full width in
    the same run."""
    healthy = declare_charge(provider)
    asked: list[int] = []

    @outbox.handler("mail.send", time_limit=TIME_LIMIT)
    def send(d: outbox.Delivery) -> None:
        raise AssertionError("never called")

    @send.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        asked.append(d.id)
        raise RuntimeError("the mail provider's API is down")

    charged = write_rows(engine, 12)
    mails = write_rows(engine, 6, destination="mail.send", start=12)
    for row_id in charged:
        make_unknown(db, row_id)
    for row_id in mails:
        make_unknown(db, row_id, destination="mail.send")
    for i in range(12):
        charge_at_provider(provider, f"order:{i}:charge")
    elapse(db, 600)
    provider.configure(latency_ms=100)

    counts = resolve_unknown(db, {DEST: healthy, "mail.send": send}, lookup_concurrency=4)
    assert counts == {"sent": 12, "lookup_failed": 3, "deferred": 3}
    assert asked == mails[:3]
    assert provider.stats()["most_lookups_in_flight"] == 4
    down = "lookup failed: RuntimeError: the mail provider's API is down"
    assert [get(db, i)["last_error"] for i in mails[:3]] == [down] * 3


def test_a_run_takes_batch_after_batch_while_they_come_full(clean, engine, db, provider):
    """A run is not one batch (at the default 10 s interval, one batch of 100 a run would settle
    10 rows a second whatever the concurrency): of 25 due rows in batches of 10, a run of at
    most 2 batches settles 20, and the next run, its last batch not full, the other 5."""
    handler = declare_charge(provider)
    ids = write_rows(engine, 25)
    for row_id in ids:
        make_unknown(db, row_id)
        charge_at_provider(provider, f"order:{ids.index(row_id)}:charge")
    elapse(db, 600)
    assert resolve_unknown(db, {DEST: handler}, batch_size=10, max_batches=2) == {"sent": 20}
    assert resolve_unknown(db, {DEST: handler}, batch_size=10) == {"sent": 5}
    assert {get(db, i)["state"] for i in ids} == {"sent"}


def test_a_stop_asks_no_more_lookups_and_settles_those_asked(clean, engine, db, provider):
    """Shutting down: the lookups already asked are settled on their answers; the other rows are
    left due for the next reconciler (counted ``interrupted``)."""
    handler = declare_charge(provider)
    stop = threading.Event()
    ids = write_rows(engine, 5)
    for row_id in ids:
        make_unknown(db, row_id)
        charge_at_provider(provider, f"order:{ids.index(row_id)}:charge")
    elapse(db, 600)
    lookup = handler.lookup_fn
    assert lookup is not None

    @handler.lookup
    def stopping(d: outbox.Delivery) -> outbox.Confirmed | None:
        stop.set()
        return lookup(d)

    assert resolve_unknown(db, {DEST: handler}, stop=stop) == {"sent": 1, "interrupted": 4}
    assert [get(db, i)["state"] for i in ids] == ["sent"] + ["unknown"] * 4


def test_rows_no_lookup_can_settle_wait_for_a_human(clean, engine, db, provider):
    careful = declare_charge(provider, lookup=False, idempotent=False)
    deduped = declare_charge(provider, destination="mail.send", lookup=False, idempotent=True)
    ids = write_rows(engine, 1)
    ids += write_rows(engine, 1, destination="mail.send", start=1)
    ids += write_rows(engine, 1, destination="ghost.dest", start=2)
    make_unknown(db, ids[0])
    make_unknown(db, ids[1], "mail.send")
    make_unknown(db, ids[2], "ghost.dest")

    counts = resolve_unknown(db, {DEST: careful, "mail.send": deduped}, module="shop.handlers")
    assert counts == {"needs_human": 1, "pending": 1, "no_handler": 1}
    human, retried, orphan = (get(db, i) for i in ids)
    assert human["state"] == "unknown" and "outbox resolve" in human["last_error"]
    assert human["available_at"] > datetime.now(UTC) + timedelta(minutes=59)
    assert retried["state"] == "pending"
    assert [h["result"] for h in retried["history"]] == ["no_lookup_idempotent"]
    assert orphan["state"] == "unknown"
    assert "no handler for destination ghost.dest in shop.handlers" in orphan["last_error"]
    # Parked for an hour: the next run does not ask again.
    assert resolve_unknown(db, {DEST: careful, "mail.send": deduped}) == {}


def test_resolve_unknown_refuses_a_connection_inside_a_transaction(clean, services, provider):
    handler = declare_charge(provider)
    with (
        psycopg.connect(libpq_url(services.database_url)) as conn,
        pytest.raises(ValueError, match="autocommit"),
    ):
        resolve_unknown(conn, {DEST: handler})


def test_the_lookup_concurrency_setting_reaches_the_job(clean, monkeypatch, capsys, provider):
    from outbox import settings
    from outbox.cli import main
    from outbox.reconciler.jobs.resolve_unknown import ResolveUnknown
    from outbox.reconciler.scheduler import Reconciler

    cfg = settings.from_env(
        {"OUTBOX_DATABASE_URL": clean.database_url, "OUTBOX_REDIS_URL": clean.redis_url},
        lookup_concurrency=3,
    )
    with Reconciler.from_settings(cfg, handlers={DEST: declare_charge(provider)}, module="m") as reconciler:
        [job] = [j for j in reconciler._build_jobs() if isinstance(j, ResolveUnknown)]
        assert job.config.lookup_concurrency == 3
    monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
    monkeypatch.setenv("OUTBOX_REDIS_URL", clean.redis_url)
    assert main(["reconcile", "no.such.module", "--lookup-concurrency", "0", "--once"]) == 2
    assert "--lookup-concurrency must be at least 1, got 0" in capsys.readouterr().err
