"""Trace context from outbox.write to the handler (issue 12): the OpenTelemetry SDK's in-memory
exporter and httpx instrumentation, in a process of their own (a tracer provider is set once
per process, and this suite's process must not start tracing its other tests' deliveries).
Real PostgreSQL and the provider simulator on 127.0.0.1; the provider records the traceparent
header each charge arrived with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import psycopg
import pytest

from outbox.settings import libpq_url

HANDLER = textwrap.dedent(
    """
    import json, os, sys

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    import outbox
    from outbox import Confirmed, Delivery
    from outbox.testing.delivery import deliver, pass_time, reconcile_once

    API = os.environ["PAYMENTS_API"]


    @outbox.handler("payments.charge", time_limit=10)
    def charge(d: Delivery) -> Confirmed:
        r = d.http.post(f"{API}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
        r.raise_for_status()
        return Confirmed(ref=r.json()["id"])


    @charge.lookup
    def find(d: Delivery) -> Confirmed | None:
        r = d.http.get(f"{API}/charges", params={"idempotency_key": d.idempotency_key})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return Confirmed(ref=r.json()["id"])


    def write(key, **kw):
        engine = create_engine(os.environ["DATABASE_URL"])
        with Session(engine) as session, session.begin():
            outbox.write(session, key=key, step="charge", destination="payments.charge",
                         payload={"amount": 100}, **kw)
        engine.dispose()
    """
)

TRACED = HANDLER + textwrap.dedent(
    """
    from opentelemetry import baggage, context, trace
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    HTTPXClientInstrumentor().instrument()
    seen_baggage = {}

    @outbox.handler("payments.note", time_limit=10)
    def note(d: Delivery) -> Confirmed:
        seen_baggage[d.key] = baggage.get_baggage("tenant")
        return Confirmed(ref="noted")

    with trace.get_tracer("shop").start_as_current_span("POST /orders"):
        token = context.attach(baggage.set_baggage("tenant", "acme"))
        write("order:1")
        engine = create_engine(os.environ["DATABASE_URL"])
        with Session(engine) as session, session.begin():
            outbox.write(session, key="order:1", step="note", destination="payments.note", payload={})
        engine.dispose()
        context.detach(token)
    write("order:2")  # no span: the delivery starts a trace of its own
    # Stored by a plain-SQL writer: malformed contexts start a trace of their own, and change
    # nothing else.
    engine = create_engine(os.environ["DATABASE_URL"])
    with engine.begin() as c:
        bad_contexts = ['"x"', "[1]", '{"traceparent": 5}', '{"traceparent": "garbage", "b": null}']
        for i, bad in enumerate(bad_contexts):
            c.exec_driver_sql(
                "INSERT INTO outbox_message (key, step, destination, payload, trace_context) "
                "VALUES (%s, 'charge', 'payments.charge', '{}', %s::jsonb)",
                (f"bad:{i}", bad),
            )
    engine.dispose()
    results = deliver(None, database_url=os.environ["DATABASE_URL"])
    # order:1's charge lost its answer (the test set the fault): the reconciler's lookup settles it.
    pass_time(3600, database_url=os.environ["DATABASE_URL"])
    reconciled = reconcile_once(None, database_url=os.environ["DATABASE_URL"])
    spans = [
        {
            "name": s.name,
            "kind": s.kind.name,
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
            "attributes": dict(s.attributes),
        }
        for s in exporter.get_finished_spans()
    ]
    print(json.dumps({"spans": spans, "results": {k: v.value for k, v in results.items()},
                      "baggage": seen_baggage, "reconciled": reconciled}))
    """
)

UNTRACED = HANDLER + textwrap.dedent(
    """
    write("order:3")
    results = deliver(None, database_url=os.environ["DATABASE_URL"])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print(json.dumps({"results": {k: v.value for k, v in results.items()}, "loaded": loaded}))
    """
)


# OpenTelemetry imported (the httpx instrumentation, as redis-py's import does) but no tracer
# provider set: an application that only passes on the context its callers sent.
PROPAGATING = HANDLER + textwrap.dedent(
    """
    from opentelemetry import baggage, context, propagate, trace
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    import outbox.tracing

    HTTPXClientInstrumentor().instrument()
    seen = {}

    @outbox.handler("payments.note", time_limit=10)
    def note(d: Delivery) -> Confirmed:
        seen[d.key] = (format(trace.get_current_span().get_span_context().trace_id, "032x"),
                       baggage.get_baggage("tenant"))
        return Confirmed(ref="noted")

    upstream = {"traceparent": os.environ["UPSTREAM"], "baggage": "tenant=acme"}
    token = context.attach(propagate.extract(upstream))
    write("order:5")
    engine = create_engine(os.environ["DATABASE_URL"])
    with Session(engine) as session, session.begin():
        outbox.write(session, key="order:5", step="note", destination="payments.note", payload={})
    engine.dispose()
    context.detach(token)
    write("order:6")
    results = deliver(None, database_url=os.environ["DATABASE_URL"])
    print(json.dumps({"results": {k: v.value for k, v in results.items()}, "seen": seen,
                      "tracer": outbox.tracing._tracer is not None}))
    """
)


BROKEN_PROCESSOR = HANDLER + textwrap.dedent(
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    class Broken(SpanProcessor):
        def on_start(self, span, parent_context=None):
            if span.name.startswith("process") and os.environ["BREAK"] == "start":
                raise RuntimeError("exporter down")

        def on_end(self, span):
            if span.name.startswith("process") and os.environ["BREAK"] == "end":
                raise RuntimeError("exporter down")

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(Broken())
    trace.set_tracer_provider(tracer_provider)
    with trace.get_tracer("shop").start_as_current_span("POST /orders"):
        write(os.environ["KEY"])
    results = deliver(None, database_url=os.environ["DATABASE_URL"])
    print(json.dumps({"results": {k: v.value for k, v in results.items()}}))
    """
)


