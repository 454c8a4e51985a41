"""In-flight limits (issue 33, part 1): the database's claim trigger (migration 0023) caps a
destination's calls in flight over every claimer; a worker holds a refused delivery (no attempt,
no fence row, its message not acked) and claims it once a call ends; `outbox limit` sets, shows
and clears it. Real PostgreSQL, Redis, Dramatiq worker threads and the provider simulator, whose
own gauge of concurrent requests is the evidence."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import relay_once, wait_for, worker_thread

from outbox import limits, store
from outbox.cli import main
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.settings import libpq_url

from .reconciler.support import DEST, declare_charge, get, write_rows

pytestmark = pytest.mark.timeout(120)


def limit(engine: Any, n: int, destination: str = DEST) -> limits.Limit:
    with engine.begin() as conn:
        return limits.set_limit(conn, destination, in_flight=n, by="test", reason="provider allows few")


def clear(engine: Any, destination: str = DEST) -> bool:
    with engine.begin() as conn:
        return limits.clear_limit(conn, destination, by="test")


def claim(conn: Any, row_id: int) -> Any:
    return store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30, token=uuid.uuid4())


def in_flight(db: Any) -> int:
    return db.execute("SELECT count(*) FROM outbox_message WHERE state = 'in_flight'").fetchone()[0]


def test_the_limit_refuses_the_claim_past_it_and_spends_nothing(clean, engine, db):
    ids = write_rows(engine, 4)
    write_rows(engine, 1, destination="mail.send", start=10)
    limit(engine, 2)
    assert claim(db, ids[0]) is not None and claim(db, ids[1]) is not None
    assert claim(db, ids[2]) is None, "a third call in flight"
    assert get(db, ids[2])["attempts"] == 0 and get(db, ids[2])["state"] == "pending"
    assert (
        db.execute("SELECT count(*) FROM outbox_attempt WHERE message_id = %s", (ids[2],)).fetchone()[0] == 0
    )
    assert store.delivery.held_by_limit(db, row_id=ids[2], destination=DEST).in_flight == 2  # type: ignore[union-attr]
    # Another destination is not limited, and a call that ends frees its slot.
    [mail] = db.execute("SELECT id FROM outbox_message WHERE destination = 'mail.send'").fetchone()
    assert store.delivery.claim(db, row_id=mail, destination="mail.send", lease_seconds=30) is not None
    db.execute("UPDATE outbox_message SET state = 'sent', provider_ref = 'x' WHERE id = %s", (ids[0],))
    assert claim(db, ids[2]) is not None
    assert claim(db, ids[3]) is None
    assert clear(engine) and not clear(engine)
    assert claim(db, ids[3]) is not None, "cleared: no limit holds"


def test_an_older_release_claim_obeys_it_too(clean, engine, db):
    """The trigger is the guard, not this release's statement: a plain UPDATE to in_flight (what
    any release's claim is) moves nothing past the limit."""
    ids = write_rows(engine, 3)
    limit(engine, 1)
    move = (
        "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '30 s', attempts = attempts + 1 WHERE id = %s RETURNING id"
    )
    assert db.execute(move, (ids[0],)).fetchone() is not None
    assert db.execute(move, (ids[1],)).fetchone() is None
    group = db.execute(
        "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '30 s' WHERE id = ANY(%s) RETURNING id",
        (ids[1:],),
    ).fetchall()
    assert group == []
    clear(engine)
    limit(engine, 3)
    group = db.execute(
        "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '30 s' WHERE id = ANY(%s) RETURNING id",
        (ids[1:],),
    ).fetchall()
    assert len(group) == 2, "one statement claiming two rows counts its own first row"
    limit(engine, 2)
    assert in_flight(db) == 3, "lowering a limit stops new claims; calls in flight finish"


def test_a_group_claim_takes_no_more_than_the_limit_allows(clean, engine, db):
    ids = write_rows(engine, 6)
    limit(engine, 4)
    claimed = store.delivery.claim_group(
        db, tokens={i: uuid.uuid4() for i in ids}, destination=DEST, lease_seconds=30
    )
    assert len(claimed) == 4 and in_flight(db) == 4


