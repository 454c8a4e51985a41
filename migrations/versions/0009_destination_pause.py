"""Destinations an operator paused: ``outbox pause D`` / ``outbox resume D``.

One row per destination ever paused. A destination is paused while ``paused_until`` is in the
future (``infinity`` without ``--until``); the claim reads it, so every worker obeys at its next
claim. A new table: the previous release never reads it, and creating it locks nothing live.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "outbox_destination",
        sa.Column("destination", sa.Text(), primary_key=True),
        sa.Column("paused_until", tz, nullable=True),
        sa.Column("paused_at", tz, nullable=True),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.Column("pause_reason", sa.Text(), nullable=True),
        sa.Column("resumed_at", tz, nullable=True),
        sa.Column("resumed_by", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "paused_until IS NULL OR paused_at IS NOT NULL", name="outbox_destination_paused_check"
        ),
    )


def downgrade() -> None:
    op.drop_table("outbox_destination")
