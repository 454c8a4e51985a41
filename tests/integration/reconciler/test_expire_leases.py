"""``expire_leases`` against real PostgreSQL, and the race between a late recording and the
lease expiry."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from helpers import elapse, relay_once

import outbox
from outbox import store
from outbox.reconciler.jobs.expire_leases import LEASE_EXPIRED_ERROR, expire_leases
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import DEFAULT_TIME_LIMIT_SECONDS, libpq_url

from .support import (
    DEST,
    declare_charge,
    expire_lease_now,
    fence_outcomes,
    get,
    make_unknown,
    write_rows,
)

# -- 1. expire_leases ------------------------------------------------------------------------------


def test_expire_leases_moves_only_expired_rows_and_closes_their_fence(clean, engine, db):
    ids = write_rows(engine, 3)
    claims = {i: store.delivery.claim(db, row_id=i, destination=DEST, lease_seconds=30) for i in ids}
    expire_lease_now(db, ids[0])
    expire_lease_now(db, ids[1])

    assert expire_leases(db) == 2
    assert expire_leases(db) == 0

    for row_id in ids[:2]:
        r = get(db, row_id)
        assert r["state"] == "unknown"
        # The first lookup waits one time_limit (30 s when the handlers are not given).
        assert r["unknown_since"] is not None
        assert r["available_at"] == r["unknown_since"] + timedelta(seconds=30)
        assert r["lease_expires_at"] is None
        assert r["last_error"] == LEASE_EXPIRED_ERROR
        claimed = claims[row_id]
        assert claimed is not None and r["claim_token"] == claimed.token
        assert fence_outcomes(db, row_id) == ["lease_expired"]
    assert get(db, ids[2])["state"] == "in_flight"
    assert fence_outcomes(db, ids[2]) == [None]


def test_expire_leases_inside_a_callers_transaction_commits_with_it(clean, engine, services):
    (row_id,) = write_rows(engine, 1)
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        assert store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        expire_lease_now(conn, row_id)
        conn.commit()
        assert expire_leases(conn) == 1
        conn.rollback()
        assert conn.execute("SELECT state FROM outbox_message").fetchone() == ("in_flight",)


# -- the race between a late recording and the lease expiry ----------------------------------------


def test_late_record_by_the_expired_claim_still_settles_the_row(clean, engine, db, provider, reconcilers):
    calls: list[int] = []
    declare_charge(provider, lookup_calls=calls)
    (row_id,) = write_rows(engine, 1)
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    expire_lease_now(db, row_id)
    assert expire_leases(db) == 1

    # The worker was only slow: its answer arrives after the expiry, under the same claim.
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref="ch_late"
    ).state
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"], r["unknown_since"]) == ("sent", "ch_late", None)
    assert fence_outcomes(db, row_id) == ["sent"]

    assert reconcilers().run_job("resolve_unknown") == {}
    assert calls == []


def test_late_record_after_a_newer_claim_changes_nothing_on_the_row(clean, engine, db, provider):
    handler = declare_charge(provider, max_attempts=3)
    (row_id,) = write_rows(engine, 1)
    first = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert first is not None
    expire_lease_now(db, row_id)
    assert expire_leases(db) == 1
    # Its first lookup waits one time_limit (the default: no handlers named); that time passes.
    elapse(db, DEFAULT_TIME_LIMIT_SECONDS, [row_id])
    # The provider has no charge yet: the reconciler concludes "not taken effect" and retries.
    assert resolve_unknown(db, {DEST: handler}) == {"pending": 1}
    elapse(db, handler.backoff_seconds(1), [row_id])  # its first backoff
    assert relay_once(clean) == 1
    second = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert second is not None and second.attempt == 2

    moved = store.delivery.record(
        db, row_id=row_id, token=first.token, state="sent", outcome="sent", ref="ch_stale"
    ).state
    assert moved is None  # a newer claim owns the row
    r = get(db, row_id)
    assert (r["state"], r["claim_token"], r["provider_ref"]) == ("in_flight", second.token, None)
    assert fence_outcomes(db, row_id) == ["superseded:sent", None]

    assert store.delivery.record(
        db, row_id=row_id, token=second.token, state="sent", outcome="sent", ref="ch_2"
    ).state
    assert get(db, row_id)["provider_ref"] == "ch_2"


def test_late_record_during_the_lookup_wins_and_the_reconciler_backs_off(clean, engine, db):
    (row_id,) = write_rows(engine, 1)
    claimed = make_unknown(db, row_id)

    @outbox.handler(DEST, time_limit=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("the reconciler never calls the handler itself")

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        # While the provider is being asked, the worker's own late answer is recorded.
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as other:
            store.delivery.record(
                other, row_id=d.id, token=claimed.token, state="sent", outcome="sent", ref="ch_w"
            )
        return None

    assert resolve_unknown(db, {DEST: charge}) == {"raced": 1}
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"], r["history"]) == ("sent", "ch_w", [])