def test_concurrent_claimers_on_many_connections_never_pass_the_limit(clean, engine):
    services = clean
    """12 threads, each on its own connection, claim and settle as fast as they can; a sampler
    reads the count of in_flight rows the whole time; the limit is 3."""
    ids = write_rows(engine, 240)
    limit(engine, 3)
    todo = list(ids)
    lock = threading.Lock()
    most = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
                while True:
                    with lock:
                        if not todo:
                            return
                        row = todo.pop()
                    if claim(conn, row) is None:
                        with lock:
                            todo.append(row)
                        continue
                    conn.execute(
                        "UPDATE outbox_message SET state = 'sent', provider_ref = 'r' WHERE id = %s", (row,)
                    )
        except BaseException as exc:
            errors.append(exc)

    def sampler() -> None:
        with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
            while not stop.is_set():
                most[0] = max(most[0], in_flight(conn))

    watch = threading.Thread(target=sampler)
    watch.start()
    workers = [threading.Thread(target=claimer) for _ in range(12)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(90)
    stop.set()
    watch.join(10)
    assert not errors, errors
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] == 240
        assert conn.execute("SELECT count(*) FROM outbox_attempt").fetchone()[0] == 240, (
            "no attempt spent on a refusal"
        )
    assert 1 <= most[0] <= 3, most[0]


def test_a_worker_holds_what_the_limit_refuses_and_the_provider_never_sees_more(
    clean, engine, db, provider, redis_client
):
    """Two in flight at most, 16 worker threads, the provider answering after 150 ms: every row is
    charged once, the provider's own gauge never passes 2, and no row was acked unclaimed."""
    declare_charge(provider)
    provider.slow(150)
    write_rows(engine, 24)
    # Published before the limit is set (a limited destination's relay keeps all but its window
    # back, outbox.windows): 16 threads get messages beyond the limit, and hold them.
    assert relay_once(clean) == 24
    limit(engine, 2)
    with worker_thread(clean, threads=16):
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] == 24
            ),
            60,
            "every row sent",
        )
    stats = provider.stats()
    assert stats["charges"] == 24 and stats["double_charged"] == []
    assert stats["most_in_flight"] == 2, stats["most_in_flight"]
    assert db.execute("SELECT max(attempts) FROM outbox_message").fetchone()[0] == 1
    assert redis_client.llen(f"{clean.namespace}:{DEST}") == 0


def test_a_delivery_held_too_long_is_given_up_to_the_redispatch(clean, engine, db, provider, monkeypatch):
    from outbox import consumer

    monkeypatch.setattr(consumer, "HOLD_MAX_SECONDS", 0.3)
    declare_charge(provider)
    ids = write_rows(engine, 2)
    limit(engine, 1)
    assert claim(db, ids[0]) is not None
    deliverer = Deliverer(clean.database_url, registry())
    try:
        assert deliverer.deliver(ids[1], DEST) is DeliveryResult.HELD
    finally:
        deliverer.close()
    assert get(db, ids[1])["state"] == "pending" and get(db, ids[1])["attempts"] == 0
    assert provider.charges("order:1:charge") == 0


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_sets_shows_and_clears_a_limit(clean, engine, db, capsys):
    write_rows(engine, 1)
    code, out, _ = cli(clean, capsys, "limit")
    assert code == 0 and "no destination has a limit" in out
    code, out, _ = cli(
        clean, capsys, "limit", DEST, "--in-flight", "5", "--reason", "10 connections", "--by", "ops"
    )
    assert code == 0 and f"{DEST}: at most 5 calls in flight (0 now), 0 rows waiting" in out, out
    assert "set by ops" in out and "10 connections" in out
    code, out, _ = cli(clean, capsys, "limit", "--json")
    assert code == 0
    [shown] = json.loads(out)["limits"]
    assert shown["holds"] == 5 and shown["in_flight"] == 5 and shown["reason"] == "10 connections"
    code, out, _ = cli(clean, capsys, "limit", DEST, "--clear")
    assert code == 0 and "no limit holds now" in out
    code, _, err = cli(clean, capsys, "limit", DEST, "--clear")
    assert code == 1 and "has no operator's limit" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["limit", DEST, "--in-flight", "3"], "--reason is required"),
        (["limit", DEST, "--in-flight", "0", "--reason", "r"], "between 1 and"),
        (["limit", "--in-flight", "3", "--reason", "r"], "which destination?"),
        (["limit", DEST, "--in-flight", "3", "--clear"], "not both"),
    ],
)
def test_the_cli_refuses_bad_input_with_one_line(clean, capsys, argv, message):
    code, _, err = cli(clean, capsys, *argv)
    assert code == 2 and message in err, err


