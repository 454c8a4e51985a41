"""Group claims (outbox.consumer.Deliverer.claim_group, outbox.store.delivery.claim_group): the
rows of one fetch claimed in one statement and one commit, each under its own token; what a
group cannot claim is left to each row's own claim; a lost reply is every row's; the worker's
loop claims its fetches together."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
from dramatiq.middleware import Middleware
from helpers import relay_once, sql, wait_for, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import middleware, store
from outbox.consumer import DeliveryResult, LostClaim
from outbox.settings import libpq_url

DEST = "payments.charge"


def declare_charge(provider: Any, **options: Any) -> Any:
    @outbox.handler(DEST, **{"time_limit": 5, "backoff": (60,), **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def declare_charge_async(provider: Any) -> Any:
    """``declare_charge``'s ``async def`` twin."""

    @outbox.handler(DEST, time_limit=5, backoff=(60,))
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = await d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def write(engine: Any, n: int, *, prefix: str = "order", destination: str = DEST, **kw: Any) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s,
                key=f"{prefix}:{i}",
                step="charge",
                destination=destination,
                payload={"amount_cents": 100 + i, "currency": "EUR"},
                **kw,
            ).id
            for i in range(n)
        ]


def states(services: Any, ids: list[int]) -> list[tuple[str, int]]:
    return [
        (r[0], r[1])
        for r in sql(
            services, "SELECT state, attempts FROM outbox_message WHERE id = ANY(%s) ORDER BY id", (ids,)
        )
    ]


def claim_transactions(services: Any, ids: list[int]) -> int:
    """How many transactions wrote the rows' attempt rows (their xmin): one per claim's commit."""
    (n,) = sql(
        services,
        "SELECT count(DISTINCT xmin::text) FROM outbox_attempt WHERE message_id = ANY(%s)",
        (ids,),
    )[0]
    return int(n)


def test_a_group_claims_its_rows_in_one_commit_each_under_its_own_token(clean, engine, provider, consumer):
    declare_charge(provider)
    ids = write(engine, 4)
    assert relay_once(clean) == 4
    c = consumer()
    taken = c.claim_group(ids, DEST)
    assert sorted(taken) == ids
    tokens = {t[1].token for t in taken.values()}  # type: ignore[union-attr]
    assert len(tokens) == 4
    assert states(clean, ids) == [("in_flight", 1)] * 4
    assert claim_transactions(clean, ids) == 1
    owners = dict(sql(clean, "SELECT id, claim_token FROM outbox_message WHERE id = ANY(%s)", (ids,)))
    assert {row_id: t[1].token for row_id, t in taken.items()} == owners  # type: ignore[union-attr]
    for row_id in ids:
        assert c.deliver(row_id, DEST, taken[row_id]) is DeliveryResult.SENT
    assert states(clean, ids) == [("sent", 1)] * 4
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in range(4)}


def test_what_a_group_cannot_claim_is_left_to_each_rows_own_claim(clean, engine, provider, consumer):
    declare_charge(provider)
    free = write(engine, 2, prefix="free")
    (taken_already,) = write(engine, 1, prefix="taken")
    head, behind = write(engine, 2, prefix="ordered", ordering_key="customer:7")
    # The row behind the head of its ordering key stays pending: the relay does not publish it.
    assert relay_once(clean) == 4
    c = consumer()
    assert c.deliver(taken_already, DEST) is DeliveryResult.SENT
    taken = c.claim_group([*free, taken_already, behind], DEST)
    # The row another claim took and the row behind the head of its ordering key stay out.
    assert sorted(taken) == free
    assert states(clean, [taken_already, behind]) == [("sent", 1), ("pending", 0)]
    assert c.deliver(taken_already, DEST) is DeliveryResult.EMPTY
    assert c.deliver(behind, DEST) is DeliveryResult.EMPTY
    for row_id in free:
        assert c.deliver(row_id, DEST, taken[row_id]) is DeliveryResult.SENT
    assert c.deliver(head, DEST) is DeliveryResult.SENT
    assert c.deliver(behind, DEST) is DeliveryResult.SENT
    assert provider.charges() == 5


