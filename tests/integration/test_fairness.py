"""Priority, fairness keys and the dispatch window (issue 33, part 3; outbox.windows): what
``outbox.write`` accepts and compares, what next steps inherit, and the order and amount the
relay publishes of a limited destination, against real PostgreSQL and Redis."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pytest
from helpers import published_row_ids, sql
from sqlalchemy.orm import Session

import outbox
from outbox import limits, store, windows
from outbox.cli import main
from outbox.consumer import DeliveryResult
from outbox.exceptions import FeatureNotEnabled, InvalidMessage, KeyConflict
from outbox.reconciler.jobs.batches import finish_batches
from outbox.relay import Relay
from outbox.settings import libpq_url

from .test_chains import declare

pytestmark = pytest.mark.timeout(120)

DEST = "mail.send"
OTHER = "crm.sync"


def write(engine: Any, key: str, *, destination: str = DEST, step: str = "send", **kw: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step=step, destination=destination, payload={"k": key}, **kw).id


def write_many(engine: Any, prefix: str, n: int, *, destination: str = DEST, **kw: Any) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s, key=f"{prefix}:{i}", step="send", destination=destination, payload={"i": i}, **kw
            ).id
            for i in range(n)
        ]


def limit(engine: Any, destination: str = DEST, **kinds: Any) -> None:
    with engine.begin() as conn:
        limits.set_limit(conn, destination, by="test", reason="the provider's quota", **kinds)


def take(services: Any) -> list[int]:
    """One take of one relay (``run_once``); the ids it published, in the order consumers get them."""
    before = set(published_row_ids(redis_of(services), services.namespace, [DEST, OTHER]))
    relay = Relay(
        database_url=services.database_url, redis_url=services.redis_url, namespace=services.namespace
    )
    try:
        relay.run_once()
    finally:
        relay.close()
    return [
        i for i in published_row_ids(redis_of(services), services.namespace, [DEST, OTHER]) if i not in before
    ]


def redis_of(services: Any) -> Any:
    from outbox import transport

    return transport.connect(services.redis_url)


def settle(services: Any, ids: list[int]) -> None:
    sql(
        services,
        "UPDATE outbox_message SET state = 'sent', provider_ref = 'r', completed_at = now() "
        "WHERE id = ANY(%s)",
        (ids,),
    )


# -- outbox.write ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"priority": "urgent"}, "priority must be one of 'high', 'normal', 'low'"),
        ({"priority": 1}, "priority must be one of"),
        ({"priority": None}, "priority must be one of"),
        ({"fairness_key": ""}, "fairness_key must be 1 to 200 characters"),
        ({"fairness_key": "t" * 201}, "fairness_key must be 1 to 200 characters"),
        ({"fairness_key": 42}, "fairness_key must be a str"),
        ({"fairness_key": "tenant\n42"}, "control character"),
    ],
)
def test_bad_priorities_and_fairness_keys_are_refused_before_any_statement(clean, engine, options, message):
    with pytest.raises(InvalidMessage, match=message):
        write(engine, "order:1", **options)
    assert sql(clean, "SELECT count(*) FROM outbox_message") == [(0,)]


def test_a_row_stores_its_priority_and_fairness_key_and_a_rewrite_must_match(clean, engine):
    row_id = write(engine, "order:1", priority="high", fairness_key="tenant:42")
    assert sql(clean, "SELECT priority, fairness_key FROM outbox_message WHERE id = %s", (row_id,)) == [
        (1, "tenant:42")
    ]
    with Session(engine) as s, s.begin():
        again = outbox.write(
            s, key="order:1", step="send", destination=DEST, payload={"k": "order:1"},
            priority="high", fairness_key="tenant:42",
        )  # fmt: skip
    assert (again.id, again.created) == (row_id, False)
    for other in ({"priority": "low", "fairness_key": "tenant:42"}, {"priority": "high"},
                  {"priority": "high", "fairness_key": "tenant:43"}):  # fmt: skip
        with pytest.raises(KeyConflict), Session(engine) as s, s.begin():
            outbox.write(s, key="order:1", step="send", destination=DEST, payload={"k": "order:1"}, **other)
    assert write(engine, "order:2") and sql(
        clean, "SELECT priority, fairness_key FROM outbox_message WHERE key = 'order:2'"
    ) == [(0, None)]


def test_the_database_refuses_a_priority_or_fairness_key_out_of_range(clean):
    for column, value in (("priority", 2), ("fairness_key", "")):
        with pytest.raises(psycopg.errors.CheckViolation):
            sql(
                clean,
                f"INSERT INTO outbox_message (key, step, destination, payload, {column}) "
                "VALUES ('k', 's', 'd', '{}', %s)",
                (value,),
            )


def test_next_steps_and_a_batch_then_row_inherit_priority_and_fairness_key(
    clean, engine, provider, consumer, db
):
    charge = declare(provider, "payments.charge")
    declare(provider, "mail.notify")

    @charge.then
    def after(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("notify", "mail.notify", {"charge": c.ref})]

    row_id = write(engine, "invoice:9", destination="payments.charge", step="charge",
                   priority="low", fairness_key="tenant:9")  # fmt: skip
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.SENT
    assert sql(clean, "SELECT priority, fairness_key, via FROM outbox_message WHERE key = 'invoice:9' "
               "AND step = 'notify'") == [(-1, "tenant:9", "then")]  # fmt: skip

    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name="import:3", then=outbox.Next("report", "mail.notify", {"import": 3}))
        members = [
            outbox.write(s, key="import:3", step=f"chunk-{n}", destination="mail.notify", payload={"n": n},
                         batch=b, priority=p, fairness_key="tenant:3").id
            for n, p in enumerate(("low", "high", "normal"))
        ]  # fmt: skip
    for member in members:
        assert consumer().deliver(member, "mail.notify") is DeliveryResult.SENT
    assert finish_batches(db) == {"then": 1, "written": 1}
    # The members' highest priority, and the fairness key they all share.
    assert sql(clean, "SELECT priority, fairness_key FROM outbox_message WHERE step = 'report'") == [
        (1, "tenant:3")
    ]


# -- the relay's window --------------------------------------------------------------------------


def test_without_a_limit_every_due_row_goes_at_once_in_due_order(clean, engine):
    big = write_many(engine, "a", 30, fairness_key="tenant:a")
    small = write_many(engine, "b", 3, fairness_key="tenant:b", priority="high")
    assert take(clean) == big + small


def test_a_limited_destination_gets_its_window_in_turns_of_fairness_keys(clean, engine):
    limit(engine, per_second=10)  # window: 15 rows (1.5 s)
    size = windows.window_size(None, 10)
    assert size == 15
    big = write_many(engine, "a", 40, fairness_key="tenant:a")
    small = write_many(engine, "b", 3, fairness_key="tenant:b")
    plain = write_many(engine, "c", 2)
    unlimited = write_many(engine, "u", 5, destination=OTHER)
    published = take(clean)
    # The other destination's rows are not held by the window.
    assert [i for i in published if i in unlimited] == unlimited
    windowed = [i for i in published if i not in unlimited]
    # Turns: the first of each key, oldest first (rows without a key are one more key), then the
    # second of each... Each key's share of this take is room / keys (5 of 15): the keys with
    # fewer rows leave the window short, and the next take tops it up.
    assert windowed[:3] == [big[0], small[0], plain[0]]
    assert windowed[3:6] == [big[1], small[1], plain[1]]
    assert windowed[6:] == [big[2], small[2], big[3], big[4]]
    assert take(clean) == big[5:10]
    # The window is full: the next take publishes nothing of it...
    assert take(clean) == []
    # ...until rows settle: as many as settled.
    settle(clean, windowed[:4])
    assert take(clean) == big[10:14]


def test_priority_comes_first_and_a_waiting_row_rises_with_age(clean, engine):
    limit(engine, in_flight=1)  # window: 4 rows
    normal = write_many(engine, "n", 6)
    low = write_many(engine, "l", 2, priority="low")
    high = write_many(engine, "h", 2, priority="high")
    assert take(clean) == [*high, *normal[:2]]
    settle(clean, [*high, *normal[:2]])
    # A low row due for two aging periods ranks as high (one period: as normal, after the older).
    aged = windows.PRIORITY_AGING_SECONDS * 2 + 5
    sql(clean, "UPDATE outbox_message SET available_at = now() - %s * interval '1 second' WHERE id = %s",
        (aged, low[1]))  # fmt: skip
    assert take(clean) == [low[1], *normal[2:5]]


def test_an_ordering_key_beats_priority_in_the_window(clean, engine):
    limit(engine, per_second=100)
    head = write(engine, "o:1", ordering_key="customer:1", priority="low")
    behind = write(engine, "o:2", ordering_key="customer:1", priority="high")
    other = write(engine, "o:3", priority="normal")
    assert take(clean) == [other, head]
    settle(clean, [head])
    assert take(clean) == [behind]


def test_two_relays_never_fill_one_window_from_the_same_count(clean, engine):
    limit(engine, in_flight=2)
    write_many(engine, "a", 20)
    url = libpq_url(clean.database_url)
    with psycopg.connect(url) as first, psycopg.connect(url) as second:
        [(_, _, _, ours_first)] = store.relay.limited_destinations(first)
        [(_, _, _, ours_second)] = store.relay.limited_destinations(second)
        assert (ours_first, ours_second) == (True, False)
        window = store.relay.dispatch_window(first, destination=DEST, size=8)
        assert (window.room, len(window.rows)) == (8, 8)
        first.commit()  # the lock goes with the take's transaction
        second.rollback()
        [(_, _, _, ours_second)] = store.relay.limited_destinations(second)
        assert ours_second
        window = store.relay.dispatch_window(second, destination=DEST, size=8)
        assert (window.room, window.rows) == (0, [])
        second.commit()


def test_a_limit_declared_only_by_a_dead_process_opens_no_window(clean, engine):
    sql(clean, "INSERT INTO outbox_destination (destination, declared_in_flight) VALUES (%s, 1)", (DEST,))
    rows = write_many(engine, "a", 10)
    # The hint says a process declared one; none is live, so no limit is in force.
    assert take(clean) == rows


def test_clearing_a_limit_lets_the_backlog_go_within_the_refresh(clean, engine):
    limit(engine, per_second=2)  # window: 3
    rows = write_many(engine, "a", 10)
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    try:
        assert relay.run_once().published == 3
        assert relay.windows_waiting
        with engine.begin() as conn:
            limits.clear_limit(conn, DEST, by="test")
        # The relay re-reads the limits at every take while it fills windows.
        assert relay.run_once().published == 7
        assert not relay.windows_waiting
    finally:
        relay.close()
    assert sorted(published_row_ids(redis_of(clean), clean.namespace, [DEST])) == rows


def test_a_due_time_in_the_future_keeps_a_row_out_of_the_window(clean, engine):
    limit(engine, per_second=100)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    write(engine, "f:1", priority="high", fairness_key="t", available_at=later)
    now = write(engine, "f:2", priority="low")
    assert take(clean) == [now]


# -- what operators see ----------------------------------------------------------------------------


def test_limit_and_show_say_what_the_window_keeps_back_and_a_rows_turn(clean, engine, capsys):
    limit(engine, per_second=2)  # window: 3
    rows = write_many(engine, "a", 8, priority="low", fairness_key="tenant:a")
    take(clean)
    assert main(["limit", DEST, "--database-url", clean.database_url]) == 0
    out = capsys.readouterr().out
    assert "3 rows waiting since" in out and "5 more kept back by the relay's window since" in out, out
    assert main(["limit", "--json", "--database-url", clean.database_url]) == 0
    [shown] = json.loads(capsys.readouterr().out)["limits"]
    assert (shown["waiting"], shown["kept_back"]) == (3, 5) and shown["kept_back_since"]
    assert main(["show", str(rows[-1]), "--json", "--database-url", clean.database_url]) == 0
    row = json.loads(capsys.readouterr().out)["row"]
    assert (row["priority"], row["fairness_key"], row["state"]) == ("low", "tenant:a", "pending")
    assert row["limited_by"] == "at most 2 calls/s"


def test_many_fairness_keys_are_served_in_rotation_a_take_reading_only_its_share(clean, engine):
    """Ten tenants, a window of 3: each take serves the next three keys after the last one served,
    wrapping round, so every tenant gets its turn within four takes whatever the key order."""
    limit(engine, per_second=2)  # window: 3
    rows = {t: write_many(engine, f"t{t}", 3, fairness_key=f"tenant:{t}") for t in range(10)}
    key_of = {row: t for t, ids in rows.items() for row in ids}
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    served: list[list[int]] = []
    try:
        for _ in range(4):
            before = set(published_row_ids(redis_of(clean), clean.namespace, [DEST]))
            relay.run_once()
            now = [i for i in published_row_ids(redis_of(clean), clean.namespace, [DEST]) if i not in before]
            served.append(sorted(key_of[i] for i in now))
            settle(clean, now)
    finally:
        relay.close()
    assert served == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 9]], served


def test_a_fresh_high_row_goes_before_low_rows_aged_less_than_three_periods_not_after(clean, engine):
    limit(engine, in_flight=1)  # window: 4
    low = write_many(engine, "l", 6, priority="low")
    period = windows.PRIORITY_AGING_SECONDS
    # Two periods due: a low row ranks as high, but a row written high goes first.
    sql(clean, "UPDATE outbox_message SET available_at = now() - %s * interval '1 second'", (2 * period + 5,))
    high = write(engine, "h:1", priority="high")
    assert take(clean) == [high, *low[:3]]
    settle(clean, [high, *low[:3]])
    # Three periods due: the low rows now outrank a fresh high row (no row waits forever).
    sql(
        clean,
        "UPDATE outbox_message SET available_at = now() - %s * interval '1 second' WHERE id = ANY(%s)",
        (3 * period + 5, low[3:]),
    )
    later = write(engine, "h:2", priority="high")
    assert take(clean) == [*low[3:], later]


def test_an_in_flight_window_grows_with_what_the_destination_settles():
    assert windows.window_size(2, None) == 8
    assert windows.window_size(2, None, settled_per_second=100) == 150
    assert windows.window_size(2, 10.0, settled_per_second=100) == 15
    assert windows.window_size(None, None, settled_per_second=100) is None


def test_a_refill_tick_takes_the_windows_only_until_a_poll_interval_has_passed(clean, engine):
    limit(engine, per_second=2)  # window: 3
    limited = write_many(engine, "a", 10)
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    try:
        assert relay.run_once().published == 3 and relay.windows_waiting
        settle(clean, limited[:3])
        others = write_many(engine, "u", 2, destination=OTHER)
        # Woken by the refill timer, not by a NOTIFY: the window is refilled, the others wait...
        relay.refill_only = True
        assert relay.run_once().by_destination == {DEST: 3}
        # ...for the next NOTIFY, or until the others' take is a poll interval old.
        settle(clean, limited[3:6])
        relay._others_taken_at -= relay.poll_interval_seconds
        relay.refill_only = True
        result = relay.run_once()
        assert result.by_destination == {DEST: 3, OTHER: 2}, result
    finally:
        relay.close()
    assert set(published_row_ids(redis_of(clean), clean.namespace, [OTHER])) == set(others)


def test_an_in_flight_window_grows_only_with_what_settles(clean, engine):
    limit(engine, in_flight=2)  # window: 8 while nothing settles
    write_many(engine, "a", 200)
    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    try:
        for _ in range(10):
            relay.refill_only = True
            relay.run_once()
        # Nothing settled: the window stayed at its base size, whatever the takes.
        [(published,)] = sql(clean, "SELECT count(*) FROM outbox_message WHERE state = 'dispatched'")
        assert published == 8
        # Everything settles between takes: the window holds 1.5 s of what settled.
        sizes = []
        for _ in range(3):
            sql(
                clean,
                "UPDATE outbox_message SET state = 'sent', provider_ref = 'r', completed_at = now() "
                "WHERE state = 'dispatched'",
            )
            relay.refill_only = True
            sizes.append(relay.run_once().published)
        assert sizes[0] == 8 and sizes[1] > 8 and sizes[2] > sizes[1], sizes
    finally:
        relay.close()


def test_keys_whose_rows_are_not_due_are_passed_over_not_waited_on(clean, engine):
    """Fifty tenants whose only rows are due in an hour (a retry backing off), before three with
    a due row each in key order: one take serves the three (keys with nothing due do not count
    against its room), and a take visits at most MAX_KEYS_VISITED keys."""
    limit(engine, per_second=2)  # window: 3
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    for k in range(50):
        write(engine, f"f:{k}", fairness_key=f"a-{k:02}", available_at=later)
    due = [write(engine, f"d:{k}", fairness_key=f"b-{k}") for k in range(3)]
    assert sorted(take(clean)) == due
    assert windows.MAX_KEYS_VISITED < 1000


def test_the_gate_refuses_priority_and_fairness_keys_while_the_feature_is_off(clean, engine):
    row = write(engine, "g:1")
    saved = sql(
        clean, "DELETE FROM outbox_feature WHERE name = 'fairness' RETURNING name, needs_code, enabled_by"
    )
    try:
        with pytest.raises(FeatureNotEnabled, match="fairness"):
            write(engine, "g:2", priority="high")
        for column, value in (("priority", 1), ("fairness_key", "tenant:1")):
            with pytest.raises(psycopg.DatabaseError, match="not enabled") as raised:
                sql(clean, f"UPDATE outbox_message SET {column} = %s WHERE id = %s", (value, row))
            assert raised.value.sqlstate == "OB001"
        write(engine, "g:3", priority="normal")  # the default passes
    finally:
        for name, needs, by in saved:
            sql(
                clean,
                "INSERT INTO outbox_feature (name, needs_code, enabled_by) VALUES (%s, %s, %s)",
                (name, needs, by),
            )
