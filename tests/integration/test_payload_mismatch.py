"""Rows whose payload does not fit the handler that takes them (payload_model / upgrades /
payload_version), against real PostgreSQL and the provider simulator on 127.0.0.1: a payload that
no longer fits after an ambiguous call, rows newer than their handler, a writer's default version,
lookups of rows whose payload no longer fits, payloads that are not JSON objects (plain SQL
writers), and the same (key, step) written again at another version. Comments headed
"Unguarded" say what happened before the rule each test checks."""

from __future__ import annotations

from typing import Any, ClassVar

import psycopg
import pytest
from helpers import elapse, lookup_on, sql
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

import outbox
from outbox import handlers as _handlers
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.ops.payload_check import check_payloads
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import libpq_url
from outbox.settlement import LookupClients

DEST = "payments.charge"


class ChargeV1(BaseModel):
    """Release N: amount in euros."""

    model_config = ConfigDict(extra="forbid")
    amount_eur: int


class ChargeV2(BaseModel):
    """Release N+1: amount in cents, and a required currency."""

    model_config = ConfigDict(extra="forbid")
    payload_version: ClassVar[int] = 2
    amount_cents: int
    currency: str


def v1_to_v2(p: dict[str, Any]) -> dict[str, Any]:
    return {"amount_cents": p.pop("amount_eur") * 100, "currency": "EUR"}


