"""The reconciler's jobs against real PostgreSQL, Redis and the provider simulator: every job,
the race between a late recording and the lease expiry, two reconcilers at once, and a Redis
flush under 5,000 dispatched rows."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from helpers import relay_once, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import fence, transport
from outbox.consumer import Consumer, RunResult
from outbox.handlers import Handler, close_http_clients, registry
from outbox.schema import NOTIFY_CHANNEL
from outbox.settings import libpq_url
from reconciler import AlertRow, Job, Reconciler
from reconciler.jobs.expire_leases import LEASE_EXPIRED_ERROR, expire_leases
from reconciler.jobs.purge import purge
from reconciler.jobs.redispatch import redispatch
from reconciler.jobs.resolve_unknown import resolve_unknown
from reconciler.jobs.send_alerts import send_alerts
from reconciler.scheduler import JOB_LOCK_IDS, LOCK_CLASS

DEST = "payments.charge"
MODULE = "tests.reconciler_handlers"


# -- helpers ---------------------------------------------------------------------------------------


def declare_charge(
    provider: Any,
    *,
    destination: str = DEST,
    lookup: bool = True,
    idempotent: bool = False,
    max_attempts: int = 3,
    lookup_calls: list[int] | None = None,
) -> Handler:
    @outbox.handler(
        destination, time_limit=5, max_attempts=max_attempts, backoff=(30, 60), idempotent=idempotent
    )
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})

    if lookup:

        @charge.lookup
        def find(d: outbox.Delivery) -> outbox.Confirmed | None:
            if lookup_calls is not None:
                lookup_calls.append(d.id)
            r = d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
            if r.status_code == 404:
                return None
            r.raise_for_status()
            return outbox.Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})

    return charge


def write_rows(engine: Any, n: int, *, destination: str = DEST, start: int = 0, **kw: Any) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination=destination,
                payload={"amount_cents": 1000 + i, "currency": "EUR", "card_number": "4242424242424242"},
                **kw,
            ).id
            for i in range(start, start + n)
        ]


def charge_at_provider(provider: Any, key: str) -> str:
    """Make the provider hold a charge for `key`, as a call whose answer was lost would."""
    with httpx.Client() as client:
        r = client.post(f"{provider.url}/charges", json={"amount_cents": 1}, headers={"Idempotency-Key": key})
        r.raise_for_status()
        return str(r.json()["id"])


def get(db: psycopg.Connection[Any], row_id: int) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
    names = [c.name for c in cur.description or ()]
    found = cur.fetchone()
    assert found is not None, f"row {row_id} does not exist"
    return dict(zip(names, found, strict=True))


def fence_outcomes(db: psycopg.Connection[Any], row_id: int) -> list[str | None]:
    rows = db.execute("SELECT outcome FROM outbox_attempt WHERE message_id = %s ORDER BY id", (row_id,))
    return [r[0] for r in rows.fetchall()]


def make_unknown(db: psycopg.Connection[Any], row_id: int, destination: str = DEST) -> fence.Claimed:
    """Claim the row and record an ambiguous outcome, as a consumer whose read timed out does."""
    claimed = fence.claim(db, row_id=row_id, destination=destination, lease_seconds=30)
    assert claimed is not None
    assert fence.record(
        db, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="ReadTimeout"
    )
    return claimed


def expire_lease_now(db: psycopg.Connection[Any], row_id: int) -> None:
    db.execute(
        "UPDATE outbox_message SET lease_expires_at = now() - interval '1 second' WHERE id = %s", (row_id,)
    )


@pytest.fixture
def db(clean: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        yield conn


@pytest.fixture
def consumer(clean: Any) -> Iterator[Callable[[], Consumer]]:
    made: list[Consumer] = []

    def make() -> Consumer:
        made.append(Consumer(clean.database_url, registry()))
        return made[-1]

    yield make
    for c in made:
        c.close()
    close_http_clients()


@pytest.fixture
def reconcilers(clean: Any) -> Iterator[Callable[..., Reconciler]]:
    made: list[Reconciler] = []

    def make(**kw: Any) -> Reconciler:
        options: dict[str, Any] = {
            "database_url": clean.database_url,
            "redis_url": clean.redis_url,
            "namespace": clean.namespace,
            "handlers": registry(),
            "module": MODULE,
            **kw,
        }
        made.append(Reconciler(**options))
        return made[-1]

    yield make
    for r in made:
        r.close()


# -- 1. expire_leases ------------------------------------------------------------------------------


def test_expire_leases_moves_only_expired_rows_and_closes_their_fence(clean, engine, db):
    ids = write_rows(engine, 3)
    claims = {i: fence.claim(db, row_id=i, destination=DEST, lease_seconds=30) for i in ids}
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
        assert fence.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30) is not None
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
    claimed = fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    expire_lease_now(db, row_id)
    assert expire_leases(db) == 1

    # The worker was only slow: its answer arrives after the expiry, under the same claim.
    assert fence.record(db, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref="ch_late")
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"], r["unknown_since"]) == ("sent", "ch_late", None)
    assert fence_outcomes(db, row_id) == ["sent"]

    assert reconcilers().run_job("resolve_unknown") == {}
    assert calls == []


def test_late_record_after_a_newer_claim_changes_nothing_on_the_row(clean, engine, db, provider):
    handler = declare_charge(provider, max_attempts=3)
    (row_id,) = write_rows(engine, 1)
    first = fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert first is not None
    expire_lease_now(db, row_id)
    assert expire_leases(db) == 1
    # Its first lookup waits one time_limit; pretend that time has passed.
    db.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (row_id,))
    # The provider has no charge yet: the reconciler concludes "not taken effect" and retries.
    assert resolve_unknown(db, {DEST: handler}) == {"pending": 1}
    db.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (row_id,))
    assert relay_once(clean) == 1
    second = fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert second is not None and second.attempt == 2

    moved = fence.record(db, row_id=row_id, token=first.token, state="sent", outcome="sent", ref="ch_stale")
    assert moved is False
    r = get(db, row_id)
    assert (r["state"], r["claim_token"], r["provider_ref"]) == ("in_flight", second.token, None)
    assert fence_outcomes(db, row_id) == ["superseded:sent", None]

    assert fence.record(db, row_id=row_id, token=second.token, state="sent", outcome="sent", ref="ch_2")
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
            fence.record(other, row_id=d.id, token=claimed.token, state="sent", outcome="sent", ref="ch_w")
        return None

    assert resolve_unknown(db, {DEST: charge}) == {"raced": 1}
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"], r["history"]) == ("sent", "ch_w", [])


# -- 2. resolve_unknown ----------------------------------------------------------------------------


def test_resolve_unknown_settles_found_not_found_and_exhausted_rows(clean, engine, db, provider, consumer):
    handler = declare_charge(provider, max_attempts=2)
    ids = write_rows(engine, 4)
    # Row 0: the provider charged, then the connection dropped: a real ambiguous outcome.
    provider.configure(fault_keys={"order:0:charge": "drop_after"})
    assert consumer().deliver(ids[0], DEST) is RunResult.UNKNOWN
    # Its first lookup waits one time_limit (the provider may still be executing the call);
    # pretend that time has passed.
    assert get(db, ids[0])["available_at"] > datetime.now(UTC)
    db.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (ids[0],))
    # Row 1: timed out before the provider processed it. Row 2: the same, on its last attempt.
    make_unknown(db, ids[1])
    make_unknown(db, ids[2])
    db.execute("UPDATE outbox_message SET attempts = 2 WHERE id = %s", (ids[2],))
    # Row 3: timed out, but its deadline is about to pass: no time for a retry.
    make_unknown(db, ids[3])
    db.execute("UPDATE outbox_message SET deadline = now() + interval '5 seconds' WHERE id = %s", (ids[3],))

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
    db.execute(
        "UPDATE outbox_message SET unknown_since = now() - interval '10 minutes' WHERE id = %s", (ids[0],)
    )
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


# -- 3. redispatch ---------------------------------------------------------------------------------


def test_redispatch_requeues_lost_messages_and_leaves_waiting_ones_whatever_their_age(
    clean, engine, db, provider, redis_client, caplog
):
    declare_charge(provider)
    ids = write_rows(engine, 4)
    ids += write_rows(engine, 1, destination="ghost.dest", start=4)
    assert relay_once(clean) == 5
    # Forget what the relay published; publish again exactly the messages this test wants.
    redis_client.delete(*redis_client.keys(f"{clean.namespace}:*"))
    ages = {ids[0]: 60, ids[1]: 600, ids[2]: 60, ids[3]: 0, ids[4]: 60}
    for row_id, age in ages.items():
        db.execute(
            "UPDATE outbox_message SET dispatched_at = now() - %s * interval '1 second' WHERE id = %s",
            (age, row_id),
        )
    at = {r: get(db, r)["dispatched_at"] for r in ids}
    # Row 0: lost. Row 1: still in its queue, unclaimed for 10 min (issue 9 class 7: a message
    # waiting in its queue is never re-published, whatever its age). Row 2: waiting in a long queue.
    # Row 3: lost but dispatched just now (within the grace). Row 4: lost, and this module has no
    # handler for ghost.dest (a newer deploy's destination, say): re-queued like any other.
    transport.publish_rows(redis_client, clean.namespace, [(r, DEST, at[r]) for r in (ids[1], ids[2])])
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        counts = redispatch(
            db,
            redis_client,
            registry(),
            namespace=clean.namespace,
            redispatch_after_seconds=300,
            module="shop.handlers",
        )
        notified = list(listener.notifies(timeout=2, stop_after=1))

    assert counts == {"missing": 2, "waiting": 2, "no_handler": 1}
    assert len(notified) == 1
    for row_id in (ids[0], ids[4]):
        r = get(db, row_id)
        assert (r["state"], r["dispatched_at"]) == ("pending", None)
        assert r["available_at"] <= datetime.now(UTC)
    for row_id in (ids[1], ids[2]):
        assert get(db, row_id)["state"] == "dispatched" and get(db, row_id)["dispatched_at"] == at[row_id]
    assert get(db, ids[3])["state"] == "dispatched"
    assert "no handler in shop.handlers" in caplog.text and "ghost.dest" in caplog.text

    # Republished by the relay, the requeued rows are fresh messages waiting in their queue; once
    # the grace is over, row 3's lost message is requeued like any other.
    assert relay_once(clean) == 2
    again = redispatch(
        db, redis_client, registry(), namespace=clean.namespace, redispatch_after_seconds=300, grace_seconds=0
    )
    assert again == {"waiting": 4, "missing": 1, "no_handler": 1}
    assert get(db, ids[4])["state"] == "dispatched", "a row of another module's destination is never failed"
    assert get(db, ids[3])["state"] == "pending"


def test_an_unreachable_redis_never_means_the_message_is_gone(
    clean, engine, db, provider, reconcilers, caplog
):
    declare_charge(provider)
    (row_id,) = write_rows(engine, 1)
    assert relay_once(clean) == 1
    db.execute("UPDATE outbox_message SET dispatched_at = now() - interval '1 hour'")
    reconciler = reconcilers(redis_url="redis://127.0.0.1:1/11")
    with caplog.at_level(logging.ERROR, logger="reconciler"):
        result = reconciler.run_once()
    assert result["redispatch"] == {"error": 1}
    assert result["expire_leases"] == {} and result["purge"] == {}  # the other jobs ran
    assert get(db, row_id)["state"] == "dispatched"
    assert "reconciler job redispatch failed: ConnectionError" in caplog.text


# -- 4. purge --------------------------------------------------------------------------------------


def test_purge_deletes_old_terminal_rows_in_bounded_batches(clean, engine, db):
    db.execute(
        """
        INSERT INTO outbox_message (key, step, destination, payload, state, provider_ref, completed_at)
        SELECT 'old:' || g, 'charge', 'payments.charge', '{}', 'sent', 'ch_' || g, now() - interval '2 hours'
        FROM generate_series(1, 2500) AS g
        """
    )
    old_sent = db.execute("SELECT min(id) FROM outbox_message").fetchone()[0]
    db.execute(
        "INSERT INTO outbox_attempt (message_id, attempt, claim_token) VALUES (%s, 1, %s)",
        (old_sent, uuid.uuid4()),
    )
    ids = write_rows(engine, 4)
    db.execute(
        "UPDATE outbox_message SET state = 'cancelled', completed_at = now() - interval '2 hours' "
        "WHERE id = %s",
        (ids[0],),
    )
    db.execute(
        "UPDATE outbox_message SET state = 'sent', provider_ref = 'x', completed_at = now() WHERE id = %s",
        (ids[1],),
    )
    db.execute(
        "UPDATE outbox_message SET state = 'failed', completed_at = now() - interval '2 hours' WHERE id = %s",
        (ids[2],),
    )

    assert purge(db, retention_seconds=3600, max_batches=2) == {"purged": 2000, "batches": 2}
    assert purge(db, retention_seconds=3600) == {"purged": 501, "batches": 1}
    assert purge(db, retention_seconds=3600) == {}
    left = db.execute("SELECT id, state FROM outbox_message ORDER BY id").fetchall()
    assert left == [(ids[1], "sent"), (ids[2], "failed"), (ids[3], "pending")]
    assert db.execute("SELECT count(*) FROM outbox_attempt").fetchone() == (0,)


# -- 5. alerts -------------------------------------------------------------------------------------


def test_alerts_report_failed_and_long_unknown_rows_once(clean, engine, db, caplog):
    ids = write_rows(engine, 4)
    db.execute(
        "UPDATE outbox_message SET state = 'failed', completed_at = now(), last_error = 'card declined' "
        "WHERE id = ANY(%s)",
        ([ids[0], ids[3]],),
    )
    db.execute("UPDATE outbox_message SET alerted_at = now() WHERE id = %s", (ids[3],))
    make_unknown(db, ids[1])
    make_unknown(db, ids[2])
    db.execute(
        "UPDATE outbox_message SET unknown_since = now() - interval '2 hours' WHERE id = %s", (ids[1],)
    )

    seen: list[AlertRow] = []
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {"alerts": 2}
    assert [(a.id, a.key, a.step, a.destination, a.state) for a in seen] == [
        (ids[0], "order:0", "charge", DEST, "failed"),
        (ids[1], "order:1", "charge", DEST, "unknown"),
    ]
    assert seen[0].reason == "card declined"
    assert seen[1].reason.startswith("outcome unknown for 7200 s: ReadTimeout")
    assert all(a.age >= 0 for a in seen)
    assert get(db, ids[0])["alerted_at"] is not None
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=3600) == {}
    assert len(seen) == 2

    # A broken hook loses nothing: the row is reported again once the hook works.
    db.execute("UPDATE outbox_message SET alerted_at = NULL WHERE id = %s", (ids[0],))

    def broken(row: AlertRow) -> None:
        raise RuntimeError("pager down")

    with caplog.at_level(logging.ERROR, logger="reconciler"):
        assert send_alerts(db, broken, unknown_alert_after_seconds=3600) == {"hook_errors": 1}
        assert get(db, ids[0])["alerted_at"] is None
        # The default hook: one ERROR line naming the row, never the payload.
        assert send_alerts(db, unknown_alert_after_seconds=3600) == {"alerts": 1}
    line = [r for r in caplog.records if r.name == "reconciler.alerts"][-1]
    assert line.levelno == logging.ERROR
    assert "order:0:charge on payments.charge is failed: card declined" in line.getMessage()
    assert "4242" not in caplog.text and "amount_cents" not in caplog.text


# -- only one reconciler acts at a time ------------------------------------------------------------


def test_a_job_whose_lock_is_held_elsewhere_is_skipped(clean, engine, db, reconcilers):
    (row_id,) = write_rows(engine, 1)
    assert fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
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
        assert fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        expire_lease_now(db, row_id)
    # resolve_unknown: 3 unknown rows the provider did charge.
    unknown = write_rows(engine, 3, start=4)
    for i, row_id in enumerate(unknown, start=4):
        make_unknown(db, row_id)
        charge_at_provider(provider, f"order:{i}:charge")
    # redispatch: 3 dispatched rows whose messages are gone.
    lost = write_rows(engine, 3, start=7)
    assert relay_once(clean) == 3
    db.execute(
        "UPDATE outbox_message SET dispatched_at = now() - interval '1 minute' WHERE id = ANY(%s)", (lost,)
    )
    # purge: 5 old sent rows. alerts: 2 failed rows.
    old = write_rows(engine, 5, start=10)
    db.execute(
        "UPDATE outbox_message SET state = 'sent', provider_ref = 'ch', "
        "completed_at = now() - interval '30 days' WHERE id = ANY(%s)",
        (old,),
    )
    failed = write_rows(engine, 2, start=15)
    db.execute(
        "UPDATE outbox_message SET state = 'failed', completed_at = now() WHERE id = ANY(%s)", (failed,)
    )

    # Each job, once it holds its lock, waits until the other reconciler has tried the same job:
    # the two overlap on every job, whatever the thread scheduling.
    tried: dict[tuple[str, str], threading.Event] = {
        (who, job): threading.Event() for who in "AB" for job in JOB_LOCK_IDS
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
    logging.getLogger("reconciler").addHandler(handler)
    results: dict[str, dict[str, dict[str, int]]] = {}
    try:
        # DEBUG: a job another reconciler holds is logged at DEBUG (an idle run), and Tried needs it.
        with caplog.at_level(logging.DEBUG, logger="reconciler"):
            threads = [
                threading.Thread(target=lambda who=who: results.__setitem__(who, instances[who].run_once()))
                for who in "AB"
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        logging.getLogger("reconciler").removeHandler(handler)

    assert set(results) == {"A", "B"}
    assert overlapped == [True] * len(JOB_LOCK_IDS)
    acted: dict[str, dict[str, int]] = {}
    for job in JOB_LOCK_IDS:
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
    }
    # No row moved twice: one fence closing per expired claim, one lookup entry per resolved row,
    # one alert per failed row.
    assert [fence_outcomes(db, r) for r in expired] == [["lease_expired"]] * 4
    assert [get(db, r)["state"] for r in expired] == ["unknown"] * 4
    histories = [len(get(db, r)["history"]) for r in expired + unknown]
    assert histories == [0] * 4 + [1] * 3
    assert sorted(alerts["A"] + alerts["B"]) == failed
    assert [get(db, r)["state"] for r in lost] == ["pending"] * 3


# -- Redis flushed under 5,000 dispatched rows -----------------------------------------------------


@pytest.mark.timeout(90)
def test_redis_flushed_under_5000_dispatched_rows_loses_nothing_and_charges_once(
    clean, engine, db, provider, redis_client, reconcilers
):
    n = 5000
    declare_charge(provider)
    write_rows(engine, n)
    assert relay_once(clean) == n
    redis_client.flushdb()
    # The flush happened a while after the dispatch: past the grace, well within redispatch_after.
    db.execute("UPDATE outbox_message SET dispatched_at = dispatched_at - interval '1 minute'")

    assert reconcilers().run_job("redispatch") == {"missing": n}
    assert db.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall() == [("pending", n)]
    assert relay_once(clean) == n

    with worker_thread(clean, threads=8):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sent = db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0]
            if sent == n:
                break
            time.sleep(0.2)
    assert db.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall() == [("sent", n)]
    stats = provider.stats()
    assert stats["charges"] == n and stats["double_charged"] == []
    assert len(stats["effects"]) == n and set(stats["effects"].values()) == {1}
    assert db.execute("SELECT count(*), count(DISTINCT message_id) FROM outbox_attempt").fetchone() == (n, n)
    # Nothing left for the reconciler: every message was consumed and acked.
    assert reconcilers().run_job("redispatch") == {}


# -- the whole run ---------------------------------------------------------------------------------


def test_run_once_takes_an_expired_claim_through_to_sent(clean, engine, db, provider, reconcilers):
    declare_charge(provider)
    (row_id,) = write_rows(engine, 1)
    assert relay_once(clean) == 1
    claimed = fence.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    # The worker charged, then died before recording.
    charge_at_provider(provider, "order:0:charge")
    expire_lease_now(db, row_id)

    reconciler = reconcilers()
    result = reconciler.run_once()
    assert result["expire_leases"] == {"expired": 1}
    # The worker might still have been in its call: the first lookup waits one time_limit.
    assert result["resolve_unknown"] == {}
    assert set(result) == set(JOB_LOCK_IDS)
    db.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (row_id,))
    assert reconciler.run_once()["resolve_unknown"] == {"sent": 1}
    r = get(db, row_id)
    assert (r["state"], r["provider_ref"]) == ("sent", "ch_1")
    assert fence_outcomes(db, row_id) == ["lease_expired"]
    assert provider.stats()["charges"] == 1
