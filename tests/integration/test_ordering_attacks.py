"""The attack on per-key ordering (issue 15, parts 1-2): each test reproduces what it proved
(A1-A7) and asserts the behaviour since (fixed, or documented in docs/ordering.md)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import elapse, ids_by_state, relay_once, sql
from sqlalchemy.orm import Session

import outbox
from outbox import pauses, store
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.ops import actions
from outbox.reconciler.jobs.purge import purge

DEST = "crm.update"

pytestmark = pytest.mark.timeout(120)


def declare(provider: Any, **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def update(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("refused")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return update


def write(engine: Any, key: str, ordering_key: str | None, **kw: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=key,
            step="update",
            destination=DEST,
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


# -- A1: a replay racing the successor's claim (write skew under READ COMMITTED) -------------------


def test_a_skipped_head_is_not_replayed_without_force_so_no_claim_can_race_it(
    clean, engine, provider, consumer, db
):
    """A1: a replay of a failed head its handler skips, committed while a worker claims its
    successor (write skew under READ COMMITTED), put two rows of one key in flight. A head that
    let its key go on is now replayed only with --force (the operator's choice to break the order,
    on record); without it the replay is refused, whatever the successor's state."""
    head, behind = failed_head(clean, engine, provider, consumer, on_failed_head="skip")
    assert relay_once(clean) == 1  # the successor is published (the head failed, skip)
    with engine.begin() as operator:
        [result] = actions.replay(operator, [head], by="ops", reason="the customer fixed the card")
    assert not result.done and "went on without it" in result.message
    claimed = store.delivery.claim(db, row_id=behind, destination=DEST, lease_seconds=60)
    assert claimed is not None
    assert in_flight(clean) == {behind}
    assert ids_by_state(clean)["failed"] == {head}


# -- A2: a skip outlives the replay it came before -------------------------------------------------


def test_a_replayed_head_that_fails_again_blocks_its_key_again(clean, engine, provider, consumer, db):
    head, _behind = failed_head(clean, engine, provider, consumer)  # on_failed_head="block"
    with engine.begin() as c:
        assert actions.skip(c, head, by="ops", reason="go on for now").done
    # Before the relay publishes the successor, the operator thinks better of it and replays the
    # head (skipped: only with --force).
    with engine.begin() as c:
        [r] = actions.replay(c, [head], by="ops", reason="try it first after all", force=True)
        assert r.done, r.message
    assert relay_once(clean) == 1  # the head only
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    # A new failure of a "block" head: its key waits for an operator again.
    assert relay_once(clean) == 0, "the key went on past a new failure nobody skipped"


# -- A3: a head failed past its deadline ignores on_failed_head="skip" -----------------------------


def test_a_head_failed_past_its_deadline_is_skipped_when_its_handler_says_so(
    clean, engine, provider, consumer, db
):
    declare(provider, on_failed_head="skip")
    deadline = datetime.now(UTC) + timedelta(minutes=10)
    head = write(engine, "customer:7:0", "customer:7", deadline=deadline)
    behind = write(engine, "customer:7:1", "customer:7")
    with engine.begin() as c:
        pauses.pause(c, DEST, by="ops", reason="provider outage")
    elapse(db, 3600, [head])
    moved = store.recovery.fail_past_deadline(db, destinations=[DEST], limit=100, skip_when_failed=[DEST])
    assert moved.failed == 1
    assert ids_by_state(clean)["failed"] == {head}
    with engine.begin() as c:
        pauses.resume(c, DEST, by="ops")
    assert relay_once(clean) == 1, "the key stays blocked behind a failed head its handler skips"
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT


# -- A4: a purged successor no longer makes a replay of the skipped head need --force --------------


def test_replaying_a_skipped_head_after_its_successor_was_purged_still_needs_force(
    clean, engine, provider, consumer, db
):
    head, behind = failed_head(clean, engine, provider, consumer)
    with engine.begin() as c:
        assert actions.skip(c, head, by="ops", reason="go on").done
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT
    with engine.begin() as c:
        [before] = actions.replay(c, [head], by="ops", reason="r")
    assert not before.done and "went on without it" in before.message
    elapse(db, 8 * 86400, [behind])
    assert purge(db, retention_seconds=86400).get("purged") == 1
    with engine.begin() as c:
        [after] = actions.replay(c, [head], by="ops", reason="r")
    assert not after.done, "replayed without --force after its successor went (and was purged)"