def declare(provider: Any, seen: list[dict[str, Any]] | None = None, **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 3, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        if seen is not None:
            seen.append(dict(d.payload))
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return charge


def redeploy() -> None:
    """A new release of the workers: the handler module is imported afresh."""
    _handlers.clear_registry()


def write(engine: Any, key: str, payload: dict[str, Any], **kw: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=DEST, payload=payload, **kw).id


def row(services: Any, row_id: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
        names = [c.name for c in cur.description]
        return dict(zip(names, cur.fetchone(), strict=True))


# == 1. invalid payload after an ambiguous, possibly effective call ===============================


def test_invalid_after_ambiguous_call_goes_unknown_and_the_lookup_settles_it(
    clean, engine, provider, consumer, db
):
    """Attempt 1 (release N, idempotent destination) charged and the answer was lost: the row
    is retried (pending). Release N+1 tightens the model so the stored payload no longer fits.
    Attempt 2 now (the author's concurrent fix) goes `unknown`, "the lookup decides" -- but the
    reconciler validates the payload before every lookup, so the lookup never runs: each run
    writes "lookup failed: payload ... does not match", defers it, and the charge the provider
    holds (which the lookup would find) is never recorded `sent`."""
    declare(provider, idempotent=True)
    row_id = write(engine, "order:1", {"amount_eur": 12})
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.PENDING
    assert provider.charges("order:1:charge") == 1

    redeploy()
    failed_for: list[str] = []
    lookups: list[int] = []
    charge = declare(provider, idempotent=True, payload_model=ChargeV2)  # no upgrade for v1
    lookup_on(charge, provider, calls=lookups)

    @charge.on_failure
    def refund(d: outbox.Delivery, error: str) -> list[outbox.Next]:
        failed_for.append(error)
        return [outbox.Next("tell_customer", "mail.notify", {"order": d.key})]

    elapse(clean, 3600, [row_id])
    assert consumer().deliver(row_id, DEST) is DeliveryResult.UNKNOWN  # held: not `failed`
    assert provider.charges("order:1:charge") == 1
    assert sql(clean, "SELECT step FROM outbox_message WHERE parent_id = %s", (row_id,)) == []

    clients = LookupClients()
    try:
        for _ in range(4):
            elapse(db, 7200)
            resolve_unknown(db, registry(), clients=clients)
    finally:
        clients.close()
    r = row(clean, row_id)
    # (First run of this test, before the author's concurrent fix to resolve_unknown, it stayed
    # `unknown` with "lookup failed: payload ... does not match ChargeV2", the lookup never called.)
    assert lookups == [row_id]
    assert (r["state"], provider.charges("order:1:charge")) == ("sent", 1), r


def test_deadline_after_ambiguous_call_goes_unknown(clean, engine, provider, consumer):
    """The reference the invalid branch should follow: same history, deadline passed instead."""
    declare(provider, idempotent=True)
    from datetime import UTC, datetime, timedelta

    row_id = write(engine, "order:2", {"amount_eur": 12}, deadline=datetime.now(UTC) + timedelta(minutes=30))
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.PENDING
    elapse(clean, 3600, [row_id])
    assert consumer().deliver(row_id, DEST) is DeliveryResult.UNKNOWN
    assert row(clean, row_id)["state"] == "unknown"


# == 2. a row newer than a handler that declares no model =========================================


def test_a_row_newer_than_a_handler_without_model_waits_for_a_newer_worker(clean, engine, provider, consumer):
    """Writers of release N+1 (payload version 2: cents) deployed before the workers; release N's
    handler of the destination declares no payload_model and no upgrades, i.e. version 1. The
    row is newer than it knows, so it waits for a newer worker rather than being called with a
    payload shape the old handler code does not understand."""
    seen: list[dict[str, Any]] = []
    declare(provider, seen)  # release N: no model, no upgrades -> version 1
    assert registry()[DEST].payload_version == 1
    row_id = write(engine, "order:3", {"amount_cents": 1200, "currency": "EUR"}, payload_version=2)
    assert row(clean, row_id)["payload_version"] == 2
    result = consumer().deliver(row_id, DEST)
    # Unguarded: SENT, provider.charges("order:3:charge") == 1, the v1 code saw the v2 payload.
    assert (result, provider.charges(), seen) == (DeliveryResult.RELEASED, 0, [])


def test_doctor_payloads_names_rows_newer_than_a_handler_without_model(clean, engine, provider):
    """The pre-rollout check is blind to the same rows: a handler without model/upgrades is not
    read at all, so rows at version 2 for a version-1 handler pass."""
    declare(provider)
    write(engine, "order:4", {"amount_cents": 1200, "currency": "EUR"}, payload_version=2)
    with engine.connect() as conn:
        report = check_payloads(conn, registry())
    # Unguarded: incompatible == [], unchecked == [DEST]: exit 0 ("fit the handlers").
    assert [r.key for r in report.incompatible] == ["order:4"], report


# == 3. writer's default version depends on what the writing process imported =====================


def test_the_default_version_depends_on_imports_unless_the_writer_says_it(clean, engine, provider, consumer):
    """A writer that does not import the handler module stores version 1 by
    default, and the worker runs upgrade 1->2 on a payload already in the v2 shape (here an
    upgrade that rescales would charge 1200 EUR for 12). The rule (docs/payloads.md): a writer
    that does not import the handlers passes ``payload_version``; then both agree."""

    def euros_to_cents(p: dict[str, Any]) -> dict[str, Any]:
        amount = p.get("amount_eur", p.get("amount_cents"))
        return {"amount_cents": amount * 100, "currency": p.get("currency", "EUR")}

    seen: list[dict[str, Any]] = []
    declare(provider, seen, payload_model=ChargeV2, upgrades={1: euros_to_cents})
    v2_shape = {"amount_cents": 1200, "currency": "EUR"}
    a = write(engine, "order:5", v2_shape)  # the worker's module is imported here: version 2
    redeploy()  # a writer process that does not import the handlers
    b = write(engine, "order:6", v2_shape, payload_version=2)
    unsaid = write(engine, "order:7", v2_shape)
    assert [row(clean, i)["payload_version"] for i in (a, b, unsaid)] == [2, 2, 1]

    declare(provider, seen, payload_model=ChargeV2, upgrades={1: euros_to_cents})
    assert consumer().deliver(a, DEST) is DeliveryResult.SENT
    assert consumer().deliver(b, DEST) is DeliveryResult.SENT
    assert [p["amount_cents"] for p in seen] == [1200, 1200]


# == 4. the reconciler's lookup of an `unknown` row whose payload no longer fits ==================


def test_an_unknown_row_with_now_invalid_payload_is_looked_up(clean, engine, provider, consumer, db):
    """A non-idempotent charge went `unknown` under release N (the provider charged it). Release
    N+1's model does not accept its payload. The lookup only needs the idempotency key: it gets
    the payload as stored and finds the charge. (A reconciler that validated first would see:
    every run a failed lookup, forever, and three such rows first in line deferring the
    destination's healthy rows.)"""
    declare(provider)
    stuck = [write(engine, f"order:{n}", {"amount_eur": n}) for n in (10, 11, 12)]
    # Release N knows version 1 only: the healthy row's shape is one ChargeV2 accepts as it is.
    healthy = write(engine, "order:13", {"amount_cents": 1300, "currency": "EUR"})
    provider.drop_after_charge()
    for row_id in stuck:
        assert consumer().deliver(row_id, DEST) is DeliveryResult.UNKNOWN
    assert consumer().deliver(healthy, DEST) is DeliveryResult.UNKNOWN
    provider.healthy()
    assert provider.charges() == 4

    redeploy()
    lookup_on(declare(provider, payload_model=ChargeV2), provider)  # no upgrade for v1 payloads
    clients = LookupClients()
    try:
        for _ in range(3):
            elapse(db, 7200)
            resolve_unknown(db, registry(), clients=clients)
    finally:
        clients.close()
    states = {i: row(clean, i)["state"] for i in [*stuck, healthy]}
    errors = {i: row(clean, i)["last_error"] for i in stuck}
    # Before the author's concurrent fix: all four stayed `unknown` (three "lookup failed", the
    # healthy one deferred behind them).
    assert set(states.values()) == {"sent"}, (states, errors)


# == 5. a payload that is not a JSON object (plain SQL writers) ===================================


def _insert_raw(services: Any, key: str, payload_json: str, version: int = 1) -> int:
    return sql(
        services,
        "INSERT INTO outbox_message (key, step, destination, payload, payload_version) "
        "VALUES (%s, 'charge', %s, CAST(%s AS jsonb), %s) RETURNING id",
        (key, DEST, payload_json, version),
    )[0][0]


def test_a_non_object_payload_fails_without_a_call(clean, provider, consumer, db):
    """A row written by plain SQL (the contract invites writers in any language) with a JSON
    array as payload: PayloadInvalid -> `failed`, no call (certain, actionable). Unguarded:
    `prepare` does dict(payload) outside its try, the TypeError escapes `deliver`, the
    row stays `in_flight` with an attempt row without outcome (an ambiguous "call" that never
    happened); the lease expires -> `unknown`; the lookup (strict=False still runs prepare)
    raises the same TypeError every run -> `unknown` forever, and a replay would need --force."""
    lookups: list[int] = []
    lookup_on(declare(provider, payload_model=ChargeV2), provider, calls=lookups)
    row_id = _insert_raw(clean, "order:20", "[1, 2]")
    sql(
        clean,
        "UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() WHERE id = %s",
        (row_id,),
    )
    try:
        result: Any = consumer().deliver(row_id, DEST)
    except Exception as exc:
        result = exc
    observed = {"result": result, "state": row(clean, row_id)["state"]}
    elapse(db, 3600, [row_id])
    expire_leases(db, registry())
    clients = LookupClients()
    try:
        for _ in range(3):
            elapse(db, 7200)
            resolve_unknown(db, registry(), clients=clients)
    finally:
        clients.close()
    r = row(clean, row_id)
    observed.update(final=r["state"], error=r["last_error"], lookups=lookups)
    assert provider.charges() == 0
    assert (result, r["state"]) == (DeliveryResult.FAILED, "failed"), observed


def test_doctor_payloads_names_a_non_object_payload(clean, engine, provider):
    declare(provider, payload_model=ChargeV2)
    _insert_raw(clean, "order:21", '"just a string"')
    # Unguarded: ValueError ("dictionary update sequence element #0 has length 1; 2 is
    # required") escapes check_payloads, so `doctor --payloads` dies with a traceback instead of
    # naming the row.
    with engine.connect() as conn:
        report = check_payloads(conn, registry())
    assert [r.key for r in report.incompatible] == ["order:21"]


# == 6. too-new rows ==============================================================================


def test_a_too_new_row_is_released_no_attempt_spent(clean, engine, provider, consumer):
    declare(provider, payload_model=ChargeV2, upgrades={1: v1_to_v2})
    row_id = write(engine, "order:30", {"x": 1}, payload_version=3)
    for _ in range(5):
        elapse(clean, 60, [row_id])
        sql(clean, "UPDATE outbox_message SET state='dispatched', dispatched_at=now() WHERE id=%s", (row_id,))
        assert consumer().deliver(row_id, DEST) is DeliveryResult.RELEASED
    r = row(clean, row_id)
    assert (r["state"], r["attempts"], r["releases"]) == ("pending", 0, 5)
    assert provider.charges() == 0


def test_an_upgrade_mutating_its_input_does_not_touch_the_stored_row(clean, engine, provider, consumer):
    seen: list[dict[str, Any]] = []
    declare(provider, seen, payload_model=ChargeV2, upgrades={1: v1_to_v2})  # v1_to_v2 pops
    row_id = write(engine, "order:31", {"amount_eur": 7}, payload_version=1)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.SENT
    assert row(clean, row_id)["payload"] == {"amount_eur": 7}
    assert seen == [{"amount_cents": 700, "currency": "EUR"}]


def test_version_zero_is_refused_by_the_check(clean):
    with pytest.raises(psycopg.errors.CheckViolation):
        _insert_raw(clean, "order:32", "{}", version=0)


def test_write_refuses_a_bool_version(clean, engine, provider):
    declare(provider, payload_model=ChargeV2)
    with Session(engine) as s, s.begin(), pytest.raises(outbox.InvalidMessage):
        outbox.write(s, key="k", step="charge", destination=DEST, payload={}, payload_version=True)


def test_write_validate_refuses_an_invalid_payload(clean, engine, provider):
    declare(provider, payload_model=ChargeV2)
    with Session(engine) as s, s.begin(), pytest.raises(outbox.InvalidMessage):
        outbox.write(
            s, key="k", step="charge", destination=DEST, payload={"amount_cents": "x"}, validate=True
        )


def test_the_same_payload_rewritten_at_another_version_is_a_key_conflict(clean, engine, provider):
    """(key, step) written by release N at version 1 ({"amount": 12}: euros); the request is
    retried by release N+1's writer at version 2, where {"amount": 12} means cents. Different
    operations: `write` answers KeyConflict. Unguarded, it answered created=False and the row kept
    version 1: the caller of release N+1 believed its 12-cent operation stored."""
    with Session(engine) as s, s.begin():
        first = outbox.write(
            s, key="order:40", step="charge", destination=DEST, payload={"amount": 12}, payload_version=1
        )
    with Session(engine) as s, s.begin():
        try:
            again: Any = outbox.write(
                s, key="order:40", step="charge", destination=DEST, payload={"amount": 12}, payload_version=2
            )
        except outbox.KeyConflict as exc:
            again = exc
    stored = row(clean, first.id)["payload_version"]
    assert isinstance(again, outbox.KeyConflict), (again, stored)


def test_older_reconciler_looks_up_too_new_unknown_rows(clean, engine, provider, consumer, db):
    """A newer worker (payload v3) made ambiguous calls; the reconciler still runs the previous
    release (v2). Its lookups name the calls by their keys and get the payloads as stored: every
    row is found and settled sent, each charged once (unguarded: "lookup failed" for the
    newer rows, and the destination's other rows deferred)."""
    redeploy()

    class ChargeV3(ChargeV2):
        payload_version: ClassVar[int] = 3

    lookup_on(declare(provider, payload_model=ChargeV3, upgrades={1: v1_to_v2}), provider)
    new = [write(engine, f"order:{n}", {"amount_cents": n, "currency": "EUR"}) for n in (50, 51, 52)]
    old = write(engine, "order:53", {"amount_cents": 53, "currency": "EUR"}, payload_version=2)
    provider.drop_after_charge()
    for i in [*new, old]:
        assert consumer().deliver(i, DEST) is DeliveryResult.UNKNOWN
    provider.healthy()
    redeploy()
    lookup_on(declare(provider, payload_model=ChargeV2, upgrades={1: v1_to_v2}), provider)
    clients = LookupClients()
    try:
        elapse(db, 7200)
        resolve_unknown(db, registry(), clients=clients)
    finally:
        clients.close()
    assert {i: row(clean, i)["state"] for i in [*new, old]} == {i: "sent" for i in [*new, old]}
    assert provider.charges() == 4
