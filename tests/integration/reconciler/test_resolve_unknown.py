"""``resolve_unknown`` against real PostgreSQL and the provider simulator."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from helpers import elapse

from outbox import store
from outbox.consumer import DeliveryResult
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import libpq_url

from .support import (
    DEST,
    TIME_LIMIT,
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
