"""Chains (issue 14): a step's declared next steps are written by the statement that settles it
`sent` (the worker's record, the reconciler's lookup, an operator's resolve), against real
PostgreSQL and the provider simulator on 127.0.0.1; compensation only for a certain failure."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import lookup_on, sql
from sqlalchemy.orm import Session

import outbox
from outbox import chains, ops
from outbox.alerts import AlertRow
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.reconciler.jobs.chains import write_uncomputed
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.reconciler.jobs.send_alerts import send_alerts
from outbox.settings import libpq_url
from outbox.settlement import LookupClients
from outbox.testing import clock

KEY = "invoice:7"


def declare(provider: Any, destination: str, **options: Any) -> outbox.Handler:
    @outbox.handler(destination, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def call(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return call


def invoice_chain(provider: Any, **options: Any) -> outbox.Handler:
    """charge -> export (to accounting, with the charge's reference) -> notify."""
    charge = declare(provider, "payments.charge", **options)
    export = declare(provider, "accounting.export")
    declare(provider, "mail.notify")

    @charge.then
    def after_charge(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [
            outbox.Next("export", "accounting.export", {"invoice": d.payload["invoice"], "charge": c.ref})
        ]

    @export.then
    def after_export(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("notify", "mail.notify", {"invoice": d.payload["invoice"]})]

    return charge


def write_charge(engine: Any, payload: dict[str, Any] | None = None) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=KEY,
            step="charge",
            destination="payments.charge",
            payload=payload or {"invoice": 7, "amount_cents": 1200},
        ).id


def steps(services: Any) -> dict[str, dict[str, Any]]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_message WHERE key = %s ORDER BY id", (KEY,))
        names = [c.name for c in cur.description]
        return {r[names.index("step")]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def test_each_confirmed_step_writes_the_next_in_its_record(clean, engine, provider, consumer):
    invoice_chain(provider)
    charge_id = write_charge(engine)
    worker = consumer()
    assert worker.deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    rows = steps(clean)
    assert set(rows) == {"charge", "export"}
    export = rows["export"]
    assert export["state"] == "pending" and export["destination"] == "accounting.export"
    assert export["parent_id"] == charge_id and export["via"] == "then"
    # The function saw the confirmed answer: the provider's reference travels down the chain.
    assert export["payload"] == {"invoice": 7, "charge": rows["charge"]["provider_ref"]}
    assert rows["charge"]["chain_problem"] is None
    # A second delivery of the charge's message claims nothing and writes nothing.
    assert worker.deliver(charge_id, "payments.charge") is DeliveryResult.EMPTY
    assert set(steps(clean)) == {"charge", "export"}

    assert worker.deliver(export["id"], "accounting.export") is DeliveryResult.SENT
    notify = steps(clean)["notify"]
    assert worker.deliver(notify["id"], "mail.notify") is DeliveryResult.SENT
    rows = steps(clean)
    assert [rows[s]["state"] for s in ("charge", "export", "notify")] == ["sent", "sent", "sent"]
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1, f"{KEY}:export": 1, f"{KEY}:notify": 1}


def test_a_retry_writes_nothing_until_the_step_is_confirmed(clean, engine, provider, consumer):
    invoice_chain(provider)
    charge_id = write_charge(engine)
    provider.configure(fault_next=["fail_before"])
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.PENDING
    assert set(steps(clean)) == {"charge"}


def test_a_then_that_raises_never_keeps_the_step_from_sent(clean, engine, provider, consumer):
    charge = declare(provider, "payments.charge")

    @charge.then
    def broken(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        raise KeyError("invoice_number")

    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    rows = steps(clean)
    assert set(rows) == {"charge"} and rows["charge"]["state"] == "sent"
    assert "raised KeyError" in rows["charge"]["chain_problem"]
    seen: list[AlertRow] = []
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert send_alerts(conn, seen.append, unknown_alert_after_seconds=60) == {"alerts": 1}
        assert send_alerts(conn, seen.append, unknown_alert_after_seconds=60) == {}
    assert [(a.id, a.state) for a in seen] == [(charge_id, "chain_broken")]
    assert "next steps were not all written" in seen[0].reason and "KeyError" in seen[0].reason


@pytest.mark.parametrize(
    ("returned", "why"),
    [
        ("not a list", "expected a list of outbox.Next"),
        ([{"step": "export"}], "expected outbox.Next"),
        ([outbox.Next("ex:port", "accounting.export")], "contains ':'"),
        ([outbox.Next("charge", "accounting.export")], "cannot follow itself"),
        ([outbox.Next("export", "bad name!")], "must match"),
        ([outbox.Next("export", "accounting.export", {"at": object()})], "not a JSON value"),
    ],
)
def test_a_then_that_returns_nonsense_is_a_chain_problem(clean, engine, provider, consumer, returned, why):
    charge = declare(provider, "payments.charge")
    charge.then(lambda d, c: returned)
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    rows = steps(clean)
    assert set(rows) == {"charge"} and why in rows["charge"]["chain_problem"]


def test_an_existing_step_is_a_no_op_or_a_flagged_conflict(clean, engine, provider, consumer):
    invoice_chain(provider)
    first, second = write_charge(engine), None
    with Session(engine) as s, s.begin():
        # Someone wrote the export already, by hand, with another payload.
        outbox.write(s, key=KEY, step="export", destination="accounting.export", payload={"invoice": 7})
    assert consumer().deliver(first, "payments.charge") is DeliveryResult.SENT
    rows = steps(clean)
    assert rows["charge"]["state"] == "sent"
    assert rows["charge"]["chain_problem"] == "step export exists already with another payload"
    assert rows["export"]["payload"] == {"invoice": 7} and rows["export"]["parent_id"] is None
    assert second is None


def test_an_identical_existing_step_is_no_problem(clean, engine, provider, consumer):
    charge = declare(provider, "payments.charge")
    declare(provider, "accounting.export")
    charge.then(lambda d, c: [outbox.Next("export", "accounting.export", {"invoice": 7})])
    charge_id = write_charge(engine)
    with Session(engine) as s, s.begin():
        outbox.write(s, key=KEY, step="export", destination="accounting.export", payload={"invoice": 7})
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    assert steps(clean)["charge"]["chain_problem"] is None


def test_the_lookup_that_finds_the_charge_writes_the_next_step(clean, engine, provider, consumer):
    charge = lookup_on(invoice_chain(provider), provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    assert set(steps(clean)) == {"charge"}
    clients = LookupClients()
    try:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            clock.elapse(conn, 60, ids=[charge_id])
            counts = resolve_unknown(conn, {charge.destination: charge}, module="tests", clients=clients)
    finally:
        clients.close()
    assert counts.get("sent") == 1
    rows = steps(clean)
    assert rows["charge"]["state"] == "sent" and rows["export"]["parent_id"] == charge_id
    assert rows["export"]["payload"]["charge"] == rows["charge"]["provider_ref"]
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_resolve_sent_with_the_module_writes_the_next_step(clean, engine, provider, consumer):
    invoice_chain(provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        done = ops.resolve(
            conn, charge_id, sent_ref="ch_by_hand", reason="seen at the bank", handlers=registry()
        )
    assert done.done and "next steps export: 1 written" in done.message
    rows = steps(clean)
    assert rows["export"]["payload"] == {"invoice": 7, "charge": "ch_by_hand"}
    assert rows["export"]["parent_id"] == charge_id


def test_resolve_sent_without_the_module_leaves_the_steps_to_the_reconciler(
    clean, engine, provider, consumer
):
    invoice_chain(provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        done = ops.resolve(conn, charge_id, sent_ref="ch_by_hand")
    assert "its @then steps, if any, are written by the reconciler" in done.message
    assert set(steps(clean)) == {"charge"}
    assert steps(clean)["charge"]["chain_problem"] == chains.NOT_COMPUTED
    seen: list[AlertRow] = []
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        # Not a problem to alert: the reconciler's module knows the steps.
        assert send_alerts(conn, seen.append, unknown_alert_after_seconds=60) == {}
        assert write_uncomputed(conn, registry()) == {"followed": 1, "steps": 1}
        assert write_uncomputed(conn, registry()) == {}
    rows = steps(clean)
    assert rows["charge"]["chain_problem"] is None
    assert rows["export"]["payload"] == {"invoice": 7, "charge": "ch_by_hand"}


def test_a_reconciler_without_the_destination_reports_the_missing_steps(clean, engine, provider, consumer):
    invoice_chain(provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        ops.resolve(conn, charge_id, sent_ref="ch_by_hand")
    seen: list[AlertRow] = []
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert write_uncomputed(conn, {}, module="other.handlers") == {"no_handler": 1}
        assert send_alerts(conn, seen.append, unknown_alert_after_seconds=60) == {"alerts": 1}
    assert seen[0].state == "chain_broken" and "no handler for destination payments.charge" in seen[0].reason


# -- compensation ------------------------------------------------------------------------------------


def compensated_charge(provider: Any, **options: Any) -> outbox.Handler:
    charge = declare(provider, "payments.charge", **options)
    declare(provider, "mail.notify")

    @charge.on_failure
    def tell_customer(d: outbox.Delivery, error: str) -> list[outbox.Next]:
        return [outbox.Next("declined-mail", "mail.notify", {"invoice": d.payload["invoice"], "why": error})]

    return charge


def test_a_certain_failure_writes_its_compensation(clean, engine, provider, consumer):
    compensated_charge(provider)
    charge_id = write_charge(engine, {"invoice": 7, "amount_cents": -1})  # the simulator declines
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    rows = steps(clean)
    mail = rows["declined-mail"]
    assert mail["via"] == "on_failure" and mail["parent_id"] == charge_id and mail["state"] == "pending"
    assert mail["payload"] == {"invoice": 7, "why": "card declined (HTTP 402)"}
    # Its compensation was written: replaying the charge would run it after its undo.
    with engine.begin() as conn:
        plan = ops.plan_replay(conn, [charge_id])
    assert [r.id for r in plan.refused] == [charge_id]
    assert "compensation was written" in plan.refused[0].refusal()
    with engine.begin() as conn:
        forced = ops.replay(conn, [charge_id], force=True, reason="the customer fixed the card", by="alice")
    assert forced[0].done


def test_a_retry_that_will_come_gets_no_compensation(clean, engine, provider, consumer):
    compensated_charge(provider)
    provider.configure(fault_next=["fail_before"])
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.PENDING
    assert set(steps(clean)) == {"charge"}


def test_no_compensation_when_an_earlier_call_may_have_charged(clean, engine, provider, consumer):
    # An idempotent destination retries an ambiguous call; a later certain refusal does not prove
    # that the first call did nothing.
    compensated_charge(provider, idempotent=True)
    provider.configure(fault_next=["drop_after"])
    charge_id = write_charge(engine)
    worker = consumer()
    assert worker.deliver(charge_id, "payments.charge") is DeliveryResult.PENDING
    sql(
        clean,
        "UPDATE outbox_message SET available_at = now(), payload = %s WHERE id = %s",
        ('{"invoice": 7, "amount_cents": -1}', charge_id),
    )
    provider.configure(dedupe=False)
    assert worker.deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    assert set(steps(clean)) == {"charge"}


def test_no_compensation_for_a_row_failed_out_of_unknown(clean, engine, provider, consumer):
    compensated_charge(provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert consumer().deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        assert ops.resolve(conn, charge_id, failed_reason="the bank says maybe").done
    assert set(steps(clean)) == {"charge"}
