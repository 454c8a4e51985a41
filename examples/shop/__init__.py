"""The example shop: orders charged through the outbox (used by ``outbox demo`` and the tests)."""
