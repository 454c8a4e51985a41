"""Calls per second (issue 33, part 2): the claim trigger (migration 0024) books each call's start
in the destination's row, 1/rate apart over every claimer, and refuses a claim whose start would
be more than a second ahead; the worker starts the call no earlier than its booked start; a
group claim books one start per row; `outbox limit --per-second` sets, shows and clears it.
Real PostgreSQL, Redis, Dramatiq worker threads and the provider simulator, whose own count of
requests in any sliding second is the evidence."""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from typing import Any

import pytest
from helpers import relay_once, wait_for, worker_thread

from outbox import limits, store
from outbox.cli import main
from outbox.exceptions import ConfigError

from .reconciler.support import DEST, declare_charge, get, write_rows

pytestmark = pytest.mark.timeout(120)


def pace(engine: Any, rate: float, destination: str = DEST) -> limits.Limit:
    with engine.begin() as conn:
        return limits.set_limit(
            conn, destination, per_second=rate, by="test", reason="provider allows few a second"
        )


def claim(conn: Any, row_id: int, lease_seconds: float = 30) -> Any:
    return store.delivery.claim(
        conn, row_id=row_id, destination=DEST, lease_seconds=lease_seconds, token=uuid.uuid4()
    )


def call_starts(db: Any) -> list[float]:
    rows = db.execute(
        "SELECT date_part('epoch', call_at) FROM outbox_message WHERE call_at IS NOT NULL ORDER BY call_at"
    ).fetchall()
    return [float(r[0]) for r in rows]


def test_claims_book_starts_a_period_apart_and_refuse_past_a_second_ahead(clean, engine, db):
    ids = write_rows(engine, 30)
    write_rows(engine, 1, destination="mail.send", start=100)
    pace(engine, 10)
    claimed = []
    for row_id in ids:
        got = claim(db, row_id)
        if got is None:
            break
        claimed.append(got)
    # Starts at now + 0.1 (the lead), +0.2, ... +1.0: ten when the claims are quick; more when
    # the machine is slow to send them (the bookings then begin later than the first), never a
    # start more than a second after its claim.
    assert 9 <= len(claimed) < len(ids), len(claimed)
    starts = call_starts(db)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(g >= 0.1 - 1e-6 for g in gaps) and abs(min(gaps) - 0.1) < 1e-6, gaps
    waits = [c.pace_seconds for c in claimed]
    assert 0.05 < waits[0] <= 0.1 and max(waits) <= 1.0, waits
    refused = ids[len(claimed)]
    assert get(db, refused)["state"] == "pending" and get(db, refused)["attempts"] == 0
    held = store.delivery.held_by_limit(db, row_id=refused, destination=DEST)
    assert held is not None and held.per_second == 10 and held.in_flight is None
    assert held.booked_ahead_seconds is not None and 0.8 < held.booked_ahead_seconds <= 1.1
    assert limits.rebook_seconds(held.booked_ahead_seconds, 1.0) < 0.15
    # Another destination is not paced: no start booked, no wait.
    [mail] = db.execute("SELECT id FROM outbox_message WHERE destination = 'mail.send'").fetchone()
    got = store.delivery.claim(db, row_id=mail, destination="mail.send", lease_seconds=30)
    assert got is not None and got.pace_seconds == 0
    time.sleep(0.3)
    assert claim(db, refused) is not None, "a start frees up as time passes"


def test_a_claim_books_no_further_ahead_than_its_start_bound_allows(clean, engine, db):
    """A handler whose lease leaves 0.5 s to start a call books at most 0.125 s ahead; an older
    release's claim (it sets no latest start) a quarter of its lease, at most a second."""
    import outbox

    ids = write_rows(engine, 20)
    pace(engine, 10)
    tight = outbox.handler(DEST, time_limit=2, lease_seconds=3)(lambda d: None)
    assert tight.pace_ahead_seconds == 0.125
    # One statement, so that the machine's speed does not move the bookings: a start at now +
    # 0.03 (the lead: a quarter of what the claim accepts); the next, +0.13, is past it.
    got = store.delivery.claim_group(
        db,
        tokens={row_id: uuid.uuid4() for row_id in ids[:10]},
        destination=DEST,
        lease_seconds=3,
        pace_ahead_seconds=tight.pace_ahead_seconds,
    )
    assert len(got) == 1, got
    assert max(g.pace_seconds for g in got.values()) <= 0.125
    time.sleep(0.5)
    older = db.execute(
        "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
        "claimed_at = clock_timestamp(), lease_expires_at = clock_timestamp() + interval '2 s' "
        "WHERE id = ANY(%s) RETURNING id",
        (ids[10:],),
    ).fetchall()
    assert len(older) in (4, 5), "a quarter of a 2 s lease: starts now + 0.1 (the lead) .. +0.5 s"


