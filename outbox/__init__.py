"""outbox: a transactional outbox relay.

Write an outbox row in your own SQLAlchemy transaction; the relay publishes it to Dramatiq on
Redis; a consumer claims it, calls the provider with an Idempotency-Key derived from the business
key, and records the confirmed answer. The database is the source of truth.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .exceptions import (
    AmbiguousError,
    ConfigError,
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
from .handlers import Confirmed, Delivery, Handler, handler
from .write import Written, cancel, cancel_async, write, write_async

try:
    __version__ = version("outbox-relay")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0.0.0"

__all__ = [
    "AmbiguousError",
    "ConfigError",
    "Confirmed",
    "Delivery",
    "Handler",
    "InvalidMessage",
    "InvalidTransition",
    "KeyConflict",
    "NotFound",
    "NotMigrated",
    "OutboxError",
    "PermanentError",
    "RetryableError",
    "UnsafeBroker",
    "Written",
    "__version__",
    "cancel",
    "cancel_async",
    "handler",
    "write",
    "write_async",
]
