"""What a failed, skipped, replayed or repaired head does to its ordering key, against real
PostgreSQL, Redis and the provider simulator: a skipped head is replayed or repaired only with
--force and a replay puts it back in line; a head failed past its deadline, or whose call may have
taken effect, follows the rules of docs/ordering.md; a key whose head cannot go is listed as
blocked; a successor whose claim was refused is requeued, not lost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import elapse, ids_by_state, lookup_on, relay_once, sql
from sqlalchemy.orm import Session

import outbox
from outbox import pauses, store
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.ops import actions
from outbox.ops.ordering import blocked_keys, blocked_summary
from outbox.ops.repair import execute_repair, plan_repair
from outbox.reconciler.jobs.purge import purge

pytestmark = pytest.mark.timeout(120)


DEST = "crm.update"


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


def test_a_skipped_head_is_not_replayed_without_force_so_no_claim_can_race_it(
    clean, engine, provider, consumer, db
):
    """A replay of a failed head its handler skips, committed while a worker claims its
    successor (write skew under READ COMMITTED), would put two rows of one key in flight. A head
    that let its key go on is replayed only with --force (the operator's choice to break the order,
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


def test_a_successor_whose_claim_was_refused_is_requeued_not_lost(
    clean, engine, provider, consumer, db, redis_client
):
    """Only a forced replay of a skipped head gets here. The successor's message came
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
    """A head written for later (available_at in the future) holds back the rows written
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
