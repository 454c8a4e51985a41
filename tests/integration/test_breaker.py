"""The circuit breaker of a destination (issue 13 part 3): consecutive "not processed" outcomes
trip it, its rows then wait without a claim and without spending attempts, one probe goes
through when it half-opens, and the probe's outcome closes or re-opens it. Real PostgreSQL,
Redis and the provider simulator on 127.0.0.1, whose counters are the evidence; deliveries go
through the worker's own Deliverer, one at a time, so each transition is seen."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest
from helpers import relay_once, wait_for
from sqlalchemy import text

import outbox
from outbox import breaker, metrics, store
from outbox.cli import main
from outbox.consumer import Deliverer, DeliveryResult
from outbox.exceptions import ConfigError
from outbox.handlers import registry
from outbox.reconciler.jobs.redispatch import redispatch

from .reconciler.support import DEST, get, write_rows

pytestmark = pytest.mark.timeout(120)

SMALL = outbox.Breaker(failures=3, window_seconds=60, open_seconds=2, max_open_seconds=8)


def charge_handler(provider: Any, *, breaker_: outbox.Breaker | None = SMALL, max_attempts: int = 5) -> Any:
    @outbox.handler(DEST, time_limit=5, max_attempts=max_attempts, backoff=(0.01,), breaker=breaker_)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def row_of(db: Any) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM outbox_destination WHERE destination = %s", (DEST,))
    found = cur.fetchone()
    if found is None:
        return {}
    return dict(zip([c.name for c in cur.description or ()], found, strict=True))


def half_open(db: Any) -> None:
    """Time passes: the breaker's open period ends (on the database's clock)."""
    db.execute(
        "UPDATE outbox_destination SET breaker_open_until = now() - interval '1 millisecond' "
        "WHERE destination = %s AND breaker_opened_at IS NOT NULL",
        (DEST,),
    )
    db.execute("UPDATE outbox_message SET available_at = now() WHERE state = 'pending'")  # backoffs too


def open_breaker(
    engine: Any, *, for_seconds: float = 0, open_seconds: float = 2, reason: str | None = None
) -> None:
    """The destination's breaker tripped, open ``for_seconds`` more (0: half-open now)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_destination (destination, breaker_opened_at, breaker_open_until, "
                "breaker_open_seconds, breaker_reason) "
                "VALUES (:d, now(), now() + :for_seconds * interval '1 second', :secs, :reason)"
            ),
            {"d": DEST, "for_seconds": for_seconds, "secs": open_seconds, "reason": reason},
        )


def attempts(db: Any) -> dict[int, int]:
    return dict(db.execute("SELECT id, attempts FROM outbox_message").fetchall())


