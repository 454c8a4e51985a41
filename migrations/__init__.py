"""Alembic migrations of the outbox tables, installed as ``outbox.migrations``."""
