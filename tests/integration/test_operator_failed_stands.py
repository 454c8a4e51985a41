"""An operator's ``resolve --failed`` stands against a worker's late answer: the claim whose lease
the reconciler expired comes back confirmed after the operator gave the step up ("refunded by
hand"), and neither moves the row to ``sent`` nor writes its next steps; only its attempt row says
what the provider answered. Real PostgreSQL."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import elapse
from sqlalchemy.orm import Session

import outbox
from outbox import chains, ops, store
from outbox.handlers import registry
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.settings import libpq_url


def declare() -> None:
    @outbox.handler("payments.charge", time_limit=2, backoff=(1,), max_attempts=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called here
        raise AssertionError("no call in this test")

    @charge.then
    def ship(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("ship", "warehouse.ship", {"charge": c.ref})]

    @outbox.handler("warehouse.ship", time_limit=2)
    def post(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called here
        raise AssertionError("no call in this test")


def test_a_late_confirmation_leaves_an_operators_failed_step_failed_and_unchained(
    clean: Any, engine: Any
) -> None:
    declare()
    with Session(engine) as s, s.begin():
        row_id = outbox.write(
            s, key="order:7", step="charge", destination="payments.charge", payload={"amount_cents": 100}
        ).id
    handler = registry()["payments.charge"]
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        held = store.delivery.claim(conn, row_id=row_id, destination="payments.charge", lease_seconds=30)
        assert held is not None
        # The worker froze mid-call; its lease ran out and the reconciler expired it.
        elapse(conn, 31, [row_id])
        assert expire_leases(conn, registry()) == 1
        with engine.begin() as tx:
            done = ops.resolve(tx, row_id, failed_reason="refunded by hand", by="support", reason="ticket 7")
            assert done.done
        # The worker wakes up with the provider's confirmation and records it, with its @then.
        cur = conn.execute(
            "SELECT id, key, step, destination, payload, attempts, deadline, payload_version"
            " FROM outbox_message WHERE id = %s",
            (row_id,),
        )
        stored = dict(zip([c.name for c in cur.description], cur.fetchone(), strict=True))
        plan = chains.then_plan_for_row(handler, stored, outbox.Confirmed("ch_late", {"id": "ch_late"}))
        assert plan.rows  # what the worker would write with its record
        moved = store.delivery.record(
            conn,
            row_id=row_id,
            token=held.token,
            state="sent",
            outcome="sent",
            ref="ch_late",
            response='{"id": "ch_late"}',
            follow=plan,
        ).state
        assert moved is None
        rows = conn.execute(
            "SELECT step, state, provider_ref, last_error FROM outbox_message ORDER BY id"
        ).fetchall()
        fence = conn.execute("SELECT outcome FROM outbox_attempt WHERE message_id = %s", (row_id,)).fetchall()
    assert rows == [("charge", "failed", None, "refunded by hand")]
    # The provider's answer is kept where outbox show and outbox audit read it.
    assert fence == [("superseded:sent",)]