def test_a_group_claim_books_one_start_per_row(clean, engine, db):
    ids = write_rows(engine, 20)
    pace(engine, 5)
    tokens = {row_id: uuid.uuid4() for row_id in ids}
    got = store.delivery.claim_group(db, tokens=tokens, destination=DEST, lease_seconds=30)
    # 5/s: starts now + 0.1 (the lead), +0.3, ..., +0.9 (five); the other fifteen stay pending.
    assert len(got) == 5, len(got)
    waits = sorted(c.pace_seconds for c in got.values())
    assert all(abs((b - a) - 0.2) < 0.01 for a, b in itertools.pairwise(waits)), waits
    assert db.execute("SELECT count(*) FROM outbox_message WHERE state = 'pending'").fetchone()[
        0
    ] == 20 - len(got)


def test_an_older_release_claim_books_its_start_too(clean, engine, db):
    """The trigger is the guard: a plain UPDATE to in_flight books a start and is refused past a
    second ahead (an older release does not wait for call_at: docs/flow-control.md)."""
    ids = write_rows(engine, 6)
    pace(engine, 2)
    move = (
        "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
        "lease_expires_at = now() + interval '30 s', attempts = attempts + 1 WHERE id = ANY(%s) RETURNING id"
    )
    moved = db.execute(move, (ids,)).fetchall()
    assert len(moved) == 2, "starts now + 0.1 (the lead), then +0.6 s; +1.1 s is past a second"
    starts = call_starts(db)
    assert [round(b - a, 6) for a, b in itertools.pairwise(starts)] == [0.5]


def test_both_kinds_hold_together_and_clear_together(clean, engine, db):
    ids = write_rows(engine, 4)
    with engine.begin() as conn:
        limits.set_limit(conn, DEST, in_flight=1, by="test", reason="one connection")
        shown = limits.set_limit(conn, DEST, per_second=100, by="test", reason="and 100/s")
    assert shown.holds == 1 and shown.holds_per_second == 100, "setting one kind keeps the other"
    assert claim(db, ids[0]) is not None
    assert claim(db, ids[1]) is None, "the in-flight limit refuses before a start is booked"
    assert len(call_starts(db)) == 1
    with engine.begin() as conn:
        assert limits.clear_limit(conn, DEST, by="test")
        assert limits.limits(conn, DEST) == []
    got = claim(db, ids[1])
    assert got is not None and got.pace_seconds == 0
    assert get(db, ids[1])["call_at"] is None, "an unpaced claim books nothing"


@pytest.mark.parametrize("bad", [0, -1, 0.0009, 5e-324, math.nan, math.inf, True, "5"])
def test_a_handler_declaring_a_bad_rate_is_refused(clean, bad):
    import outbox

    with pytest.raises(ConfigError, match="max_calls_per_second"):
        outbox.handler(DEST, max_calls_per_second=bad)


def test_a_worker_paces_its_calls_and_the_provider_sees_no_burst(clean, engine, db, provider, redis_client):
    """20/s, 16 worker threads, an instant provider, 50 rows: no sliding second at the provider
    holds more than 25 charges (21 booked, and calls started late), the drain takes about as long
    as 50 starts 50 ms apart, and every row is charged once with one attempt."""
    declare_charge(provider)
    write_rows(engine, 50)
    # Published before the rate is set (the relay would keep all but its window back,
    # outbox.windows): the 16 threads' claims do the pacing.
    assert relay_once(clean) == 50
    pace(engine, 20)
    started = time.monotonic()
    with worker_thread(clean, threads=16):
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0] == 50
            ),
            60,
            "every row sent",
        )
    took = time.monotonic() - started
    stats = provider.stats()
    assert stats["charges"] == 50 and stats["double_charged"] == []
    # 21 booked starts fit in a closed second; a call started late by the scheduler of this one
    # process (16 threads and the provider on one interpreter) may share a second with the next
    # ones on time. Unpaced, the 50 would arrive within a second.
    assert stats["most_in_one_second"] <= 25, stats["most_in_one_second"]
    assert took >= 49 / 20 - 0.2, took
    assert db.execute("SELECT max(attempts) FROM outbox_message").fetchone()[0] == 1
    assert redis_client.llen(f"{clean.namespace}:{DEST}") == 0