def run(
    script: str, database_url: str, provider: Any, *, block_otel: bool = False, **extra: str
) -> dict[str, Any]:
    if block_otel:
        # As on a machine without the extra: any import of it fails.
        script = "import sys\nsys.modules['opentelemetry'] = None\n" + script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "OTEL_"))}
    env.update(DATABASE_URL=database_url, PAYMENTS_API=provider.url, **extra)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stored_contexts(database_url: str) -> dict[str, Any]:
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute("SELECT key || ':' || step, trace_context FROM outbox_message").fetchall()
    return dict(rows)


def test_the_handler_runs_in_a_child_span_of_the_writer_and_httpx_carries_it_to_the_provider(
    outbox_database_url: str, provider: Any
) -> None:
    provider.drop_after_charge(times=1)  # the first charge, order:1's: charged, its answer lost
    out = run(TRACED, outbox_database_url, provider)
    assert sorted(out["results"].values()) == ["sent"] * 6 + ["unknown"]
    assert out["reconciled"]["resolve_unknown"] == {"sent": 1}, out["reconciled"]
    spans = out["spans"]
    web = next(s for s in spans if s["name"] == "POST /orders")
    process = [s for s in spans if s["name"] == "process payments.charge"]
    assert len(process) == 6, spans
    traced = next(s for s in process if s["attributes"]["outbox.key"] == "order:1")
    untraced = next(s for s in process if s["attributes"]["outbox.key"] == "order:2")

    # The delivery is a child of the request that wrote the row, in the same trace.
    assert traced["trace_id"] == web["trace_id"]
    assert traced["parent_id"] == web["span_id"]
    assert traced["kind"] == "CONSUMER"
    assert traced["attributes"]["messaging.destination.name"] == "payments.charge"
    assert traced["attributes"]["outbox.step"] == "charge"
    assert traced["attributes"]["outbox.attempt"] == 1
    # A row written outside any span, or with a malformed context, starts a trace of its own.
    assert untraced["parent_id"] is None
    assert untraced["trace_id"] != web["trace_id"]
    malformed = [s for s in process if s["attributes"]["outbox.key"].startswith("bad:")]
    assert len(malformed) == 4 and all(s["parent_id"] is None for s in malformed), malformed

    # The instrumented httpx call is a child of the delivery, and its header reached the provider.
    client = next(s for s in spans if s["kind"] == "CLIENT" and s["parent_id"] == traced["span_id"])
    assert client["trace_id"] == web["trace_id"]
    header = provider.stats()["traceparents"]["order:1:charge"]
    assert header.split("-")[1:3] == [web["trace_id"], client["span_id"]]

    # The reconciler's lookup of order:1 is a span of the same trace, and so is its request.
    [lookup] = [s for s in spans if s["name"] == "lookup payments.charge"]
    assert (lookup["trace_id"], lookup["parent_id"], lookup["kind"]) == (
        web["trace_id"],
        web["span_id"],
        "CLIENT",
    )
    assert any(s["kind"] == "CLIENT" and s["parent_id"] == lookup["span_id"] for s in spans), spans
    assert provider.charges("order:1:charge") == 1

    # What the row stored: the writer's span as a W3C traceparent, and its baggage.
    contexts = stored_contexts(outbox_database_url)
    assert contexts["order:1:charge"]["traceparent"].split("-")[1:3] == [web["trace_id"], web["span_id"]]
    assert contexts["order:1:note"]["baggage"] == "tenant=acme"
    assert contexts["order:2:charge"] is None
    assert out["baggage"] == {"order:1": "acme"}


