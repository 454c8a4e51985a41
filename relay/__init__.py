"""The relay sidecar: publishes committed `pending` outbox rows to Dramatiq on Redis."""

from outbox.relay.relay import GroupResult, Relay

__all__ = ["GroupResult", "Relay"]