def declared(db: Any, destination: str = DEST) -> int | None:
    row = db.execute(
        "SELECT declared_in_flight FROM outbox_destination WHERE destination = %s", (destination,)
    ).fetchone()
    return row[0] if row else None


def test_the_lowest_limit_live_workers_declare_holds_and_goes_with_them(clean, db):
    """Two releases' workers beside each other declare 5 and 3: 3 holds; the one declaring 3
    stops, the other's next beat raises it to 5; none left declaring: no limit."""
    from outbox.heartbeat import Heartbeat

    five = Heartbeat(clean.database_url, kind="worker", queues=[DEST], declared_in_flight={DEST: 5}).start()
    three = Heartbeat(clean.database_url, kind="worker", queues=[DEST], declared_in_flight={DEST: 3}).start()
    plain = Heartbeat(clean.database_url, kind="worker", queues=[DEST])
    try:
        assert declared(db) == 3, "a declaration is written by the first beat, before any claim"
        three.stop()
        five.beat()
        assert declared(db) == 5
        five.stop()
        plain.beat()
        assert declared(db) is None
    finally:
        for beat in (five, three, plain):
            beat.stop()


def test_a_declared_limit_holds_for_the_worker_and_the_operator_overrides_it(
    clean, engine, db, provider, redis_client
):
    import outbox

    @outbox.handler(DEST, time_limit=10, max_in_flight=3)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        response = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        response.raise_for_status()
        return outbox.Confirmed(ref=response.json()["id"], response=response.json())

    provider.slow(150)
    write_rows(engine, 30)
    assert relay_once(clean) == 30
    with worker_thread(clean, threads=16):
        wait_for(lambda: declared(db) == 3, 10, "the worker's declaration")
        with engine.begin() as conn:
            [shown] = limits.limits(conn, DEST)
        assert shown.holds == 3 and shown.in_flight is None and "declared by its handler" in shown.describe()
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] >= 10
            ),
            60,
            "ten rows sent",
        )
        assert provider.stats()["most_in_flight"] == 3
        limit(engine, 1)
        # Calls claimed under the declared limit finish; from then on at most one is in flight.
        wait_for(lambda: in_flight(db) <= 1, 10, "the calls over the new limit to end")
        most = 0
        while db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] < 30:
            most = max(most, in_flight(db))
            time.sleep(0.01)
        assert most == 1, most
    stats = provider.stats()
    assert stats["charges"] == 30 and stats["double_charged"] == []


def test_a_refused_claim_frees_the_half_open_breaker_probe_it_reserved(clean, engine, db, provider):
    """The claim statement reserves a half-open breaker's probe before the limit refuses its
    UPDATE: the probe is given back, so the next claim after a free slot probes at once instead
    of waiting out the refused claim's lease."""
    declare_charge(provider)
    ids = write_rows(engine, 2)
    limit(engine, 1)
    assert claim(db, ids[0]) is not None
    db.execute(
        "UPDATE outbox_destination SET breaker_opened_at = now() - interval '1 min', "
        "breaker_open_until = now() - interval '1 s', breaker_open_seconds = 10 WHERE destination = %s",
        (DEST,),
    )
    token = uuid.uuid4()
    assert store.delivery.claim(db, row_id=ids[1], destination=DEST, lease_seconds=30, token=token) is None
    reserved = db.execute(
        "SELECT breaker_probe_token FROM outbox_destination WHERE destination = %s", (DEST,)
    ).fetchone()[0]
    assert reserved == token, "the statement reserved the probe before the trigger refused the claim"
    held = store.delivery.held_by_limit(db, row_id=ids[1], destination=DEST, token=token)
    assert held is not None and held.in_flight == 1, "held, to be the probe once a slot is free"
    assert (
        db.execute(
            "SELECT breaker_probe_token FROM outbox_destination WHERE destination = %s", (DEST,)
        ).fetchone()[0]
        is None
    )
    db.execute("UPDATE outbox_message SET state = 'sent', provider_ref = 'x' WHERE id = %s", (ids[0],))
    probe = claim(db, ids[1])
    assert probe is not None and probe.probe, "the next claim is the probe"