def test_a_group_takes_no_breaker_probe_and_no_paused_row(clean, engine, provider, consumer):
    declare_charge(provider)
    ids = write(engine, 3)
    assert relay_once(clean) == 3
    c = consumer()
    sql(clean, "INSERT INTO outbox_destination (destination) VALUES (%s) ON CONFLICT DO NOTHING", (DEST,))
    sql(
        clean,
        "UPDATE outbox_destination SET paused_until = now() + interval '1 hour', paused_at = now() "
        "WHERE destination = %s",
        (DEST,),
    )
    assert c.claim_group(ids, DEST) == {}
    # Half-open: one probe may go. A group claims nothing; the probe is one single claim's.
    sql(
        clean,
        "UPDATE outbox_destination SET paused_until = NULL, breaker_opened_at = now() - interval '1 minute', "
        "breaker_open_until = now() - interval '1 second' WHERE destination = %s",
        (DEST,),
    )
    assert c.claim_group(ids, DEST) == {}
    assert states(clean, ids) == [("dispatched", 0)] * 3
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        first = store.delivery.claim(conn, row_id=ids[0], destination=DEST, lease_seconds=30)
        assert isinstance(first, store.delivery.Claimed) and first.probe
        assert store.delivery.claim(conn, row_id=ids[1], destination=DEST, lease_seconds=30) is None
        (probes,) = conn.execute(
            "SELECT breaker_probes FROM outbox_destination WHERE destination = %s", (DEST,)
        ).fetchone() or (None,)
    assert probes == 1
    assert provider.charges() == 0


def test_a_locked_row_rolls_the_group_back_and_each_row_waits_for_itself(clean, engine, provider, consumer):
    declare_charge(provider)
    ids = write(engine, 3)
    assert relay_once(clean) == 3
    c = consumer()
    with psycopg.connect(libpq_url(clean.database_url)) as holder:
        holder.execute("SELECT id FROM outbox_message WHERE id = %s FOR UPDATE", (ids[1],))
        assert c.claim_group(ids, DEST) == {}
        # Nothing of the group committed: no row claimed, no attempt row.
        assert states(clean, ids) == [("dispatched", 0)] * 3
        assert claim_transactions(clean, ids) == 0
        assert c.deliver(ids[0], DEST) is DeliveryResult.SENT
        holder.rollback()
    assert c.deliver(ids[1], DEST) is DeliveryResult.SENT
    assert c.deliver(ids[2], DEST) is DeliveryResult.SENT
    assert provider.charges() == 3


def test_a_group_sends_a_row_whose_earlier_call_is_older_than_key_ttl_to_unknown(
    clean, engine, provider, consumer
):
    declare_charge(provider, idempotent=True, key_ttl=3600, backoff=(1,))
    old, fresh = write(engine, 2)
    assert relay_once(clean) == 2
    # An earlier call of `old` may have taken effect two hours ago: its key may be forgotten.
    sql(clean, "UPDATE outbox_message SET attempts = 1 WHERE id = %s", (old,))
    sql(
        clean,
        "INSERT INTO outbox_attempt (message_id, attempt, claim_token, started_at, finished_at, outcome) "
        "VALUES (%s, 1, %s, now() - interval '2 hours', now() - interval '2 hours', 'unknown')",
        (old, uuid.uuid4()),
    )
    c = consumer()
    taken = c.claim_group([old, fresh], DEST)
    assert taken[old] is DeliveryResult.UNKNOWN
    assert c.deliver(old, DEST, taken[old]) is DeliveryResult.UNKNOWN
    assert c.deliver(fresh, DEST, taken[fresh]) is DeliveryResult.SENT
    assert states(clean, [old, fresh]) == [("unknown", 1), ("sent", 1)]
    assert provider.charges() == 1


