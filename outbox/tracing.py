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

import inspect
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


_tracer: Any = None


def _get_tracer() -> Any:
    # Cached: get_tracer is too dear to call per delivery. Taken before the application sets its tracer
    # provider, it is OpenTelemetry's proxy, which follows the provider once it is set.
    global _tracer
    if _tracer is None:
        from opentelemetry import trace

        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


_modules: tuple[Any, Any, Any] | None = None


def _api() -> tuple[Any, Any, Any]:
    # Once: ``from opentelemetry import ...`` runs importlib's Python code on every call, about
    # 1% of an async worker's CPU when it ran once per delivery.
    global _modules
    if _modules is None:
        from opentelemetry import context, propagate, trace

        _modules = (context, propagate, trace)
    return _modules


def in_span(
    fn: Callable[[Any], Any],
    *,
    operation: str = "process",
    trace_context: Any,
    destination: str,
    row_id: int,
    key: str,
    step: str,
    attempt: int,
) -> Callable[[Any], Any]:
    """``fn`` run in a span ``<operation> <destination>`` (``process``: the worker's call, kind
    CONSUMER; ``lookup``: the reconciler's, kind CLIENT), a child of the row's stored context (a
    new trace when the row has none, or a malformed one). Called where ``fn`` runs: the span is
    current in that thread only; for an ``async def`` ``fn``, a coroutine function whose span is
    current in the task that awaits it.

    Tracing never changes what the call does or what it returned: an error of OpenTelemetry's
    before the call runs it without a span, one after it (a span processor that raises on end)
    is logged and dropped, and the call's own exceptions pass through unchanged (recorded on the
    span).

    Without a tracer provider of the application's (OpenTelemetry imported, as redis-py does,
    but no SDK set up) a span would record nothing: the call runs in the stored context only,
    which an instrumented client still carries to the provider, and a row without one runs as
    it is."""
    context, propagate, trace = _api()
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return _in_context(fn, _carrier(trace_context), row_id)

    kind = trace.SpanKind.CONSUMER if operation == "process" else trace.SpanKind.CLIENT

    def begin() -> tuple[Any, tuple[Any, Any]] | None:
        token = None
        try:
            # extract() keeps the stored baggage too: attached, the call sees it.
            parent = propagate.extract(_carrier(trace_context))
            token = context.attach(parent)
            span = _get_tracer().start_span(
                f"{operation} {destination}",
                context=parent,
                kind=kind,
                attributes={
                    "messaging.system": "outbox",
                    "messaging.operation.type": operation,
                    "messaging.destination.name": destination,
                    "messaging.message.id": str(row_id),
                    "outbox.key": key,
                    "outbox.step": step,
                    "outbox.attempt": attempt,
                },
            )
            current = context.attach(trace.set_span_in_context(span, parent))
        except Exception:
            logger.debug("outbox row %s: no span for the call", row_id, exc_info=True)
            _detach(token)
            return None
        return span, (current, token)

    if inspect.iscoroutinefunction(fn):
        # Attached inside the task that runs the call: a task's context is its own.
        async def traced_async(arg: Any) -> Any:
            begun = begin()
            if begun is None:
                return await fn(arg)
            try:
                result = await fn(arg)
            except BaseException as exc:
                _end(begun[0], begun[1], exc, row_id)
                raise
            _end(begun[0], begun[1], None, row_id)
            return result

        return traced_async

    def traced(arg: Any) -> Any:
        begun = begin()
        if begun is None:
            return fn(arg)
        try:
            result = fn(arg)
        except BaseException as exc:
            _end(begun[0], begun[1], exc, row_id)
            raise
        _end(begun[0], begun[1], None, row_id)
        return result

    return traced


def _in_context(fn: Callable[[Any], Any], carrier: dict[str, str], row_id: int) -> Callable[[Any], Any]:
    """``fn`` run with the stored context (its span as the parent, its baggage) attached."""
    if not carrier:
        return fn
    from opentelemetry import context, propagate

    def attach() -> Any:
        try:
            return context.attach(propagate.extract(carrier))
        except Exception:
            logger.debug("outbox row %s: the stored trace context was not attached", row_id, exc_info=True)
            return None

    if inspect.iscoroutinefunction(fn):

        async def propagated_async(arg: Any) -> Any:
            token = attach()
            try:
                return await fn(arg)
            finally:
                _detach(token)

        return propagated_async

    def propagated(arg: Any) -> Any:
        token = attach()
        try:
            return fn(arg)
        finally:
            _detach(token)

    return propagated


def _detach(token: Any) -> None:
    if token is not None:
        try:
            from opentelemetry import context

            context.detach(token)
        except Exception:
            logger.debug("trace context not detached", exc_info=True)


def _end(span: Any, tokens: tuple[Any, Any], error: BaseException | None, row_id: int) -> None:
    try:
        if error is not None and isinstance(error, Exception):
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end()
    except Exception:
        logger.debug("outbox row %s: the span did not end cleanly", row_id, exc_info=True)
    for token in tokens:
        _detach(token)