def test_a_declaration_holds_only_while_its_process_is_live_whoever_beats(clean, engine, db):
    """The claim's trigger reads the live declarations itself: a declaring worker that stopped
    (or went quiet) stops limiting even when no process of this release beats again to clear
    the hint (only older releases left, after a rollback)."""
    from outbox.heartbeat import Heartbeat

    ids = write_rows(engine, 3)
    one = Heartbeat(clean.database_url, kind="worker", queues=[DEST], declared_in_flight={DEST: 1}).start()
    try:
        assert claim(db, ids[0]) is not None
        assert claim(db, ids[1]) is None, "the live declaration holds"
    finally:
        one.stop()
    assert declared(db) == 1, "nobody beat since: the hint is still there"
    assert claim(db, ids[1]) is not None and claim(db, ids[2]) is not None
    with engine.begin() as conn:
        assert limits.limits(conn, DEST) == []


def test_a_stopping_worker_gives_a_held_delivery_up_at_once(clean, engine, db, provider):
    declare_charge(provider)
    ids = write_rows(engine, 2)
    limit(engine, 1)
    assert claim(db, ids[0]) is not None
    deliverer = Deliverer(clean.database_url, registry())
    deliverer.stopping.set()
    try:
        started = time.monotonic()
        assert deliverer.deliver(ids[1], DEST) is DeliveryResult.HELD
        assert time.monotonic() - started < 2
    finally:
        deliverer.close()
    assert get(db, ids[1])["attempts"] == 0


def test_status_and_the_metrics_show_the_limit_that_holds(clean, engine, db, capsys):
    from outbox import metrics

    write_rows(engine, 2)
    limit(engine, 7)
    code, out, _ = cli(clean, capsys, "status")
    assert code == 0 and f"limited: {DEST}: at most 7 calls in flight" in out, out
    code, out, _ = cli(clean, capsys, "status", "--json")
    assert code == 0 and json.loads(out)["limits"][0]["holds"] == 7
    reading = metrics.read_database(db)
    assert reading.limits == {DEST: 7}
    reading.destinations = [DEST, "mail.send"]
    metrics.DATABASE.update(reading, fresh_for_seconds=60)
    try:
        sample = metrics.REGISTRY.get_sample_value
        assert sample("outbox_destination_in_flight_limit", {"destination": DEST}) == 7
        assert sample("outbox_destination_in_flight_limit", {"destination": "mail.send"}) == 0
    finally:
        metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)


def test_limiting_a_name_nobody_uses_warns_with_the_likely_one(clean, engine, capsys):
    write_rows(engine, 1)
    code, _, err = cli(clean, capsys, "limit", DEST + "x", "--in-flight", "2", "--reason", "typo")
    assert code == 0 and f"did you mean {DEST}?" in err, err


def test_an_expired_lease_counts_while_its_call_may_still_land(clean, engine, db):
    """A worker SIGKILLed mid-call: its row counts while in flight, and once the reconciler
    moved it to unknown, until the wait before its first lookup is over."""
    ids = write_rows(engine, 2)
    limit(engine, 1)
    assert claim(db, ids[0]) is not None
    db.execute("UPDATE outbox_message SET lease_expires_at = now() - interval '1 s' WHERE id = %s", (ids[0],))
    moved = store.recovery.expire_leases(
        db, waits_seconds={DEST: 30}, default_wait_seconds=30, error="lease expired: the worker died"
    )
    assert moved == 1 and get(db, ids[0])["state"] == "unknown"
    assert claim(db, ids[1]) is None, "the expired call may still land"
    with engine.begin() as conn:
        assert limits.limits(conn, DEST)[0].calls_in_flight == 1
    db.execute("UPDATE outbox_message SET available_at = now() - interval '1 s' WHERE id = %s", (ids[0],))
    assert claim(db, ids[1]) is not None, "the landing wait is over"


