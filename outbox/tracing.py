"""Trace context from ``outbox.write`` to the handler, for processes that use OpenTelemetry.

``write`` stores the writer's current context on the row, as the propagation fields the
application's propagators inject (W3C ``traceparent`` and ``tracestate``, baggage: OpenTelemetry's
defaults); the worker runs the handler in a ``process <destination>`` span (kind CONSUMER) whose
parent is that context, so the handler's own spans and an instrumented httpx carry the trace to
the provider. The trace then reads web request → write → … → handler → provider call, hours apart
if the row waited.

outbox never imports OpenTelemetry first. A process that has not imported it has no span to
propagate and no tracer provider to report to: there is nothing to do, and checking costs one
lookup in ``sys.modules``. Installing the ``otel`` extra (``opentelemetry-api``) and setting up an
SDK in the application (which imports it) turns tracing on; no setting of ours is involved.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Imported by every use of OpenTelemetry (a span, a tracer provider, a propagator).
_LOADED = "opentelemetry.context"

#: The tracer's instrumentation scope name.
TRACER_NAME = "outbox"


def active() -> bool:
    """Whether this process uses OpenTelemetry (has imported it)."""
    return _LOADED in sys.modules


def current_context_json() -> str | None:
    """The caller's trace context as the JSON text stored on a new row; None when there is none
    (no OpenTelemetry in this process, or no span and no baggage in the current context). A
    propagator that raises costs the trace, never the write."""
    if not active():
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    try:
        propagate.inject(carrier)
    except Exception:
        logger.debug("trace context not stored: the propagator raised", exc_info=True)
        return None
    return json.dumps(carrier, separators=(",", ":")) if carrier else None


def _carrier(stored: Any) -> dict[str, str]:
    # Written by another writer (plain SQL, an older or foreign client): take only what a
    # propagator could have written, so a malformed value starts a new trace instead of failing.
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str)}


def in_span(
    fn: Callable[[Any], Any],
    *,
    trace_context: Any,
    destination: str,
    row_id: int,
    key: str,
    step: str,
    attempt: int,
) -> Callable[[Any], Any]:
    """``fn`` run in the delivery's span, a child of the row's stored context (a new trace when
    the row has none, or a malformed one). Called where the handler runs: the span is current
    in that thread only. Tracing never changes what the call does: an error of OpenTelemetry's
    before the call runs it without a span; the call's own exceptions pass through unchanged
    (recorded on the span)."""
    from opentelemetry import context, propagate, trace

    def traced(arg: Any) -> Any:
        token = None
        try:
            # extract() keeps the stored baggage too: attached, the handler sees it.
            parent = propagate.extract(_carrier(trace_context))
            token = context.attach(parent)
            span = trace.get_tracer(TRACER_NAME).start_span(
                f"process {destination}",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                attributes={
                    "messaging.system": "outbox",
                    "messaging.operation.type": "process",
                    "messaging.destination.name": destination,
                    "messaging.message.id": str(row_id),
                    "outbox.key": key,
                    "outbox.step": step,
                    "outbox.attempt": attempt,
                },
            )
        except Exception:
            logger.debug("outbox row %s: no span for the call", row_id, exc_info=True)
            if token is not None:
                context.detach(token)
            return fn(arg)
        try:
            with trace.use_span(span, end_on_exit=True):
                return fn(arg)
        finally:
            context.detach(token)

    return traced
