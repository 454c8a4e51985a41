"""outbox: a transactional outbox relay.

Write an outbox row in your own SQLAlchemy transaction; the relay publishes it to Dramatiq on
Redis; a consumer claims it, calls the provider with an Idempotency-Key derived from the business
key, and records the confirmed answer. The database is the source of truth.

The public API is what ``__all__`` lists, importable from ``outbox`` itself: ``write`` /
``write_async`` and ``cancel`` / ``cancel_async``, ``batch`` / ``batch_async`` (a group of rows
with one row written when all are done), the ``@handler`` decorator with ``Handler``,
``Delivery`` and ``Confirmed``, ``worker_middleware`` (Dramatiq middleware of your own), and
the exceptions (all subclasses of ``OutboxError``). Every other module (``outbox.relay``,
``outbox.ops``, ``outbox.cli``, …) is internal and may change.

The names are loaded on first use (PEP 562), so that ``import outbox`` and the ``outbox``
command start without SQLAlchemy, Dramatiq or httpx until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batches import Batch, batch, batch_async
    from .chains import Next
    from .exceptions import (
        AmbiguousError,
        BatchConflict,
        ConfigError,
        FeatureNotEnabled,
        InvalidMessage,
        InvalidTransition,
        KeyConflict,
        NotFound,
        NotMigrated,
        OutboxError,
        PermanentError,
        RetryableError,
        UnsafeBroker,
    )
    from .handlers import Breaker, Confirmed, Delivery, Handler, handler
    from .middleware import worker_middleware
    from .writing import Written, cancel, cancel_async, write, write_async

__all__ = [
    "AmbiguousError",
    "Batch",
    "BatchConflict",
    "Breaker",
    "ConfigError",
    "Confirmed",
    "Delivery",
    "FeatureNotEnabled",
    "Handler",
    "InvalidMessage",
    "InvalidTransition",
    "KeyConflict",
    "Next",
    "NotFound",
    "NotMigrated",
    "OutboxError",
    "PermanentError",
    "RetryableError",
    "UnsafeBroker",
    "Written",
    "__version__",
    "batch",
    "batch_async",
    "cancel",
    "cancel_async",
    "handler",
    "worker_middleware",
    "write",
    "write_async",
]

# Where each public name lives.
_HOME = {
    **dict.fromkeys(
        (
            "AmbiguousError",
            "BatchConflict",
            "ConfigError",
            "FeatureNotEnabled",
            "InvalidMessage",
            "InvalidTransition",
            "KeyConflict",
            "NotFound",
            "NotMigrated",
            "OutboxError",
            "PermanentError",
            "RetryableError",
            "UnsafeBroker",
        ),
        "exceptions",
    ),
    **dict.fromkeys(("Breaker", "Confirmed", "Delivery", "Handler", "handler"), "handlers"),
    **dict.fromkeys(("Written", "cancel", "cancel_async", "write", "write_async"), "writing"),
    "worker_middleware": "middleware",
    "Next": "chains",
    **dict.fromkeys(("Batch", "batch", "batch_async"), "batches"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