# -- A5: writers of two different ordering keys wait for each other (hashtext collision) -----------

COLLIDING = ("customer:102466", "customer:263854")  # hashtext() equal on PostgreSQL


def test_writers_of_two_ordering_keys_never_wait_for_each_other_even_when_their_hashes_collide(clean, engine):
    assert sql(clean, "SELECT hashtext(%s) = hashtext(%s)", COLLIDING) == [(True,)]
    first = Session(engine)
    first.begin()
    outbox.write(first, key="a", step="s", destination=DEST, payload={}, ordering_key=COLLIDING[0])
    took: list[float] = []

    def other_writer() -> None:
        started = time.monotonic()
        write(engine, "b", COLLIDING[1])
        took.append(time.monotonic() - started)

    t = threading.Thread(target=other_writer)
    t.start()
    t.join(3)
    waited = t.is_alive()
    first.commit()
    first.close()
    t.join(10)
    assert not waited and took and took[0] < 2.0, "another ordering key's writer waited"


# -- A6: writes of two ordering keys in opposite orders deadlock ------------------------------------


def test_two_transactions_writing_two_ordering_keys_in_opposite_order_deadlock_as_documented(clean, engine):
    """A6: documented (docs/ordering.md): the writers' per-key locks are held until commit, so
    two transactions writing keys A,B and B,A deadlock and PostgreSQL aborts one; the other
    commits, and nothing half-written remains of the aborted one."""
    t1 = Session(engine)
    t2 = Session(engine)
    t1.begin()
    t2.begin()
    errors: list[BaseException] = []
    outbox.write(t1, key="t1a", step="s", destination=DEST, payload={}, ordering_key="account:A")
    outbox.write(t2, key="t2b", step="s", destination=DEST, payload={}, ordering_key="account:B")

    def t1_second() -> None:
        try:
            outbox.write(t1, key="t1b", step="s", destination=DEST, payload={}, ordering_key="account:B")
            t1.commit()
        except BaseException as e:
            errors.append(e)
            t1.rollback()

    th = threading.Thread(target=t1_second)
    th.start()
    time.sleep(0.5)
    try:
        outbox.write(t2, key="t2a", step="s", destination=DEST, payload={}, ordering_key="account:A")
        t2.commit()
    except BaseException as e:
        errors.append(e)
        t2.rollback()
    th.join(30)
    t1.close()
    t2.close()
    assert len(errors) == 1 and "deadlock" in str(errors[0]).lower()
    assert sql(clean, "SELECT count(*) FROM outbox_message") == [(2,)]


# -- A7: a successor whose message a blocked claim dropped waits for the redispatch, not the wake ----


def test_a_successor_whose_claim_was_refused_is_requeued_not_lost(
    clean, engine, provider, consumer, db, redis_client
):
    """A7: only a forced replay of a skipped head gets here now. The successor's message came
    first and its claim was refused (the head is pending again): it stays dispatched with its
    message gone until the reconciler re-queues it (documented); then it goes, after the head."""
    head, behind = failed_head(clean, engine, provider, consumer, on_failed_head="skip")
    assert relay_once(clean) == 1  # the successor is published
    with engine.begin() as c:
        [r] = actions.replay(c, [head], by="ops", reason="fixed", force=True)
        assert r.done, r.message
    worker = consumer()
    assert worker.deliver(behind, DEST) is DeliveryResult.EMPTY
    assert relay_once(clean) == 1  # the head
    assert worker.deliver(head, DEST) is DeliveryResult.SENT
    assert ids_by_state(clean)["dispatched"] == {behind}
    # The reconciler finds its message gone and re-queues it.
    from outbox.reconciler.jobs.redispatch import redispatch

    elapse(db, 60, [behind])
    counts = redispatch(db, redis_client, registry(), namespace=clean.namespace, redispatch_after_seconds=300)
    assert sum(counts.values()) >= 1, counts
    assert relay_once(clean) == 1
    assert worker.deliver(behind, DEST) is DeliveryResult.SENT
