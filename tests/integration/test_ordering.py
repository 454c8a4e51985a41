"""Per-key ordering (issue 15 parts 1-2) against real PostgreSQL, Redis and the provider
simulator on 127.0.0.1: only a key's head is published and claimed, other keys never wait, the
head-of-line policy by outcome, the writers of one key serialised by the database, and a settled
head waking the relay at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import elapse, ids_by_state, lookup_on, relay_once, sql
from sqlalchemy.orm import Session

import outbox
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.relay import Relay
from outbox.settings import libpq_url
from outbox.settlement import LookupClients

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


def write(engine: Any, key: str, ordering_key: str | None, amount: int = 100) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=key,
            step="update",
            destination=DEST,
            payload={"amount_cents": amount},
            ordering_key=ordering_key,
        ).id


def dispatched(services: Any) -> set[int]:
    return ids_by_state(services).get("dispatched", set())


def test_only_the_head_of_a_key_is_published_and_the_next_after_it_settles(clean, engine, provider, consumer):
    declare(provider)
    a = [write(engine, f"customer:7:{n}", "customer:7") for n in range(3)]
    b = write(engine, "customer:8:0", "customer:8")
    free = write(engine, "other:1", None)
    relay_once(clean)
    # One head per ordering key; rows without one are not held back.
    assert dispatched(clean) == {a[0], b, free}
    worker = consumer()
    assert worker.deliver(a[0], DEST) is DeliveryResult.SENT
    relay_once(clean)
    assert a[1] in dispatched(clean) and a[2] not in dispatched(clean)
    assert worker.deliver(a[1], DEST) is DeliveryResult.SENT
    relay_once(clean)
    assert worker.deliver(a[2], DEST) is DeliveryResult.SENT
    charged = [k for k in provider.stats()["effects"] if k.startswith("customer:7")]
    assert charged == [f"customer:7:{n}:update" for n in range(3)], "not in write order"


def test_a_row_behind_its_head_is_not_claimed_even_when_its_message_arrives(
    clean, engine, provider, consumer
):
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    # A message for the second row reached a worker anyway (a replay, a re-dispatch).
    sql(
        clean,
        "UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() WHERE id = %s",
        (behind,),
    )
    assert consumer().deliver(behind, DEST) is DeliveryResult.EMPTY
    assert provider.stats()["effects"] == {}
    assert ids_by_state(clean) == {"pending": {head}, "dispatched": {behind}}


def test_a_failed_head_blocks_its_key_by_default(clean, engine, provider, consumer):
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7", amount=-1)
    behind = write(engine, "customer:7:1", "customer:7")
    provider.configure(fault_next=["decline"])
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    assert relay_once(clean) == 0
    assert ids_by_state(clean) == {"failed": {head}, "pending": {behind}}


def test_a_failed_head_is_skipped_when_its_handler_says_so(clean, engine, provider, consumer):
    declare(provider, on_failed_head="skip")
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    provider.configure(fault_next=["decline"])
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT


def test_an_unknown_head_blocks_until_the_reconciler_settles_it(clean, engine, provider, consumer, db):
    lookup_on(declare(provider, on_failed_head="skip"), provider)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    provider.drop_after_charge()
    assert consumer().deliver(head, DEST) is DeliveryResult.UNKNOWN
    provider.healthy()
    # Unknown always blocks, whatever on_failed_head says: the charge may have happened.
    assert relay_once(clean) == 0
    elapse(db, 3600, [head])
    clients = LookupClients()
    try:
        resolve_unknown(db, registry(), clients=clients)
    finally:
        clients.close()
    assert ids_by_state(clean)["sent"] == {head}
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT
    assert provider.stats()["effects"] == {"customer:7:0:update": 1, "customer:7:1:update": 1}


def test_an_in_flight_head_blocks_until_its_lease_is_taken_over(clean, engine, provider, consumer, db):
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7")
    write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    # A worker claimed the head and died: in_flight until the reconciler expires its lease.
    sql(
        clean,
        "UPDATE outbox_message SET state = 'in_flight', attempts = 1, claim_token = gen_random_uuid(), "
        "claimed_at = now(), lease_expires_at = now() + interval '1 hour' WHERE id = %s",
        (head,),
    )
    assert relay_once(clean) == 0
    elapse(db, 7200, [head])
    expire_leases(db, registry())
    assert ids_by_state(clean).get("unknown") == {head}
    assert relay_once(clean) == 0


def test_writers_of_one_key_are_serialised_so_ids_follow_commits(clean, engine):
    """The first writer holds its transaction open after its INSERT; the second writer of the
    same ordering key waits for it, so its row's id comes after (ids are handed out at INSERT)."""
    first = Session(engine)
    first.begin()
    first_id = outbox.write(
        first, key="a", step="s", destination=DEST, payload={}, ordering_key="customer:7"
    ).id
    second_id: list[int] = []
    other_key: list[float] = []

    def second_writer() -> None:
        second_id.append(write(engine, "b", "customer:7"))

    def other_writer() -> None:
        started = time.monotonic()
        write(engine, "c", "customer:8")
        other_key.append(time.monotonic() - started)

    t = threading.Thread(target=second_writer)
    u = threading.Thread(target=other_writer)
    t.start()
    u.start()
    u.join(10)
    time.sleep(0.5)
    assert other_key and other_key[0] < 2.0, "another ordering key waited"
    assert t.is_alive(), "the second writer of the key did not wait for the first"
    first.commit()
    first.close()
    t.join(10)
    assert second_id and second_id[0] > first_id