class _LazyExecutor:
    """The worker's Deliverer, made at the first delivery: after the test declared its handler."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.made: Deliverer | None = None

    def deliver(self, row_id: int, destination: str) -> DeliveryResult:
        if self.made is None:
            self.made = Deliverer(self.database_url, registry())
        return self.made.deliver(row_id, destination)


@pytest.fixture
def deliverer(clean: Any) -> Any:
    lazy = _LazyExecutor(clean.database_url)
    yield lazy
    if lazy.made is not None:
        lazy.made.close()


def test_consecutive_not_processed_outcomes_trip_it_and_later_rows_wait_without_spending_attempts(
    clean, engine, db, provider
):
    charge_handler(provider)
    rows = write_rows(engine, 6)
    provider.unavailable()
    deliverer = Deliverer(clean.database_url, registry())
    try:
        results = [deliverer.deliver(r, DEST) for r in rows]
    finally:
        deliverer.close()
    assert results[:3] == [DeliveryResult.PENDING] * 3
    assert results[3:] == [DeliveryResult.PAUSED] * 3, results
    assert provider.stats()["requests"] == 3, "no call once tripped"
    spent = attempts(db)
    assert [spent[r] for r in rows] == [1, 1, 1, 0, 0, 0]
    state = row_of(db)
    assert state["breaker_opened_at"] is not None and state["breaker_trips"] == 1
    assert "503" in state["breaker_reason"]
    with engine.connect() as conn:
        [shown] = breaker.open_breakers(conn)
    assert shown.destination == DEST and not shown.half_open
    assert "breaker open: payments.charge" in shown.describe()
    assert provider.charges() == 0


@pytest.mark.parametrize("fault", ["drop_after", "fail_after", "decline"])
def test_ambiguous_and_processed_outcomes_never_count(clean, engine, db, provider, deliverer, fault):
    """A dropped connection or a 500 after the request (ambiguous) is not "not processed", and a
    refusal (402) is processed: none of them trips the breaker, however many."""
    charge_handler(provider)
    rows = write_rows(engine, 5)
    provider.configure(**{f"{fault}_rate": 1.0})
    for r in rows:
        assert deliverer.deliver(r, DEST) in (DeliveryResult.UNKNOWN, DeliveryResult.FAILED)
    assert provider.stats()["requests"] == 5
    assert row_of(db).get("breaker_opened_at") is None
    assert row_of(db).get("breaker_failures", 0) == 0


def test_a_processed_outcome_starts_the_count_again(clean, engine, db, provider, deliverer):
    charge_handler(provider)
    rows = write_rows(engine, 5)
    provider.unavailable(times=2)
    assert [deliverer.deliver(r, DEST) for r in rows[:3]] == [DeliveryResult.PENDING] * 2 + [
        DeliveryResult.SENT
    ]
    assert row_of(db)["breaker_failures"] == 0, "the success reset the count"
    provider.unavailable(times=2)
    assert [deliverer.deliver(r, DEST) for r in rows[3:]] == [DeliveryResult.PENDING] * 2
    assert row_of(db)["breaker_failures"] == 2 and row_of(db)["breaker_opened_at"] is None


def test_failures_older_than_the_window_start_the_count_again(clean, engine, db, provider, deliverer):
    charge_handler(provider)
    rows = write_rows(engine, 4)
    provider.unavailable()
    for r in rows[:2]:
        assert deliverer.deliver(r, DEST) is DeliveryResult.PENDING
    db.execute("UPDATE outbox_destination SET breaker_window_at = breaker_window_at - interval '61 seconds'")
    assert deliverer.deliver(rows[2], DEST) is DeliveryResult.PENDING
    assert row_of(db)["breaker_failures"] == 1 and row_of(db)["breaker_opened_at"] is None
    assert deliverer.deliver(rows[3], DEST) is DeliveryResult.PENDING
    assert row_of(db)["breaker_failures"] == 2


def test_the_probe_reopens_for_twice_as_long_without_spending_an_attempt_then_closes_it(
    clean, engine, db, provider, deliverer
):
    charge_handler(provider)
    rows = write_rows(engine, 6)
    provider.unavailable()
    for r in rows[:3]:
        deliverer.deliver(r, DEST)
    assert deliverer.deliver(rows[3], DEST) is DeliveryResult.PAUSED

    half_open(db)
    assert deliverer.deliver(rows[3], DEST) is DeliveryResult.PENDING  # the probe: still down
    probe = get(db, rows[3])
    assert probe["attempts"] == 0, "a probe that found the provider down is not an attempt"
    assert "not counted as an attempt" in probe["last_error"]
    outcomes = db.execute("SELECT outcome FROM outbox_attempt WHERE message_id = %s", (rows[3],)).fetchall()
    assert outcomes == [("retry",)]
    state = row_of(db)
    assert state["breaker_open_seconds"] == 4.0 and state["breaker_probe_token"] is None
    assert state["breaker_probes"] == 1
    assert deliverer.deliver(rows[4], DEST) is DeliveryResult.PAUSED, "open again"

    for expected in (8.0, 8.0):  # doubled, up to max_open_seconds
        half_open(db)
        assert deliverer.deliver(rows[4], DEST) is DeliveryResult.PENDING
        assert row_of(db)["breaker_open_seconds"] == expected
    assert get(db, rows[4])["attempts"] == 0

    provider.healthy()
    half_open(db)
    assert deliverer.deliver(rows[5], DEST) is DeliveryResult.SENT  # the probe gets through
    state = row_of(db)
    assert state["breaker_opened_at"] is None and state["breaker_closed_at"] is not None
    assert state["breaker_failures"] == 0
    db.execute("UPDATE outbox_message SET available_at = now() WHERE state = 'pending'")
    for r in rows[:5]:
        assert deliverer.deliver(r, DEST) is DeliveryResult.SENT
    assert provider.stats()["double_charged"] == [] and provider.charges() == 6
    assert max(attempts(db).values()) <= 2


def test_an_ambiguous_probe_reopens_for_as_long_as_before(clean, engine, db, provider, deliverer):
    charge_handler(provider)
    rows = write_rows(engine, 4)
    provider.unavailable()
    for r in rows[:3]:
        deliverer.deliver(r, DEST)
    provider.healthy()
    provider.drop_after_charge(times=1)
    half_open(db)
    assert deliverer.deliver(rows[3], DEST) is DeliveryResult.UNKNOWN
    state = row_of(db)
    assert state["breaker_opened_at"] is not None and state["breaker_open_seconds"] == 2.0
    assert state["breaker_probe_token"] is None
    assert get(db, rows[3])["attempts"] == 1, "an ambiguous call is an attempt"


def test_exactly_one_claim_gets_the_probe_when_many_race(clean, engine, db, provider):
    """Eight claims of eight rows wait on the destination row's lock and are let go at once:
    one of them is the probe, the others are refused."""
    charge_handler(provider)
    rows = write_rows(engine, 8)
    open_breaker(engine)
    results: list[Any] = []
    lock = threading.Lock()

    def claim(row_id: int) -> None:
        import psycopg

        from outbox.settings import libpq_url

        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            got = store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30)
        with lock:
            results.append(got)

    import psycopg

    from outbox.settings import libpq_url

    with psycopg.connect(libpq_url(clean.database_url)) as locker:
        locker.execute("SELECT 1 FROM outbox_destination WHERE destination = %s FOR UPDATE", (DEST,))
        threads = [threading.Thread(target=claim, args=(r,)) for r in rows]
        for t in threads:
            t.start()
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()[
                    0
                ]
                >= 8
            ),
            10,
            "every claim to wait on the lock",
        )
        locker.commit()
    for t in threads:
        t.join(10)
    claimed = [r for r in results if r is not None]
    assert len(results) == 8 and len(claimed) == 1, results
    assert claimed[0].probe
    assert row_of(db)["breaker_probe_token"] == claimed[0].token
    assert db.execute("SELECT count(*) FROM outbox_attempt").fetchone()[0] == 1


def test_a_probe_that_never_records_frees_the_probe_at_its_lease_end(clean, engine, db, provider):
    charge_handler(provider)
    rows = write_rows(engine, 2)
    open_breaker(engine)
    first = store.delivery.claim(db, row_id=rows[0], destination=DEST, lease_seconds=0.5)  # then dies
    assert first is not None and first.probe
    assert store.delivery.claim(db, row_id=rows[1], destination=DEST, lease_seconds=30) is None
    time.sleep(0.6)
    second = store.delivery.claim(db, row_id=rows[1], destination=DEST, lease_seconds=30)
    assert second is not None and second.probe


def test_a_released_probe_frees_the_probe_at_once(clean, engine, db, provider):
    charge_handler(provider)
    rows = write_rows(engine, 2)
    open_breaker(engine)
    first = store.delivery.claim(db, row_id=rows[0], destination=DEST, lease_seconds=30)
    assert isinstance(first, store.delivery.Claimed) and first.probe
    assert store.delivery.release(db, row_id=first.id, token=first.token, reason="no call") is not None
    second = store.delivery.claim(db, row_id=rows[1], destination=DEST, lease_seconds=30)
    assert second is not None and second.probe


def test_without_a_breaker_every_row_spends_its_attempts(clean, engine, db, provider, deliverer):
    charge_handler(provider, breaker_=None, max_attempts=2)
    rows = write_rows(engine, 6)
    provider.unavailable()
    for _ in range(2):
        for r in rows:
            deliverer.deliver(r, DEST)
        db.execute("UPDATE outbox_message SET available_at = now() WHERE state = 'pending'")
    assert {get(db, r)["state"] for r in rows} == {"failed"}
    assert provider.stats()["requests"] == 12
    assert row_of(db) == {}


def test_the_reconciler_leaves_an_open_breakers_rows_alone_requeues_one_probe_then_all(
    clean, engine, db, provider, redis_client
):
    charge_handler(provider)
    rows = write_rows(engine, 10)
    open_breaker(engine, for_seconds=3600)
    assert relay_once(clean) == 10
    deliverer = Deliverer(clean.database_url, registry())
    try:
        assert {deliverer.deliver(r, DEST) for r in rows} == {DeliveryResult.PAUSED}
        redis_client.delete(f"{clean.namespace}:{DEST}", f"{clean.namespace}:{DEST}.msgs")  # as if acked
        db.execute("UPDATE outbox_message SET dispatched_at = dispatched_at - interval '1 hour'")
        kwargs: dict[str, Any] = dict(namespace=clean.namespace, redispatch_after_seconds=300)
        assert redispatch(db, redis_client, registry(), **kwargs) == {}, "open: left alone"

        half_open(db)
        assert redispatch(db, redis_client, registry(), **kwargs) == {"probe": 1}
        [probe_row] = [r for r in rows if get(db, r)["state"] == "pending"]
        assert probe_row == rows[0], "the oldest waits longest"
        assert deliverer.deliver(probe_row, DEST) is DeliveryResult.SENT
        assert row_of(db)["breaker_opened_at"] is None

        assert redispatch(db, redis_client, registry(), **kwargs) == {"missing": 9}
        for r in rows[1:]:
            assert deliverer.deliver(r, DEST) is DeliveryResult.SENT
    finally:
        deliverer.close()
    assert provider.charges() == 10 and provider.stats()["requests"] == 10


def test_resume_closes_an_open_breaker_and_status_doctor_and_the_metrics_show_it(
    clean, engine, db, provider, capsys
):
    charge_handler(provider)
    open_breaker(engine, for_seconds=3600, reason="HTTP 503 from 127.0.0.1")

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", clean.database_url])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = cli("status")
    assert f"breaker open: {DEST} since" in out and "HTTP 503" in out, out
    code, out, _ = cli("status", "--json")
    [shown] = json.loads(out)["breakers"]
    assert shown["destination"] == DEST and shown["half_open"] is False
    code, out, _ = cli("doctor", "--json", "--redis-url", clean.redis_url)
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "breakers"]
    assert check["status"] == "WARN" and DEST in check["detail"]

    reading = metrics.read_database(db)
    reading.destinations = [DEST]
    metrics.DATABASE.update(reading, fresh_for_seconds=60)
    try:
        sample = metrics.REGISTRY.get_sample_value("outbox_destination_breaker_open", {"destination": DEST})
        assert sample == 1.0
    finally:
        metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)

    code, out, err = cli("resume", DEST)
    assert code == 0 and f"closed the breaker of {DEST}" in out, (out, err)
    assert row_of(db)["breaker_opened_at"] is None
    code, out, err = cli("resume", DEST)
    assert code == 1 and "not paused and its breaker is not open" in err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures": 0}, "failures must be a whole number >= 1"),
        ({"failures": 2.5}, "failures must be a whole number >= 1"),
        ({"window_seconds": 0}, "window_seconds must be a finite number of seconds > 0"),
        ({"open_seconds": -1}, "open_seconds must be a finite number of seconds > 0"),
        ({"open_seconds": float("inf")}, "open_seconds must be a finite number of seconds > 0"),
        ({"open_seconds": 60, "max_open_seconds": 30}, "max_open_seconds (30) must be >= open_seconds"),
    ],
)
def test_a_bad_breaker_is_refused_at_declaration(kwargs, message):
    name = f"bad.breaker{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigError, match=r"breaker") as caught:
        outbox.handler(name, breaker=outbox.Breaker(**kwargs))
    assert message in str(caught.value) and f"{name}: breaker" in str(caught.value)


def test_a_row_carries_at_most_max_attempts_uncounted_probes_then_fails(
    clean, engine, db, provider, deliverer
):
    """(attack on part 3, F1) A provider that never takes the request again: the row that
    tripped the breaker is its only probe. Its first max_attempts probes are not counted; the
    next ones are, and the row ends `failed` instead of being called for ever."""
    charge_handler(provider, max_attempts=4)
    [row] = write_rows(engine, 1)
    provider.unavailable()
    for _ in range(40):
        if get(db, row)["state"] not in ("pending", "dispatched"):
            break
        assert deliverer.deliver(row, DEST) in (
            DeliveryResult.PENDING,
            DeliveryResult.PAUSED,
            DeliveryResult.FAILED,
        )
        half_open(db)
    moved = get(db, row)
    assert moved["state"] == "failed" and "gave up after 4 attempts" in moved["last_error"], moved
    # 3 calls trip the breaker (attempts 1-3), 4 probes are not counted, the 5th is attempt 4.
    assert provider.stats()["requests"] == 3 + 4 + 1


def test_a_probe_refused_by_the_handler_itself_does_not_close_the_breaker(
    clean, engine, db, provider, deliverer
):
    """(attack on part 3, F2) A handler that refuses a row before any request proves nothing
    about the provider: the breaker stays open, the waiting rows are not called."""

    @outbox.handler(DEST, time_limit=5, max_attempts=5, backoff=(0.01,), breaker=SMALL)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        if d.payload["amount_cents"] == 1000:
            raise outbox.PermanentError("refused before any request")
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    rows = write_rows(engine, 3)  # rows[0] is refused locally
    open_breaker(engine)
    provider.unavailable()
    assert deliverer.deliver(rows[0], DEST) is DeliveryResult.FAILED
    assert row_of(db)["breaker_opened_at"] is not None, "no answer, no verdict"
    assert [deliverer.deliver(r, DEST) for r in rows[1:]] == [DeliveryResult.PAUSED] * 2
    assert provider.stats()["requests"] == 0


def test_doctor_does_not_fail_the_rows_a_breaker_holds_back(clean, engine, db, provider, capsys):
    """(user review) Rows waiting `dispatched` behind an open breaker wait by design: the
    `dispatched` check leaves them to the `breakers` check instead of failing doctor."""
    charge_handler(provider)
    write_rows(engine, 2)
    db.execute("UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() - interval '2 hours'")
    open_breaker(engine, for_seconds=60, open_seconds=10)
    main(["doctor", "--json", "--database-url", clean.database_url, "--redis-url", clean.redis_url])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["dispatched"]["ok"] is True, checks["dispatched"]
    assert checks["breakers"]["status"].upper() == "WARN"
