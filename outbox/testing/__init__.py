"""Test helpers for outbox: a local payment provider simulator."""