def test_a_settled_head_wakes_a_running_relay_at_once(clean, engine, provider, consumer, redis_client):
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    relay = Relay(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        poll_interval_seconds=30,
    )
    stop = threading.Event()
    thread = threading.Thread(target=relay.run_forever, args=(stop,))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while head not in dispatched(clean) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the relay is now asleep on its 30 s poll
        assert consumer().deliver(head, DEST) is DeliveryResult.SENT
        settled = time.monotonic()
        while behind not in dispatched(clean) and time.monotonic() < settled + 10:
            time.sleep(0.02)
        assert behind in dispatched(clean)
        assert time.monotonic() - settled < 3.0, "the next row waited for the poll"
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\nb", 7])
def test_write_refuses_a_bad_ordering_key(clean, engine, bad: Any):
    with Session(engine) as s, s.begin(), pytest.raises(outbox.InvalidMessage, match="ordering_key"):
        outbox.write(s, key="k", step="s", destination=DEST, payload={}, ordering_key=bad)


def test_the_same_operation_under_another_ordering_key_is_a_conflict(clean, engine):
    write(engine, "k", "customer:7")
    assert write(engine, "k", "customer:7") > 0  # the same: a no-op
    with pytest.raises(outbox.KeyConflict):
        write(engine, "k", "customer:8")
    with pytest.raises(outbox.KeyConflict):
        write(engine, "k", None)
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_message").fetchone() == (1,)


# -- part 2: a blocked key is visible, and an operator unblocks it -------------------------------------


def run_cli(services: Any, *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=services.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def failed_head(clean: Any, engine: Any, provider: Any, consumer: Any) -> tuple[int, int]:
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7")
    behind = write(engine, "customer:7:1", "customer:7")
    provider.configure(fault_next=["decline"])
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    return head, behind


def test_a_blocked_key_is_listed_with_its_head_and_why(clean, engine, provider, consumer):
    head, behind = failed_head(clean, engine, provider, consumer)
    write(engine, "customer:8:0", "customer:8")  # next in line only: not blocked
    listed = run_cli(clean, "ordering")
    assert listed.returncode == 0, listed.stderr
    assert "customer:7" in listed.stdout and str(head) in listed.stdout and "failed" in listed.stdout
    assert "customer:8" not in listed.stdout
    assert "1 ordering key(s) blocked" in listed.stdout
    status = run_cli(clean, "status")
    assert "blocked ordering keys: 1" in status.stdout
    shown = run_cli(clean, "show", str(behind))
    assert f"row {head} (customer:7:0:update, failed)" in shown.stdout
    as_json = run_cli(clean, "ordering", "--json")
    import json

    (key,) = json.loads(as_json.stdout)["keys"]
    assert (key["ordering_key"], key["id"], key["state"], key["waiting"]) == ("customer:7", head, "failed", 1)


def test_the_metrics_count_blocked_keys_and_the_longest_block(clean, engine, provider, consumer, db):
    from outbox import metrics

    def gauges() -> tuple[float | None, float | None]:
        metrics.DATABASE.update(metrics.read_database(db), fresh_for_seconds=60)
        try:
            return (
                metrics.REGISTRY.get_sample_value("outbox_ordering_blocked_keys"),
                metrics.REGISTRY.get_sample_value("outbox_ordering_oldest_block_seconds"),
            )
        finally:
            metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)

    write(engine, "customer:9:0", "customer:9")
    write(engine, "customer:9:1", "customer:9")
    assert gauges() == (0.0, 0.0), "next in line is not blocked"
    head, _ = failed_head(clean, engine, provider, consumer)
    elapse(db, 120, [head])
    blocked, oldest = gauges()
    assert blocked == 1.0 and oldest is not None and 110 < oldest < 600


def test_skip_lets_the_key_go_and_a_later_replay_needs_force(clean, engine, provider, consumer):
    head, behind = failed_head(clean, engine, provider, consumer)
    refused = run_cli(clean, "skip", str(head))
    assert refused.returncode != 0 and "--reason" in refused.stderr
    done = run_cli(clean, "skip", str(head), "--reason", "the customer fixed it by hand", "--by", "ops")
    assert done.returncode == 0, done.stderr
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT
    assert run_cli(clean, "ordering").stdout.startswith("no ordering key is blocked")
    history = sql(clean, "SELECT state, history FROM outbox_message WHERE id = %s", (head,))[0]
    assert history[0] == "failed" and history[1][-1]["action"] == "skip" and history[1][-1]["by"] == "ops"
    # Its successor went: replayed, the head would come after it.
    replay = run_cli(clean, "replay", str(head), "--yes")
    assert replay.returncode != 0 and "its ordering key went on without it" in replay.stdout + replay.stderr
    forced = run_cli(clean, "replay", str(head), "--force", "--reason", "run it anyway", "--yes")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert ids_by_state(clean)["pending"] == {head}
    # Skipping twice, or a row that is not failed, is refused.
    again = run_cli(clean, "skip", str(behind), "--reason", "x")
    assert again.returncode == 1 and "not failed" in again.stderr


def test_an_unknown_head_is_never_skipped(clean, engine, provider, consumer):
    declare(provider)
    head = write(engine, "customer:7:0", "customer:7")
    write(engine, "customer:7:1", "customer:7")
    relay_once(clean)
    provider.drop_after_charge()
    assert consumer().deliver(head, DEST) is DeliveryResult.UNKNOWN
    refused = run_cli(clean, "skip", str(head), "--reason", "hurry")
    assert refused.returncode == 1 and "may have taken effect" in refused.stderr
    assert relay_once(clean) == 0


def test_replaying_a_failed_head_before_anything_behind_it_went_keeps_the_order(
    clean, engine, provider, consumer
):
    head, behind = failed_head(clean, engine, provider, consumer)
    replay = run_cli(clean, "replay", str(head), "--yes")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    relay_once(clean)
    assert consumer().deliver(head, DEST) is DeliveryResult.SENT
    relay_once(clean)
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT
