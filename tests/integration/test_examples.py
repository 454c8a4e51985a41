"""The examples do what their docstrings promise, against real PostgreSQL, Redis and a provider
simulator: the shop writes an order and its charge atomically, and the invoicing chain runs each
of its three steps exactly once, even when a step is re-run after a crash."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from helpers import elapse, relay_once
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from outbox import Delivery, store
from outbox.consumer import Deliverer, delivery_for
from outbox.handlers import Deliveries, Handler, close_http_clients, registry
from outbox.relay import Relay
from outbox.settings import libpq_url
from outbox.testing.provider import ProviderSimulator

# -- the shop --------------------------------------------------------------------------------------


@pytest.fixture
def shop(clean, engine):
    import examples.shop.app as app

    app.create_orders_table(engine)
    return app


def outbox_rows(engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text("SELECT key, step, destination, payload, state FROM outbox_message ORDER BY id")
            )
        ]


def order_count(engine, app) -> int:
    with Session(engine) as s:
        return s.execute(select(func.count()).select_from(app.Order)).scalar_one()


def test_an_order_and_its_charge_commit_together(shop, engine):
    with Session(engine) as s, s.begin():
        order = shop.place_order(s, "ada", 1999)
        order_id = order.id
    assert order_count(engine, shop) == 1
    assert outbox_rows(engine) == [
        (
            f"order:{order_id}",
            "charge",
            "payments.charge",
            {"order_id": order_id, "amount_cents": 1999, "currency": "EUR"},
            "pending",
        )
    ]


def test_a_rollback_leaves_neither_the_order_nor_its_charge(shop, engine):
    class PaymentFormInvalid(Exception):
        pass

    with pytest.raises(PaymentFormInvalid), Session(engine) as s, s.begin():
        shop.place_order(s, "grace", 500)
        # Both rows exist inside the transaction…
        assert s.execute(text("SELECT count(*) FROM outbox_message")).scalar_one() == 1
        raise PaymentFormInvalid
    # …and neither outside it.
    assert order_count(engine, shop) == 0
    assert outbox_rows(engine) == []


def test_place_order_never_commits_on_its_own(shop, engine):
    with Session(engine) as s:
        shop.place_order(s, "alan", 700)
        s.rollback()
    assert order_count(engine, shop) == 0
    assert outbox_rows(engine) == []


def test_an_orders_table_of_someone_else_is_refused(clean, engine):
    import examples.shop.app as app

    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id bigint PRIMARY KEY, sku text)"))
    with pytest.raises(app.SchemaMismatch, match="already exists with columns"):
        app.create_orders_table(engine)


def test_the_shop_program_places_orders_at_a_rate_then_exits(clean, engine):
    done = subprocess.run(
        [sys.executable, "-m", "examples.shop.app", "--rate", "50", "--orders", "5", "--seed", "1"],
        env=clean.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows = outbox_rows(engine)
    assert len(rows) == 5
    assert all(step == "charge" and state == "pending" for _, step, _, _, state in rows)
    with engine.connect() as conn:
        orders = conn.execute(text("SELECT id FROM orders ORDER BY id")).scalars().all()
    assert [key for key, *_ in rows] == [f"order:{i}" for i in orders]


# -- the invoicing chain ---------------------------------------------------------------------------

STEPS = ("issue", "export", "notify")


@dataclass
class Chain:
    module: Any
    handlers: dict[str, Handler]
    provider: ProviderSimulator


def _chain(clean, monkeypatch, *, dedupe: bool) -> Iterator[Chain]:
    with ProviderSimulator(dedupe=dedupe) as provider:
        monkeypatch.setenv("INVOICING_API_URL", provider.url)
        monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
        import examples.invoicing.handlers as module

        # `clean` emptied the handler registry: declare the handlers again.
        module = importlib.reload(module)
        handlers = {d: h for d, h in registry().items() if d.startswith("invoicing.")}
        assert set(handlers) == set(module.DESTINATIONS.values())
        try:
            yield Chain(module, handlers, provider)
        finally:
            close_http_clients()


@pytest.fixture
def chain(clean, monkeypatch) -> Iterator[Chain]:
    yield from _chain(clean, monkeypatch, dedupe=False)


@pytest.fixture
def deduplicating_chain(clean, monkeypatch) -> Iterator[Chain]:
    yield from _chain(clean, monkeypatch, dedupe=True)


def start(engine, chain: Chain, invoice: str, amount_cents: int = 12_000) -> None:
    with Session(engine) as s, s.begin():
        chain.module.start_invoice(s, invoice=invoice, customer="ada", amount_cents=amount_cents)


def run_pipeline(services, chain: Chain, rounds: int = 10) -> None:
    """Relay what is due, deliver what was published, until nothing moves."""
    relay = Relay(
        database_url=services.database_url, redis_url=services.redis_url, namespace=services.namespace
    )
    consumer = Deliverer(services.database_url, chain.handlers)
    try:
        for _ in range(rounds):
            relay.drain()
            with psycopg.connect(libpq_url(services.database_url)) as conn:
                due = conn.execute(
                    "SELECT id, destination FROM outbox_message WHERE state = 'dispatched' ORDER BY id"
                ).fetchall()
            if not due:
                return
            for row_id, destination in due:
                consumer.deliver(row_id, destination)
        raise AssertionError("the chain did not settle")
    finally:
        relay.close()
        consumer.close()


def chain_rows(services, key: str) -> list[tuple[str, str, int, int]]:
    """(step, state, attempts, attempt rows) in the order the steps were written."""
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        return conn.execute(
            """
            SELECT m.step, m.state, m.attempts,
                   (SELECT count(*) FROM outbox_attempt a WHERE a.message_id = m.id)
            FROM outbox_message m WHERE m.key = %s ORDER BY m.id
            """,
            (key,),
        ).fetchall()


def test_the_chain_runs_each_step_once_and_in_order(clean, engine, chain):
    for n in (1, 2, 3):
        start(engine, chain, f"INV-{n}")
    run_pipeline(clean, chain)
    for n in (1, 2, 3):
        assert chain_rows(clean, f"invoice:INV-{n}") == [(step, "sent", 1, 1) for step in STEPS]
    effects = chain.provider.stats()["effects"]
    assert effects == {f"invoice:INV-{n}:{step}": 1 for n in (1, 2, 3) for step in STEPS}


def test_a_failed_step_stops_the_chain_and_writes_its_compensation(clean, engine, chain):
    # The provider simulator declines negative amounts: the invoice is refused for good.
    start(engine, chain, "INV-BAD", amount_cents=-1)
    run_pipeline(clean, chain)
    assert chain_rows(clean, "invoice:INV-BAD") == [("issue", "failed", 1, 1), ("refused-mail", "sent", 1, 1)]


LEASE_SECONDS = 60


def claim(services, chain: Chain, step: str, key: str) -> Delivery:
    """Claim a row as a consumer would, and build the Delivery its handler gets."""
    handler = chain.handlers[chain.module.DESTINATIONS[step]]
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        (row_id,) = conn.execute(
            "SELECT id FROM outbox_message WHERE key = %s AND step = %s", (key, step)
        ).fetchone()
        claimed = store.delivery.claim(
            conn, row_id=row_id, destination=handler.destination, lease_seconds=LEASE_SECONDS
        )
    assert claimed is not None
    return delivery_for(claimed, handler, Deliveries())  # closed by close_http_clients()


def expire_and_reconcile(services, chain: Chain) -> dict[str, int]:
    """What the reconciler does once the dead worker's lease is over: expire it, look it up."""
    from outbox.reconciler.jobs.expire_leases import expire_leases
    from outbox.reconciler.jobs.resolve_unknown import resolve_unknown

    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        # The dead worker's lease runs out, then the first lookup's wait (one time_limit).
        elapse(conn, LEASE_SECONDS + 1)
        assert expire_leases(conn, chain.handlers) == 1
        elapse(conn, max(h.time_limit for h in chain.handlers.values()) + 1)
        return resolve_unknown(conn, chain.handlers)


