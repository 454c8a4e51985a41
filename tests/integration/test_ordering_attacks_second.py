"""Second attack on per-key ordering (issue 15), against the fixed version: operator paths that
move an ordered row back into line or out of it, heads that cannot go, and two relays and two
workers on many keys. Each proven break (B1-B5) now asserts the fixed behaviour."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import elapse, ids_by_state, lookup_on, relay_once, sql
from sqlalchemy.orm import Session

import outbox
from outbox import pauses, store
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.ops import actions
from outbox.ops.ordering import blocked_keys, blocked_summary
from outbox.ops.repair import execute_repair, plan_repair
from outbox.ordering import HOLDING_SQL

DEST = "crm.update"

#: Rows not settled that no failed head holds back: none may be left when the run ends.
UNSETTLED_AND_NOT_BEHIND_A_FAILED_HEAD = f"""
SELECT count(*) FROM outbox_message m
WHERE m.state NOT IN ('sent', 'failed', 'cancelled')
  AND NOT EXISTS (SELECT 1 FROM outbox_message e
                  WHERE e.ordering_key = m.ordering_key AND e.id < m.id
                    AND e.state = 'failed' AND {HOLDING_SQL})
"""

pytestmark = pytest.mark.timeout(300)


def declare(provider: Any, dest: str = DEST, **options: Any) -> outbox.Handler:
    @outbox.handler(dest, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def update(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("refused")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return update


def write(engine: Any, key: str, ordering_key: str | None, dest: str = DEST, **kw: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=key,
            step="update",
            destination=dest,
            payload={"amount_cents": 100},
            ordering_key=ordering_key,
            **kw,
        ).id


def in_flight(clean: Any) -> set[int]:
    return ids_by_state(clean).get("in_flight", set())


def failed_head(clean: Any, engine: Any, provider: Any, consumer: Any, **options: Any) -> tuple[int, int]:
    declare(provider, **options)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    provider.configure(fault_next=["decline"])
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    return head, behind


# -- B1: outbox repair re-runs a head that let its key go on, without --force ----------------------


@pytest.mark.parametrize("how", ["handler_skip", "operator_skip"])
def test_repair_of_a_skipped_failed_head_needs_force_like_replay(clean, engine, provider, consumer, db, how):
    lookup_on(declare(provider, on_failed_head="skip" if how == "handler_skip" else "block"), provider)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    provider.configure(fault_next=["decline"])
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    if how == "operator_skip":
        with engine.begin() as c:
            assert actions.skip(c, head, by="ops", reason="go on").done
    assert relay_once(clean) == 1  # the key went on without the head
    claimed = store.delivery.claim(db, row_id=behind, destination=DEST, lease_seconds=60)
    assert claimed is not None and in_flight(clean) == {behind}
    # replay is refused without --force ...
    with engine.begin() as c:
        [r] = actions.replay(c, [head], by="ops", reason="r")
    assert not r.done and "went on without it" in r.message
    # ... and repair, without --force, is the same operator move back into line.
    with engine.connect() as c:
        plan = plan_repair(c, ["customer:7:0"], handlers=registry())
    results = execute_repair(clean.database_url, plan, handlers=registry(), by="ops")
    # What a worker holding the head's message would do next: claim it.
    second = store.delivery.claim(db, row_id=head, destination=DEST, lease_seconds=60)
    assert in_flight(clean) == {behind}, (
        f"two rows of customer:7 in flight after repair without --force: {results}, claimed {second}"
    )
    assert ids_by_state(clean).get("failed") == {head}


# -- S: two relays and two workers (threads) on 50 keys x 20 rows, declines and dropped answers ------


KEYS, ROWS = 50, 20


def _stress(
    clean: Any, engine: Any, provider: Any, consumer: Any, db: Any, *, idempotent: bool, chaos: bool = False
) -> None:
    import random

    import psycopg

    from outbox.reconciler.jobs.expire_leases import expire_leases
    from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
    from outbox.relay import Relay
    from outbox.settings import libpq_url
    from outbox.settlement import LookupClients

    h = declare(provider, on_failed_head="skip", idempotent=idempotent, max_attempts=4, backoff=(1,))
    if not idempotent:
        lookup_on(h, provider)
    ids: dict[int, tuple[int, int]] = {}
    order = [(k, n) for n in range(ROWS) for k in range(KEYS)]
    for k, n in order:
        ids[write(engine, f"customer:{k}:{n}", f"customer:{k}")] = (k, n)
    provider.configure(decline_rate=0.08, drop_after_rate=0.08, dedupe=idempotent)
    if chaos:
        provider.configure(hang_after_rate=0.03, hang_seconds=3.0)

    stop = threading.Event()
    overlaps: list[Any] = []
    errors: list[BaseException] = []

    def monitor() -> None:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True, application_name="attack") as c:
            while not stop.is_set():
                rows = c.execute(
                    "SELECT ordering_key, array_agg(id) FROM outbox_message WHERE state = 'in_flight' "
                    "GROUP BY ordering_key HAVING count(*) > 1"
                ).fetchall()
                overlaps.extend(rows)
                time.sleep(0.005)

    def relay_loop() -> None:
        r = Relay(
            database_url=clean.database_url,
            redis_url=clean.redis_url,
            namespace=clean.namespace,
            poll_interval_seconds=0.2,
        )
        try:
            r.run_forever(stop)
        except BaseException as exc:
            errors.append(exc)

    def worker_loop(e: Deliverer, seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(
                libpq_url(clean.database_url), autocommit=True, application_name="attack"
            ) as c:
                while not stop.is_set():
                    # Messages for any waiting row, head or not: duplicates, re-dispatches.
                    cand = [
                        r[0]
                        for r in c.execute(
                            "SELECT id FROM outbox_message WHERE state IN ('dispatched', 'pending') "
                            "ORDER BY random() LIMIT 8"
                        ).fetchall()
                    ]
                    if not cand:
                        time.sleep(0.05)
                        continue
                    rng.shuffle(cand)
                    for row_id in cand[:3]:
                        try:
                            e.deliver(row_id, DEST)
                        except psycopg.OperationalError as exc:  # Dramatiq would log and go on
                            raised.append(exc)
        except BaseException as exc:
            errors.append(exc)

    def reconciler_loop() -> None:
        clients = LookupClients()
        try:
            with psycopg.connect(
                libpq_url(clean.database_url), autocommit=True, application_name="attack"
            ) as c:
                while not stop.is_set():
                    expire_leases(c, registry())
                    resolve_unknown(c, registry(), clients=clients)
                    time.sleep(0.3)
        except BaseException as exc:
            errors.append(exc)
        finally:
            clients.close()

    kills: list[int] = []
    raised: list[BaseException] = []

    def chaos_loop() -> None:
        rng = random.Random(7)
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True, application_name="attack") as c:
            while not stop.is_set():
                time.sleep(rng.uniform(0.05, 0.3))
                pids = [
                    r[0]
                    for r in c.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND application_name NOT IN ('attack') "
                        "AND backend_type = 'client backend' AND application_name NOT LIKE '%%relay%%'"
                    ).fetchall()
                ]
                if pids:
                    victim = rng.choice(pids)
                    c.execute("SELECT pg_terminate_backend(%s)", (victim,))
                    kills.append(victim)

    workers = [consumer(), consumer()]
    threads = [
        threading.Thread(target=monitor),
        threading.Thread(target=relay_loop),
        threading.Thread(target=relay_loop),
        threading.Thread(target=reconciler_loop),
    ]
    threads += [threading.Thread(target=worker_loop, args=(workers[i % 2], i)) for i in range(8)]
    if chaos:
        threads.append(threading.Thread(target=chaos_loop))
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not errors:
            try:
                left = sql(clean, UNSETTLED_AND_NOT_BEHIND_A_FAILED_HEAD)
            except psycopg.OperationalError:  # the chaos loop ended this connection
                continue
            if left[0][0] == 0:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    by_state = {s: len(v) for s, v in ids_by_state(clean).items()}
    print(
        "kills",
        len(kills),
        "raised",
        len(raised),
        "states",
        by_state,
        "stats",
        {k: v for k, v in provider.stats().items() if k != "effects"},
    )
    assert not overlaps, f"two rows of one key in flight together: {overlaps[:5]}"
    # The attempt rows say the same after the fact: no claim of a row of a key began before the
    # previous claim of another row of that key ended. (An attempt row's started_at is taken after
    # the claim's snapshot: with now(), the statement's arrival, a claim planned while the
    # previous row's record committed showed a start 0.6 ms before that record's end.)
    crossed = sql(
        clean,
        "SELECT m1.ordering_key, a1.message_id, a1.attempt, a2.message_id, a2.attempt "
        "FROM outbox_attempt a1 JOIN outbox_message m1 ON m1.id = a1.message_id "
        "JOIN outbox_message m2 ON m2.ordering_key = m1.ordering_key AND m2.id <> m1.id "
        "JOIN outbox_attempt a2 ON a2.message_id = m2.id "
        # Attempt 0: the fence row of a lost claim that never committed, no call.
        "AND a1.attempt <> 0 AND a2.attempt <> 0 "
        "WHERE a2.started_at >= a1.started_at AND a2.started_at < COALESCE(a1.finished_at, 'infinity') "
        "LIMIT 5",
    )
    assert not crossed, f"claims of two rows of one key overlapped: {crossed}"
    seen: dict[int, list[int]] = {}
    for idem in provider.stats()["effects"]:
        _c, k, n, _s = idem.split(":")
        seen.setdefault(int(k), []).append(int(n))
    wrong = {k: ns for k, ns in seen.items() if ns != sorted(ns)}
    assert not wrong, f"first charges out of write order: {dict(list(wrong.items())[:3])}"
    # Rows still waiting are exactly those behind a failed head that holds its key (its call may
    # have taken effect: never skipped by the handler's policy), and each such key is listed.
    assert sql(clean, UNSETTLED_AND_NOT_BEHIND_A_FAILED_HEAD) == [(0,)], by_state
    behind = {
        r[0]
        for r in sql(
            clean,
            "SELECT DISTINCT m.ordering_key FROM outbox_message m "
            "WHERE m.state NOT IN ('sent', 'failed', 'cancelled')",
        )
    }
    with engine.connect() as conn:
        listed = {k.ordering_key for k in blocked_keys(conn, limit=1000).keys}
    assert behind <= listed, (behind, listed)
    assert not provider.stats()["double_charged"]


@pytest.mark.stress
def test_stress_two_relays_two_workers_idempotent(clean, engine, provider, consumer, db):
    _stress(clean, engine, provider, consumer, db, idempotent=True)


@pytest.mark.stress
def test_stress_two_relays_two_workers_with_lookup(clean, engine, provider, consumer, db):
    _stress(clean, engine, provider, consumer, db, idempotent=False)


# -- B2: a failed head whose call may have taken effect is skipped by on_failed_head="skip" ---------


def test_an_uncertain_failed_head_is_never_skipped_by_its_handler(clean, engine, provider, consumer, db):
    provider.configure(dedupe=True)
    declare(provider, on_failed_head="skip", idempotent=True, max_attempts=1)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    provider.drop_after_charge(times=1)
    result = consumer().deliver(head, DEST)
    row = sql(clean, "SELECT state, skip_when_failed, last_error FROM outbox_message WHERE id = %s", (head,))
    assert provider.charges("customer:7:0:update") == 1  # it did take effect
    assert row[0][0] == "failed", (result, row)
    # "An uncertain effect is never skipped, whatever the handler says": the key must wait.
    went = relay_once(clean)
    assert went == 0 and behind not in ids_by_state(clean).get("dispatched", set()), (
        f"the key went on past a failed head whose call may have taken effect: {row}"
    )


def test_an_unknown_head_failed_by_an_operator_is_not_skipped_by_its_handler(
    clean, engine, provider, consumer, db
):
    declare(provider, on_failed_head="skip")
    head = write(engine, "customer:7:0", "customer:7")
    write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(head, DEST) is DeliveryResult.UNKNOWN
    with engine.begin() as c:
        r = actions.resolve(c, head, failed_reason="gave up on it", by="ops")
    print(r)
    assert ids_by_state(clean)["failed"] == {head}
    assert relay_once(clean) == 0, "an uncertain effect was skipped by the handler's policy"


# -- B3: a head that cannot go, with attempts = 0: the key waits, and nothing lists it -------------


def listed(engine: Any) -> list[tuple[str, int, str]]:
    with engine.connect() as c:
        return [(k.ordering_key, k.id, k.state) for k in blocked_keys(c).keys]


def test_a_head_waiting_for_a_newer_worker_shows_its_key_blocked(clean, engine, provider, consumer, db):
    declare(provider)  # payload_version 1
    head = write(engine, "customer:7:0", "customer:7", payload_version=2)
    behind = write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.RELEASED
    elapse(db, 3600, [head])  # an hour of releases: the deploy is stuck half-way
    sql(
        clean, "UPDATE outbox_message SET available_at = now() + interval '30 seconds' WHERE id = %s", (head,)
    )
    assert relay_once(clean) == 0
    assert ids_by_state(clean)["pending"] == {head, behind}
    with engine.connect() as c:
        summary = blocked_summary(c)
    assert ("customer:7", head) in [(k, i) for k, i, _ in listed(engine)], (
        f"customer:7 waits behind {head} (too new for every worker) and is not listed; summary {summary}"
    )


def test_a_paused_head_of_another_destination_shows_its_key_blocked(clean, engine, provider, consumer, db):
    declare(provider)
    declare(provider, dest="crm.tag")
    head = write(engine, "customer:7:0", "customer:7", dest="crm.tag")
    behind = write(engine, "customer:7:1", "customer:7")
    with engine.begin() as c:
        pauses.pause(c, "crm.tag", by="ops", reason="provider outage")
    relay_once(clean)
    assert consumer().deliver(head, "crm.tag") is not DeliveryResult.SENT
    elapse(db, 3600, [head, behind])
    relay_once(clean)
    assert behind not in ids_by_state(clean).get("dispatched", set())  # the key waits: held
    assert ("customer:7", head) in [(k, i) for k, i, _ in listed(engine)], (
        f"customer:7 ({DEST}, not paused) waits behind a paused crm.tag head, unlisted: {ids_by_state(clean)}"
    )


def test_a_head_written_for_later_holds_its_key_in_commit_order(clean, engine, provider, consumer, db):
    """Held: a head written for later (available_at in the future) holds back the rows written
    after it, due or not (strict commit order); the key is not listed as blocked (next in line)."""
    declare(provider)
    later = datetime.now(UTC) + timedelta(hours=1)
    head = write(engine, "customer:7:0", "customer:7", available_at=later)
    behind = write(engine, "customer:7:1", "customer:7")
    other = write(engine, "customer:8:0", "customer:8")
    assert relay_once(clean) == 1
    assert ids_by_state(clean)["dispatched"] == {other}
    assert consumer().deliver(behind, DEST) is DeliveryResult.EMPTY
    print("listed", listed(engine))
    elapse(db, 3700, [head])
    assert relay_once(clean) == 1
    assert consumer().deliver(head, DEST) is DeliveryResult.SENT
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT


def test_a_head_waiting_for_its_retry_is_listed_with_a_since_in_the_past(
    clean, engine, provider, consumer, db
):
    declare(provider, backoff=(600,), max_attempts=3)
    head = write(engine, "customer:7:0", "customer:7")
    write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    provider.unavailable(times=1)
    assert consumer().deliver(head, DEST) is DeliveryResult.PENDING
    with engine.connect() as c:
        report = blocked_keys(c)
        summary = blocked_summary(c)
    print(report, summary)
    [key] = report.keys
    assert key.id == head
    assert key.age_seconds is not None and key.age_seconds >= 0, (
        f"blocked for a negative time: {key.describe()}"
    )
    assert summary[1] is not None and summary[1] >= 0, summary


# -- B4: a row behind a blocking head cancelled: the head's replay needs --force --------------------


def test_replaying_a_blocking_head_after_a_row_behind_it_was_cancelled(clean, engine, provider, consumer, db):
    head, behind = failed_head(clean, engine, provider, consumer)  # block
    third = write(engine, "customer:7:2", "customer:7")
    with engine.begin() as c:
        plan = actions.cancel_rows(c, [behind], reason="superseded", by="ops")
    assert [r[0] for r in plan.rows] == [behind]
    with engine.begin() as c:
        [r] = actions.replay(c, [head], by="ops", reason="the customer fixed the card")
    print(r)
    # The key never went on without the head (the only row that moved was cancelled, never ran).
    assert r.done, r.message
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.SENT
    relay_once(clean)
    assert consumer().deliver(third, DEST) is DeliveryResult.SENT


@pytest.mark.stress
def test_stress_with_hung_calls_and_killed_connections(clean, engine, provider, consumer, db):
    _stress(clean, engine, provider, consumer, db, idempotent=False, chaos=True)