def test_a_declared_rate_holds_for_the_worker_and_the_operator_overrides_it(clean, engine, db, provider):
    import outbox

    @outbox.handler(DEST, time_limit=10, max_calls_per_second=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        response = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        response.raise_for_status()
        return outbox.Confirmed(ref=response.json()["id"], response=response.json())

    write_rows(engine, 40)
    assert relay_once(clean) == 40
    sent = "SELECT count(*) FROM outbox_message WHERE state = 'sent'"
    with worker_thread(clean, threads=8):
        wait_for(
            lambda: db.execute("SELECT declared_per_second FROM outbox_destination").fetchone() == (5.0,),
            10,
            "the worker's declaration",
        )
        with engine.begin() as conn:
            [shown] = limits.limits(conn, DEST)
        assert shown.holds_per_second == 5 and shown.per_second is None
        assert "5 calls/s" in shown.describe() and "declared by its handler" in shown.describe()
        time.sleep(2)
        at_five = db.execute(sent).fetchone()[0]
        assert 8 <= at_five <= 13, at_five
        pace(engine, 30)
        wait_for(lambda: db.execute(sent).fetchone()[0] == 40, 10, "the rest at 30/s")
    stats = provider.stats()
    assert stats["charges"] == 40 and stats["double_charged"] == []
    assert stats["most_in_one_second"] <= 31, stats


def test_the_lowest_rate_live_workers_declare_holds(clean, engine, db):
    from outbox.heartbeat import Heartbeat

    def hint() -> Any:
        row = db.execute("SELECT declared_per_second FROM outbox_destination WHERE destination = %s", (DEST,))
        found = row.fetchone()
        return found[0] if found else None

    fast = Heartbeat(
        clean.database_url, kind="worker", queues=[DEST], declared_per_second={DEST: 50.0}
    ).start()
    slow = Heartbeat(
        clean.database_url, kind="worker", queues=[DEST], declared_per_second={DEST: 2.5}
    ).start()
    try:
        assert hint() == 2.5
        with engine.begin() as conn:
            [shown] = limits.limits(conn, DEST)
        assert shown.holds_per_second == 2.5 and shown.declared_per_second == 2.5 and shown.holds is None
        slow.stop()
        fast.beat()
        assert hint() == 50.0
        fast.stop()
        plain = Heartbeat(clean.database_url, kind="worker", queues=[DEST])
        try:
            plain.beat()
        finally:
            plain.stop()
        assert hint() is None, "no live process declares a rate: the hint is cleared"
    finally:
        fast.stop()
        slow.stop()


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_sets_shows_and_clears_a_rate(clean, engine, db, capsys):
    write_rows(engine, 1)
    code, out, _ = cli(
        clean, capsys, "limit", DEST, "--per-second", "0.5", "--reason", "one call every 2 s", "--by", "ops"
    )
    assert code == 0 and f"{DEST}: at most 0.5 calls/s, 0 rows waiting" in out, out
    code, out, _ = cli(clean, capsys, "limit", DEST, "--in-flight", "4", "--reason", "and four at once")
    assert code == 0 and "at most 4 calls in flight (0 now), at most 0.5 calls/s" in out, out
    code, out, _ = cli(clean, capsys, "limit", "--json")
    [shown] = json.loads(out)["limits"]
    assert shown["per_second"] == 0.5 and shown["holds_per_second"] == 0.5 and shown["holds"] == 4
    code, out, _ = cli(clean, capsys, "status")
    assert code == 0 and f"limited: {DEST}: at most 4 calls in flight" in out and "0.5 calls/s" in out
    code, out, _ = cli(clean, capsys, "limit", DEST, "--clear")
    assert code == 0 and "no limit holds now" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["limit", DEST, "--per-second", "3"], "--reason is required"),
        (["limit", DEST, "--per-second", "0", "--reason", "r"], "must be from 0.001"),
        (["limit", DEST, "--per-second", "nan", "--reason", "r"], "must be from 0.001"),
        (["limit", DEST, "--per-second", "1e-300", "--reason", "r"], "must be from 0.001"),
        (["limit", DEST, "--per-second", "3", "--clear"], "not both"),
    ],
)
def test_the_cli_refuses_a_bad_rate_with_one_line(clean, capsys, argv, message):
    code, _, err = cli(clean, capsys, *argv)
    assert code == 2 and message in err, err


def test_the_cli_refuses_a_rate_that_is_not_a_number(clean, capsys):
    with pytest.raises(SystemExit) as exited:
        cli(clean, capsys, "limit", DEST, "--per-second", "fast", "--reason", "r")
    assert exited.value.code == 2 and "invalid float value: 'fast'" in capsys.readouterr().err


