"""A worker thread's resources before its first message (issue 17): its two connections and its
call thread are made as the thread boots, and every provider client of the process shares one
TLS context (a context per client cost 17 ms of CPU each, paid by the first deliveries)."""

from __future__ import annotations

import threading
from typing import Any

import outbox
from outbox import handlers as handlers_module
from outbox.consumer import Deliverer
from outbox.handlers import Deliveries, registry


def declare_handler() -> None:
    @outbox.handler("payments.charge", time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called
        return outbox.Confirmed(ref="ch_1")


def in_thread(fn: Any) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not errors, errors


def test_a_warmed_thread_holds_its_connections_and_call_thread(clean) -> None:
    declare_handler()
    deliverer = Deliverer(clean.database_url, registry())
    try:
        in_thread(deliverer.warm_thread)
        conns = list(deliverer._all)
        assert len(conns) == 2 and all(not c.closed for c in conns)
        assert all(c.execute("SELECT 1").fetchone() == (1,) for c in conns)
        assert len(deliverer._callers) == 1
    finally:
        deliverer.close()
    assert all(c.closed for c in conns)


def test_warming_up_against_an_unreachable_database_does_not_raise(clean) -> None:
    declare_handler()
    deliverer = Deliverer("postgresql://postgres@127.0.0.1:1/nothing", registry())
    try:
        in_thread(deliverer.warm_thread)  # the first delivery meets, and reports, the failure
        assert deliverer._all == []
    finally:
        deliverer.close()


def test_every_provider_client_shares_one_tls_context() -> None:
    declare_handler()
    handler = registry()["payments.charge"]
    first, second = Deliveries(), Deliveries()
    try:
        a, b = first.client(handler), second.client(handler)
        assert a is not b
        context = handlers_module._ssl_context()
        for client in (a, b):
            assert client._transport._pool._ssl_context is context  # type: ignore[attr-defined]
    finally:
        first.close()
        second.close()