class Before(Middleware):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.before: list[int] = []
        self.after: list[int] = []

    def before_process_message(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.before.append(message.args[0])

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        with self.lock:
            self.after.append(message.args[0])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_worker_claims_a_fetch_of_several_messages_together(clean, engine, provider, kind, monkeypatch):
    """Forty rows waiting before the worker starts, eight slots: its first fetch takes eight
    messages, and their claims are one statement; each row is charged once and the middleware
    hears each message once before and once after."""
    groups: list[int] = []
    real = store.delivery.claim_group

    def counted(conn: Any, **kw: Any) -> Any:
        claimed = real(conn, **kw)
        groups.append(len(claimed))
        return claimed

    monkeypatch.setattr(store.delivery, "claim_group", counted)
    if kind == "sync":
        declare_charge(provider)
    else:
        declare_charge_async(provider)

    seen = Before()
    middleware.clear()
    outbox.worker_middleware(seen)
    try:
        ids = write(engine, 40)
        assert relay_once(clean) == 40
        with worker_thread(clean, threads=8):
            wait_for(lambda: len(seen.after) == 40, 60, "forty deliveries")
    finally:
        middleware.clear()
    assert states(clean, ids) == [("sent", 1)] * 40
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in range(40)}
    assert sorted(seen.before) == sorted(seen.after) == ids
    assert groups[0] == 8
    assert sum(groups) <= 40


def test_an_async_group_row_settled_before_any_call_is_recorded_off_the_event_loop(
    clean, engine, provider, monkeypatch
):
    """A grouped row's pre-flight runs on the event loop (no hop to a thread before its call);
    a row it settles without a call (its deadline passed) is recorded on a database thread, never
    on the loop that every call in flight shares."""
    groups: list[int] = []
    record_threads: list[str] = []
    real_group, real_record = store.delivery.claim_group, store.delivery.record

    def counted(conn: Any, **kw: Any) -> Any:
        claimed = real_group(conn, **kw)
        groups.append(len(claimed))
        return claimed

    def recorded(conn: Any, **kw: Any) -> Any:
        record_threads.append(threading.current_thread().name)
        return real_record(conn, **kw)

    monkeypatch.setattr(store.delivery, "claim_group", counted)
    monkeypatch.setattr(store.delivery, "record", recorded)

    declare_charge_async(provider)

    ids = write(engine, 24)
    late = ids[::4]
    sql(clean, "UPDATE outbox_message SET deadline = now() - interval '1 second' WHERE id = ANY(%s)", (late,))
    assert relay_once(clean) == 24
    with worker_thread(clean, threads=8):
        wait_for(lambda: len(record_threads) == 24, 60, "twenty-four records")
    assert groups and groups[0] == 8
    assert states(clean, ids) == [("failed" if i in late else "sent", 1) for i in ids]
    assert provider.stats()["effects"] == {f"order:{n}:charge": 1 for n, i in enumerate(ids) if i not in late}
    assert "outbox-async" not in record_threads


@pytest.mark.parametrize(
    "poison",
    [
        "deadline = 'infinity'",
        # Deeper than Python's JSON parser goes: a RecursionError, not a psycopg error.
        "payload = CAST('{\"a\":' || repeat('[', 3000) || repeat(']', 3000) || '}' AS jsonb)",
    ],
    ids=["infinite-deadline", "deep-payload"],
)
def test_a_row_this_process_cannot_read_back_strands_none_of_its_group(
    clean, engine, provider, consumer, poison, monkeypatch
):
    """The group commits, then one row cannot be loaded (here: a connection without the
    tolerant loaders of outbox.db, as for any value a loader refuses): every row of the group is
    claimed, so none may be left for its own claim to find taken. Each fences its own token and
    is released without a call; the others are charged once."""
    import outbox.consumer

    monkeypatch.setattr(outbox.consumer, "tolerate_unloadable", lambda conn: conn)
    declare_charge(provider)
    ids = write(engine, 4)
    poisoned = ids[2]
    sql(clean, f"UPDATE outbox_message SET {poison} WHERE id = %s", (poisoned,))
    assert relay_once(clean) == 4
    c = consumer()
    taken = c.claim_group(ids, DEST)
    assert sorted(taken) == ids and all(isinstance(t, LostClaim) for t in taken.values())
    for row_id in ids:
        assert c.deliver(row_id, DEST, taken[row_id]) is DeliveryResult.RELEASED
    assert provider.stats()["requests"] == 0
    assert states(clean, ids) == [("pending", 0)] * 4
    assert relay_once(clean) == 4
    for row_id in ids:
        if row_id != poisoned:
            assert c.deliver(row_id, DEST) is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in (0, 1, 3)}