def test_the_metrics_show_the_rate_that_holds(clean, engine, db):
    from outbox import metrics

    write_rows(engine, 1)
    pace(engine, 12.5)
    reading = metrics.read_database(db)
    assert reading.rates == {DEST: 12.5} and reading.limits == {}
    reading.destinations = [DEST, "mail.send"]
    metrics.DATABASE.update(reading, fresh_for_seconds=60)
    try:
        sample = metrics.REGISTRY.get_sample_value
        assert sample("outbox_destination_calls_per_second_limit", {"destination": DEST}) == 12.5
        assert sample("outbox_destination_calls_per_second_limit", {"destination": "mail.send"}) == 0
    finally:
        metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)


def test_a_held_row_past_its_deadline_fails_as_a_paused_one_does(clean, engine, db):
    """A destination at its limit has no claim to fail a row whose deadline passes: the
    reconciler's deadline job does, saying why, as for a paused destination."""
    ids = write_rows(engine, 2)
    db.execute(
        "UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() WHERE id = %s", (ids[1],)
    )
    with engine.begin() as conn:
        limits.set_limit(conn, DEST, in_flight=1, per_second=0.01, by="test", reason="slow provider")
    assert claim(db, ids[0]) is not None
    assert claim(db, ids[1]) is None, "held: the limit is full"
    db.execute("UPDATE outbox_message SET deadline = now() - interval '1 s' WHERE id = %s", (ids[1],))
    moved = store.recovery.fail_past_deadline(db, destinations=[DEST], limit=100)
    assert moved.failed == 1 and moved.unknown == 0
    row = get(db, ids[1])
    assert row["state"] == "failed" and "held back (limited)" in row["last_error"], row["last_error"]
    assert row["attempts"] == 0


def test_show_says_which_limits_a_waiting_row_waits_for(clean, engine, db, capsys):
    ids = write_rows(engine, 2)
    with engine.begin() as conn:
        limits.set_limit(conn, DEST, in_flight=3, per_second=0.5, by="test", reason="slow provider")
    assert claim(db, ids[0]) is not None
    code, out, _ = cli(clean, capsys, "show", str(ids[1]), "--json")
    assert (
        code == 0 and json.loads(out)["row"]["limited_by"] == "at most 3 calls in flight, at most 0.5 calls/s"
    )
    code, out, _ = cli(clean, capsys, "show", str(ids[0]))
    assert code == 0 and "at most 3 calls in flight" not in out, "a claimed row waits for nothing"


def test_a_new_rate_spaces_the_very_next_start(clean, engine, db):
    """After a claim at 0.01/s (the next start 100 s away), raising the rate, or clearing it
    and setting another, lets the next claim through at once: the booking keeps the last start,
    and the period is the rate's that holds now."""
    ids = write_rows(engine, 4)
    pace(engine, 0.01)
    assert claim(db, ids[0]) is not None
    assert claim(db, ids[1]) is None, "the next start is 100 s away"
    held = store.delivery.held_by_limit(db, row_id=ids[1], destination=DEST)
    assert held is not None and 98 < (held.booked_ahead_seconds or 0) <= 100.1
    pace(engine, 100)
    got = claim(db, ids[1])
    assert got is not None and got.pace_seconds <= 0.11, got
    with engine.begin() as conn:
        limits.clear_limit(conn, DEST, by="test")
    pace(engine, 0.001)
    assert claim(db, ids[2]) is None, "1000 s after the last start"
    pace(engine, 1000)
    assert claim(db, ids[2]) is not None


def test_a_refused_probe_of_a_half_open_breaker_is_held_not_acked(clean, engine, db):
    """The claim of a half-open breaker's probe reserves the probe, then the pace refuses it:
    the probe is given back and the delivery is held, to be the probe once a start is free."""
    ids = write_rows(engine, 2)
    pace(engine, 0.2)
    assert claim(db, ids[0]) is not None
    db.execute(
        "UPDATE outbox_destination SET breaker_opened_at = now() - interval '20 s', "
        "breaker_open_until = now() - interval '1 s', breaker_open_seconds = 10 WHERE destination = %s",
        (DEST,),
    )
    token = uuid.uuid4()
    refused = store.delivery.claim(db, row_id=ids[1], destination=DEST, lease_seconds=30, token=token)
    assert refused is None
    held = store.delivery.held_by_limit(db, row_id=ids[1], destination=DEST, token=token)
    assert held is not None and held.per_second == 0.2, "held, not acked as paused"
    probe = db.execute(
        "SELECT breaker_probe_token FROM outbox_destination WHERE destination = %s", (DEST,)
    ).fetchone()
    assert probe == (None,), "the probe the refused claim reserved is free again"