def test_without_opentelemetry_nothing_is_imported_and_nothing_is_stored(
    outbox_database_url: str, provider: Any
) -> None:
    out = run(UNTRACED, outbox_database_url, provider)
    assert list(out["results"].values()) == ["sent"]
    assert out["loaded"] == [], "outbox imported OpenTelemetry on its own"
    blocked = run(UNTRACED.replace("order:3", "order:4"), outbox_database_url, provider, block_otel=True)
    assert list(blocked["results"].values()) == ["sent"]
    assert stored_contexts(outbox_database_url) == {"order:3:charge": None, "order:4:charge": None}
    assert provider.stats()["traceparents"] == {}


def test_without_a_tracer_provider_the_stored_context_still_reaches_the_provider(
    outbox_database_url: str, provider: Any
) -> None:
    """OpenTelemetry imported but no SDK set up (a span would record nothing): no span is
    started, and the call still runs in the stored context, so the handler sees the writer's
    trace and baggage and an instrumented httpx passes the trace on to the provider."""
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    out = run(PROPAGATING, outbox_database_url, provider, UPSTREAM=f"00-{trace_id}-{span_id}-01")
    assert sorted(out["results"].values()) == ["sent"] * 3
    assert out["tracer"] is False, "a span was started with nobody to record it"
    assert out["seen"] == {"order:5": [trace_id, "acme"]}
    traceparents = provider.stats()["traceparents"]
    assert traceparents["order:5:charge"].split("-")[1:3] == [trace_id, span_id]
    assert "order:6:charge" not in traceparents


@pytest.mark.parametrize("where", ["start", "end"])
def test_a_tracing_error_never_changes_the_outcome(
    outbox_database_url: str, provider: Any, where: str
) -> None:
    """A span processor that raises (an exporter down) when the delivery's span starts, or ends
    after the charge: the row is sent, charged once, as without tracing."""
    out = run(BROKEN_PROCESSOR, outbox_database_url, provider, BREAK=where, KEY=f"order:{where}")
    assert list(out["results"].values()) == ["sent"]
    assert provider.charges(f"order:{where}:charge") == 1
