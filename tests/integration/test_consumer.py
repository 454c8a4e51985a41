"""The consumer run against real PostgreSQL and a real provider on 127.0.0.1: every outcome
class lands in the state the contract names, and a second run of a message is empty."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
import redis
from helpers import elapse, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import ops, store, transport
from outbox.cli.render import render
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.settings import libpq_url


def charge_handler(provider, **options: Any):
    @outbox.handler("payments.charge", **{"time_limit": 2, "backoff": (1, 5), **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return charge


def write_rows(engine, n: int = 1, **kw: Any) -> list[int]:
    ids = []
    with Session(engine) as s, s.begin():
        for i in range(n):
            w = outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination=kw.pop("destination", "payments.charge"),
                payload=kw.pop("payload", {"amount_cents": 1000, "currency": "EUR"}),
                **kw,
            )
            ids.append(w.id)
    return ids


def row(services, row_id: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
        names = [c.name for c in cur.description]
        return dict(zip(names, cur.fetchone(), strict=True))


def attempts(services, row_id: int) -> list[tuple]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        return conn.execute(
            "SELECT attempt, outcome, http_status, error FROM outbox_attempt "
            "WHERE message_id = %s ORDER BY id",
            (row_id,),
        ).fetchall()


@pytest.fixture
def consumer(clean):
    consumers: list[Deliverer] = []

    def make() -> Deliverer:
        c = Deliverer(clean.database_url, registry())
        consumers.append(c)
        return c

    yield make
    for c in consumers:
        c.close()
    outbox.handlers.close_http_clients()


def test_confirmed_call_is_sent_and_second_run_is_empty(clean, engine, provider, consumer):
    charge_handler(provider)
    (row_id,) = write_rows(engine)
    c = consumer()
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.SENT
    r = row(clean, row_id)
    assert r["state"] == "sent" and r["provider_ref"].startswith("ch_")
    assert r["response"]["id"] == r["provider_ref"] and r["completed_at"] is not None
    assert r["attempts"] == 1 and r["lease_expires_at"] is None
    # The duplicate delivery of the same message: nothing claimed, nothing charged.
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.EMPTY
    assert provider.stats()["effects"] == {"order:0:charge": 1}
    assert attempts(clean, row_id) == [(1, "sent", None, None)]


def test_not_processed_retries_with_backoff_then_fails(clean, engine, provider, consumer):
    charge_handler(provider, max_attempts=2)
    (row_id,) = write_rows(engine)
    provider.configure(fail_before_rate=1.0)
    c = consumer()
    before = datetime.now(UTC)
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.PENDING
    r = row(clean, row_id)
    assert r["state"] == "pending" and r["attempts"] == 1 and "503" in r["last_error"]
    assert r["available_at"] >= before + timedelta(seconds=0.9)
    # Not due yet: a stale message finds nothing to claim.
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.EMPTY
    elapse(clean, 1, [row_id])  # its first backoff
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    r = row(clean, row_id)
    assert r["state"] == "failed" and "gave up after 2 attempts" in r["last_error"]
    assert provider.stats()["charges"] == 0


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("fail_after", "HTTP 500"),
        ("drop_after", "connection broke"),
        ("garbage", "not valid JSON"),
        ("hang_after", "no answer within the time limit"),
    ],
)
def test_ambiguous_answers_wait_in_unknown(clean, engine, provider, consumer, fault, reason):
    charge_handler(provider, time_limit=1)
    provider.configure(fault_keys={"order:0:charge": fault}, hang_seconds=3)
    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.UNKNOWN
    r = row(clean, row_id)
    assert r["state"] == "unknown" and reason in r["last_error"]
    assert r["unknown_since"] is not None and r["provider_ref"] is None
    assert provider.stats()["effects"] == {"order:0:charge": 1}


def test_idempotent_destination_retries_ambiguous_answers(clean, engine, provider, consumer):
    provider.configure(dedupe=True, fault_keys={"order:0:charge": "drop_after"})
    charge_handler(provider, idempotent=True)
    (row_id,) = write_rows(engine)
    c = consumer()
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.PENDING
    elapse(clean, 1, [row_id])  # its first backoff
    assert c.deliver(row_id, "payments.charge") is DeliveryResult.SENT
    stats = provider.stats()
    assert stats["effects"] == {"order:0:charge": 1} and stats["deduplicated"] == 1


def test_permanent_error_fails_with_reason(clean, engine, provider, consumer):
    charge_handler(provider)
    (row_id,) = write_rows(engine, payload={"amount_cents": -1})
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    r = row(clean, row_id)
    # The handler's PermanentError does not say which status it saw: the one the provider
    # answered through d.http is kept, on the attempt row and in the reason.
    assert r["state"] == "failed" and r["last_error"] == "card declined (HTTP 402)"
    assert attempts(clean, row_id) == [(1, "failed", 402, "card declined (HTTP 402)")]
    assert provider.stats()["charges"] == 0 and provider.stats()["declined"] == 1
    with engine.connect() as conn:
        detail = ops.show(conn, row_id)
    assert isinstance(detail, ops.RowDetail) and detail.attempts[0]["http_status"] == 402
    assert " 402 " in render(detail)


def test_permanent_error_raised_from_a_status_error_keeps_its_status(clean, engine, provider, consumer):
    @outbox.handler("payments.charge", time_limit=2, backoff=(1, 5))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        try:
            r.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise outbox.PermanentError("refused") from exc
        return outbox.Confirmed(ref=r.json()["id"])

    (row_id,) = write_rows(engine, payload={"amount_cents": -1})
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    assert attempts(clean, row_id) == [(1, "failed", 402, "refused (HTTP 402)")]


@pytest.mark.parametrize("answered", [False, True], ids=["no-call", "after-a-2xx"])
def test_permanent_error_without_a_4xx_answer_has_no_status(clean, engine, provider, consumer, answered):
    @outbox.handler("payments.charge", time_limit=2, backoff=(1, 5))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        if answered:
            d.http.get(f"{provider.url}/_stats").raise_for_status()
        raise outbox.PermanentError("currency not supported")

    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    assert attempts(clean, row_id) == [(1, "failed", None, "currency not supported")]


def test_a_status_seen_in_one_call_is_not_kept_by_the_next(clean, engine, provider, consumer):
    """The status is the current call's: a decline followed by a call that raises before any
    request keeps none."""
    charge_handler(provider)
    declined, plain = write_rows(engine, 2, payload={"amount_cents": -1})
    c = consumer()
    assert c.deliver(declined, "payments.charge") is DeliveryResult.FAILED
    outbox.handlers.clear_registry()

    @outbox.handler("payments.charge", time_limit=2, backoff=(1, 5))
    def refuse(d: outbox.Delivery) -> outbox.Confirmed:
        raise outbox.PermanentError("refused before calling")

    c.handlers["payments.charge"] = refuse
    assert c.deliver(plain, "payments.charge") is DeliveryResult.FAILED
    assert attempts(clean, plain) == [(1, "failed", None, "refused before calling")]


def test_connect_error_is_retried(clean, engine, consumer):
    class Nowhere:
        url = "http://127.0.0.1:9"  # discard port: nothing listens

    charge_handler(Nowhere)
    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.PENDING
    assert "did not reach the provider" in row(clean, row_id)["last_error"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("raise", "handler raised ZeroDivisionError"),
        ("none", "handler returned NoneType"),
        ("dict", "handler returned dict"),
    ],
)
def test_handler_bugs_end_in_unknown_with_reason(clean, engine, consumer, body, expected):
    @outbox.handler("payments.charge", time_limit=2)
    def buggy(d):
        if body == "raise":
            return 1 / 0
        return None if body == "none" else {"id": "ch_1"}

    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.UNKNOWN
    r = row(clean, row_id)
    assert r["state"] == "unknown" and expected in r["last_error"]


def test_deadline_passed_fails_without_calling(clean, engine, provider, consumer):
    charge_handler(provider)
    (row_id,) = write_rows(engine, deadline=datetime.now(UTC) + timedelta(milliseconds=50))
    time.sleep(0.1)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    assert row(clean, row_id)["last_error"] == "deadline passed before the call"
    assert provider.stats()["requests"] == 0


def test_message_for_unknown_destination_fails(clean, engine, provider, consumer):
    charge_handler(provider)
    (row_id,) = write_rows(engine, destination="mail.send")
    assert consumer().deliver(row_id, "mail.send") is DeliveryResult.UNHANDLED
    r = row(clean, row_id)
    assert r["state"] == "failed" and "no handler for destination 'mail.send'" in r["last_error"]


def test_message_on_wrong_queue_claims_nothing(clean, engine, provider, consumer):
    charge_handler(provider)

    @outbox.handler("mail.send", time_limit=2)
    def send(d):  # pragma: no cover - must not be called
        raise AssertionError("called for a row of another destination")

    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "mail.send") is DeliveryResult.EMPTY
    assert row(clean, row_id)["state"] == "pending"


def test_late_record_after_takeover_changes_nothing(clean, engine, provider):
    charge_handler(provider)
    (row_id,) = write_rows(engine)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        first = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=30)
        assert first is not None
        # The lease was taken over: it ran out, the reconciler expired it, an operator settled
        # it as not sent, and a new claim owns the row.
        elapse(conn, 31, [row_id])
        assert expire_leases(conn, registry()) == 1
        with engine.begin() as tx:
            assert ops.resolve(tx, row_id, not_sent=True, by="test", reason="not at the provider").done
        second = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=30)
        assert second is not None and second.token != first.token
        before = row(clean, row_id)
        moved = store.delivery.record(
            conn, row_id=row_id, token=first.token, state="sent", outcome="sent", ref="ch_late"
        ).state
        assert moved is None  # a newer claim owns the row
        assert row(clean, row_id) == before
        outcomes = conn.execute(
            "SELECT claim_token, outcome FROM outbox_attempt WHERE message_id = %s ORDER BY id",
            (row_id,),
        ).fetchall()
    assert outcomes == [(first.token, "superseded:sent"), (second.token, None)]


def test_concurrent_duplicate_deliveries_call_once(clean, engine, provider, consumer):
    provider.configure(latency_ms=200)
    charge_handler(provider)
    (row_id,) = write_rows(engine)
    c = consumer()
    results: list[DeliveryResult] = []
    threads = [
        threading.Thread(target=lambda: results.append(c.deliver(row_id, "payments.charge")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == sorted([DeliveryResult.SENT] + [DeliveryResult.EMPTY] * 3)
    assert provider.stats()["effects"] == {"order:0:charge": 1}


def test_worker_drops_malformed_messages_and_keeps_working(clean, engine, provider):
    """A message we did not write is logged and dropped; the worker goes on with the next ones.

    Dramatiq restarts its consumer after an undecodable message, which forgets the messages
    fetched in the same round trip: those rows are re-published by the reconciler's
    redispatch, so here the valid row is relayed after the garbage was consumed."""
    charge_handler(provider)
    (row_id,) = write_rows(engine)
    client = redis.Redis.from_url(clean.redis_url)
    key = transport.queue_key(clean.namespace, "payments.charge")
    bad = {
        "queue_name": "payments.charge",
        "actor_name": transport.ACTOR_NAME,
        "args": ["not-an-id"],
        "kwargs": {},
        "options": {"redis_message_id": "bad-1"},
        "message_id": "bad-1",
        "message_timestamp": 0,
    }
    client.hset(f"{key}.msgs", "bad-1", json.dumps(bad))
    client.hset(f"{key}.msgs", "bad-2", b"\xff not json at all")
    client.rpush(key, "bad-1", "bad-2")
    try:
        with worker_thread(clean, threads=2) as t:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and client.llen(key):
                time.sleep(0.05)
            assert client.llen(key) == 0, "the worker did not consume the malformed messages"
            time.sleep(1.5)  # Dramatiq restarts a consumer one second after an undecodable message
            from outbox.relay import Relay

            relay = Relay(
                database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace
            )
            relay.drain()
            relay.close()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and row(clean, row_id)["state"] != "sent":
                time.sleep(0.1)
    finally:
        client.close()
    assert t.is_alive() is False
    assert row(clean, row_id)["state"] == "sent"
    assert provider.stats()["charges"] == 1


def test_classify_override_cannot_claim_sent_and_bad_answers_fall_back(clean, engine, consumer):
    answers = iter(["sent", RuntimeError("classifier bug"), "retry"])

    def classify(exc: BaseException) -> str | None:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @outbox.handler("payments.charge", time_limit=2, backoff=(1,), classify=classify)
    def flaky(d):
        raise KeyError("missing field")

    rows = []
    with Session(engine) as s, s.begin():
        for i in range(3):
            rows.append(
                outbox.write(s, key=f"order:{i}", step="charge", destination="payments.charge", payload={}).id
            )
    c = consumer()
    # "sent" is not a classification (only a Confirmed carries a reference): default applies.
    assert c.deliver(rows[0], "payments.charge") is DeliveryResult.UNKNOWN
    # A classifier that raises: default applies too.
    assert c.deliver(rows[1], "payments.charge") is DeliveryResult.UNKNOWN
    assert c.deliver(rows[2], "payments.charge") is DeliveryResult.PENDING


def test_unstorable_response_still_records_sent(clean, engine, consumer):
    @outbox.handler("payments.charge", time_limit=2)
    def odd(d):
        return outbox.Confirmed(ref="ch_9", response={"at": datetime(2026, 1, 2, tzinfo=UTC)})

    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.SENT
    r = row(clean, row_id)
    # Stored by outbox.sanitize's rules: a datetime becomes its ISO 8601 text.
    assert r["provider_ref"] == "ch_9" and r["response"] == {"at": "2026-01-02T00:00:00+00:00"}


def test_worker_interrupts_a_handler_past_its_time_limit(clean, engine):
    @outbox.handler("payments.charge", time_limit=1, lease_seconds=30)
    def spins(d):
        while True:  # pure Python: Dramatiq's timer can interrupt it
            pass

    (row_id,) = write_rows(engine)
    from outbox.relay import Relay

    relay = Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace)
    relay.drain()
    relay.close()
    started = time.monotonic()
    with worker_thread(clean, threads=1):
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and row(clean, row_id)["state"] != "unknown":
            time.sleep(0.1)
        elapsed = time.monotonic() - started
    r = row(clean, row_id)
    assert r["state"] == "unknown" and "time limit" in r["last_error"]
    # Interrupted at its own time_limit, well before the 30 s lease.
    assert elapsed < 10


def test_cancel_only_before_any_claim(clean, engine, provider, consumer):
    charge_handler(provider, max_attempts=3)
    provider.configure(fail_before_rate=1.0)
    (row_id,) = write_rows(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.PENDING
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:0", step="charge") is False
    assert row(clean, row_id)["state"] == "pending"

    # A replay resets attempts to 0, but the row was claimed before: still not cancellable.
    for _ in range(2):
        elapse(clean, 5, [row_id])  # the longest backoff
        consumer().deliver(row_id, "payments.charge")
    assert row(clean, row_id)["state"] == "failed"
    with Session(engine) as s, s.begin():
        assert ops.replay(s.connection(), [row_id], by="test", reason="card updated")[0].done
    assert row(clean, row_id)["state"] == "pending" and row(clean, row_id)["attempts"] == 0
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:0", step="charge") is False
    assert row(clean, row_id)["state"] == "pending"