def test_what_plain_sql_stores_and_python_cannot_hold_ends_terminal(clean, engine, provider, consumer):
    """A deadline of 'infinity' (never reached) or '-infinity' (always passed), a payload nested
    deeper than Python's JSON parser goes: all written by plain SQL, all claimed in one group
    with ordinary rows. Each ends terminal at its first claim (before, each was released and
    claimed again for ever): the infinite deadline's row is charged, the others fail without a
    call, with the reason."""
    declare_charge(provider)
    ids = write(engine, 5)
    never, always, deep = ids[1], ids[2], ids[3]
    sql(clean, "UPDATE outbox_message SET deadline = 'infinity' WHERE id = %s", (never,))
    sql(clean, "UPDATE outbox_message SET deadline = '-infinity' WHERE id = %s", (always,))
    sql(
        clean,
        "UPDATE outbox_message SET payload = "
        "CAST('{\"a\":' || repeat('[', 3000) || repeat(']', 3000) || '}' AS jsonb) WHERE id = %s",
        (deep,),
    )
    assert relay_once(clean) == 5
    c = consumer()
    taken = c.claim_group(ids, DEST)
    assert sorted(taken) == ids and not any(isinstance(t, LostClaim) for t in taken.values())
    results = {row_id: c.deliver(row_id, DEST, taken[row_id]) for row_id in ids}
    assert results == {i: DeliveryResult.FAILED if i in (always, deep) else DeliveryResult.SENT for i in ids}
    assert states(clean, ids) == [("failed" if i in (always, deep) else "sent", 1) for i in ids]
    assert provider.stats()["effects"] == {f"order:{n}:charge": 1 for n in (0, 1, 4)}
    errors = dict(
        sql(clean, "SELECT id, last_error FROM outbox_message WHERE id = ANY(%s)", ([always, deep],))
    )
    assert errors[always].startswith("deadline passed before the call")
    assert errors[deep].startswith("the payload cannot be read: it is nested deeper than")

    # Claimed alone, as a fetch of one message is; a number of more digits than int() converts.
    alone = write(engine, 3, prefix="alone")
    sql(clean, "UPDATE outbox_message SET deadline = 'infinity' WHERE id = %s", (alone[0],))
    sql(clean, "UPDATE outbox_message SET payload = %s::jsonb WHERE id = %s", (_deep_json(), alone[1]))
    sql(
        clean, """UPDATE outbox_message SET payload = '{"amount_cents": 1e5000}' WHERE id = %s""", (alone[2],)
    )
    assert relay_once(clean) == 3
    assert [c.deliver(row_id, DEST) for row_id in alone] == [
        DeliveryResult.SENT,
        DeliveryResult.FAILED,
        DeliveryResult.FAILED,
    ]
    (error,) = sql(clean, "SELECT last_error FROM outbox_message WHERE id = %s", (alone[2],))[0]
    assert error.startswith("the payload cannot be read: this process's JSON parser refuses it")


def _deep_json() -> str:
    return '{"a":' + "[" * 3000 + "]" * 3000 + "}"