def test_a_timed_out_call_counts_until_its_first_lookup_and_a_parked_row_does_not(clean, engine, db):
    """A live worker's call that timed out is recorded unknown; the provider may still be
    executing it until the first lookup is due, so it counts until then. A later wait (a lookup
    that found nothing, parked the row) does not make it count again."""
    ids = write_rows(engine, 2)
    limit(engine, 1)
    claimed = claim(db, ids[0])
    assert claimed is not None
    store.delivery.record(
        db, row_id=ids[0], token=claimed.token, state="unknown", outcome="timeout", delay_seconds=30
    )
    assert get(db, ids[0])["state"] == "unknown"
    assert claim(db, ids[1]) is None, "the timed-out call may still land"
    # The first lookup found nothing and parked the row for later: its landing wait is over.
    db.execute(
        "UPDATE outbox_message SET landing_until = now() - interval '1 s', "
        "available_at = now() + interval '1 hour' WHERE id = %s",
        (ids[0],),
    )
    assert claim(db, ids[1]) is not None


def test_a_worker_whose_declaration_is_no_longer_on_record_does_not_claim(
    clean, engine, db, provider, monkeypatch
):
    """Its heartbeat stopped committing (the database refuses its beats): its declaration is
    about to stop counting, so its claims of that destination wait instead of going past it."""
    import outbox
    from outbox import consumer

    monkeypatch.setattr(consumer, "HOLD_MAX_SECONDS", 0.3)

    @outbox.handler(DEST, time_limit=10, max_in_flight=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("no call may start")

    [row] = write_rows(engine, 1)
    deliverer = Deliverer(clean.database_url, registry())
    deliverer.declarations_fresh = lambda: False
    try:
        assert deliverer.deliver(row, DEST) is DeliveryResult.HELD
    finally:
        deliverer.close()
    assert get(db, row)["attempts"] == 0 and get(db, row)["state"] == "pending"


def test_a_call_that_ends_wakes_the_deliveries_its_limit_holds(clean, engine, db, provider):
    """One call at a time, each taking 1 s, four rows held in two workers (their own Redis
    subscriptions, as two processes have): each claim follows the end of the call before it
    within 0.35 s. Without the wake, a held delivery's pause has doubled to 0.8-1 s by then."""
    declare_charge(provider)
    provider.slow(1000)
    write_rows(engine, 4)
    assert relay_once(clean) == 4
    limit(engine, 1)
    with worker_thread(clean, threads=2), worker_thread(clean, threads=2):
        wait_for(
            lambda: db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] == 4,
            60,
            "every row sent",
        )
    attempts = db.execute(
        "SELECT date_part('epoch', started_at), date_part('epoch', finished_at) FROM outbox_attempt "
        "ORDER BY started_at"
    ).fetchall()
    assert len(attempts) == 4, attempts
    gaps = [round(nxt[0] - prev[1], 3) for prev, nxt in itertools.pairwise(attempts)]
    assert all(0 <= gap < 0.35 for gap in gaps), gaps
    assert provider.stats()["most_in_flight"] == 1


def test_a_wake_reaches_threads_and_tasks_of_another_subscriber_and_only_its_destination(clean):
    """outbox.wakes over a real Redis: one subscriber's ``freed`` wakes another's waiting thread
    and task of that destination at once, and not those of another destination."""
    import asyncio

    from outbox.wakes import Wakes

    sender = Wakes(clean.redis_url, clean.namespace).start()
    receiver = Wakes(clean.redis_url, clean.namespace).start()
    try:
        time.sleep(0.5)  # both subscribed
        results: dict[str, tuple[bool, float]] = {}

        def wait(name: str, destination: str) -> None:
            started = time.monotonic()
            results[name] = (receiver.wait(destination, 5), time.monotonic() - started)

        async def wait_task() -> tuple[bool, float]:
            started = time.monotonic()
            return await receiver.wait_async(DEST, 5), time.monotonic() - started

        threads = [
            threading.Thread(target=wait, args=("same", DEST)),
            threading.Thread(target=wait, args=("other", "mail.send")),
        ]
        for t in threads:
            t.start()
        threading.Timer(0.3, sender.freed, args=(DEST,)).start()
        woken, took = asyncio.run(wait_task())
        threads[0].join(5)
        assert woken and took < 2, (woken, took)
        assert results["same"][0] and results["same"][1] < 2, results
        threads[1].join(6)
        assert results["other"] == (False, pytest.approx(5, abs=1)), results
        assert receiver.received >= 1
    finally:
        sender.stop()
        receiver.stop()
