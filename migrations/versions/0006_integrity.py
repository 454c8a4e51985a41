"""Integrity: stored-data rules and failover detection.

The stored-data rules need no schema (they live in outbox.sanitize and outbox.validation).
Failover detection: ``outbox_db_identity``, one row naming the database history (system identifier,
timeline) the outbox last ran on; see outbox.failover.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "outbox_db_identity",
        sa.Column("id", sa.SmallInteger(), primary_key=True, autoincrement=False),
        sa.Column("system_identifier", sa.Text(), nullable=True),
        sa.Column("timeline", sa.Integer(), nullable=True),
        sa.Column("recorded_at", tz, nullable=False, server_default=sa.text("now()")),
        sa.Column("recorded_by", sa.Text(), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("mismatch_seen_at", tz, nullable=True),
        sa.Column("mismatch", sa.Text(), nullable=True),
        sa.CheckConstraint("id = 1", name="outbox_db_identity_one_row_check"),
    )


def downgrade() -> None:
    op.drop_table("outbox_db_identity")