def test_rerunning_a_step_after_a_crash_does_not_create_a_second_next_step(
    clean, engine, deduplicating_chain
):
    chain = deduplicating_chain
    start(engine, chain, "INV-7")
    relay_once(clean)
    delivery = claim(clean, chain, "issue", "invoice:INV-7")
    handler = chain.handlers["invoicing.issue"]

    first = handler(delivery)
    # The worker dies here: the provider answered, the outcome was never recorded. The step
    # runs again (a redelivery, an idempotent retry)…
    second = handler(delivery)
    assert first.ref == second.ref  # the provider deduplicated on the Idempotency-Key
    # …and no next step exists before the step is settled.
    assert [step for step, *_ in chain_rows(clean, "invoice:INV-7")] == ["issue"]

    # The reconciler settles the step through the lookup, which writes the next step with it.
    assert expire_and_reconcile(clean, chain) == {"sent": 1}
    assert [step for step, *_ in chain_rows(clean, "invoice:INV-7")] == ["issue", "export"]
    run_pipeline(clean, chain)
    rows = chain_rows(clean, "invoice:INV-7")
    assert [(step, state) for step, state, *_ in rows] == [(s, "sent") for s in STEPS]
    assert chain.provider.stats()["double_charged"] == []


def test_a_crash_between_the_call_and_the_next_step_is_continued_by_the_lookup(clean, engine, chain):
    start(engine, chain, "INV-8")
    relay_once(clean)
    delivery = claim(clean, chain, "issue", "invoice:INV-8")
    # The call reaches the provider and the worker dies before recording it.
    chain.module._call(delivery)
    assert [step for step, *_ in chain_rows(clean, "invoice:INV-8")] == ["issue"]

    assert expire_and_reconcile(clean, chain) == {"sent": 1}
    # The lookup found the invoice and settled the step, writing the next one in that statement.
    assert [(s, st) for s, st, *_ in chain_rows(clean, "invoice:INV-8")] == [
        ("issue", "sent"),
        ("export", "pending"),
    ]

    run_pipeline(clean, chain)
    assert [(s, st) for s, st, *_ in chain_rows(clean, "invoice:INV-8")] == [(s, "sent") for s in STEPS]
    # The provider does not deduplicate here: one effect per step proves no step was called twice.
    assert chain.provider.stats()["effects"] == {f"invoice:INV-8:{step}": 1 for step in STEPS}
