"""Dramatiq middleware of your own on the worker's broker (Sentry's, a tracer's, yours).

Declare it in the handler module the worker loads, beside the handlers::

    import outbox
    outbox.worker_middleware(MyMiddleware())

The worker builds its broker with its own middleware first, then these, in the order given. What
would break the guarantee or the metrics is refused with the reason (:data:`REFUSED`): retries
live in the database, the call's time limit is the deliverer's, and the metrics are outbox's own.
A middleware that raises before the message runs leaves the row ``dispatched``: the reconciler
publishes it again (the database, not the broker, says what is left to do).
"""

from __future__ import annotations

import threading
from typing import Any

from .exceptions import ConfigError

#: Middleware class names (module, qualified name) refused, with the reason.
REFUSED: dict[tuple[str, str], str] = {
    ("dramatiq.middleware.retries", "Retries"): (
        "retries live in the database (each handler's max_attempts and backoff); Dramatiq's "
        "Retries would redeliver a message whose row outbox already settled or rescheduled"
    ),
    ("dramatiq.middleware.time_limit", "TimeLimit"): (
        "the deliverer bounds each call by the handler's time_limit; Dramatiq's TimeLimit raises "
        "into the worker thread at an arbitrary point, which could land inside a claim or a record"
    ),
    ("dramatiq.middleware.prometheus", "Prometheus"): (
        "outbox serves its own metrics (--metrics-port); Dramatiq's Prometheus middleware claims "
        "the multiprocess directory and starts an exporter of its own"
    ),
    ("dramatiq.middleware.current_message", "CurrentMessage"): (
        "a handler runs on a thread or task of its own, where Dramatiq's current message is never "
        "set; the Delivery carries what the message named"
    ),
}

_lock = threading.Lock()
_added: list[Any] = []


def worker_middleware(*middleware: Any) -> None:
    """Add Dramatiq middleware instances to the worker's broker; refuses (``ConfigError``) what
    would break the guarantee or the metrics, and anything that is not a middleware instance."""
    from dramatiq.middleware import Middleware

    for m in middleware:
        if not isinstance(m, Middleware):
            raise ConfigError(
                f"outbox.worker_middleware takes dramatiq Middleware instances, got {m!r}"
                + (" (a class: instantiate it)" if isinstance(m, type) else "")
            )
        for cls in type(m).__mro__:
            reason = REFUSED.get((cls.__module__, cls.__qualname__))
            if reason is not None:
                raise ConfigError(f"outbox.worker_middleware refuses {type(m).__name__}: {reason}")
    with _lock:
        _added.extend(middleware)


def added() -> list[Any]:
    """What the handler module added, in order."""
    with _lock:
        return list(_added)


def clear() -> None:
    """For tests."""
    with _lock:
        _added.clear()


def restore(saved: list[Any]) -> None:
    """For tests: back to what :func:`added` returned earlier."""
    with _lock:
        _added[:] = saved
