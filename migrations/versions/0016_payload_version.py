"""Payload versions: ``outbox_message.payload_version``, the version of the payload's
shape its writer meant (``outbox.write(payload_version=)``; default 1). The worker brings an
older payload to its handler's current version through the handler's upgrades and releases a
newer one for a newer worker (outbox.payloads).

A constant default: PostgreSQL 11+ adds the column without rewriting the table, and every row
written before (and by a previous release, which does not know the column) is version 1. The
CHECK is added NOT VALID and validated apart, so that no exclusive lock is held while existing
rows are read.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "outbox_message",
        sa.Column("payload_version", sa.Integer(), nullable=False, server_default=sa.text("1")),
    )
    op.execute(
        "ALTER TABLE outbox_message ADD CONSTRAINT outbox_message_payload_version_check "
        "CHECK (payload_version >= 1) NOT VALID"
    )
    op.execute("ALTER TABLE outbox_message VALIDATE CONSTRAINT outbox_message_payload_version_check")


def downgrade() -> None:
    op.drop_column("outbox_message", "payload_version")
