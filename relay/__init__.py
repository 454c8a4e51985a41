"""The relay sidecar: publishes committed `pending` outbox rows to Dramatiq on Redis."""

from outbox.relay.relay import BatchResult, Relay

__all__ = ["BatchResult", "Relay"]
