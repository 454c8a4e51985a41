"""Transport: worker heartbeats, destinations without a consumer.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "outbox_process",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("hostname", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.Text()), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("interval_seconds", postgresql.DOUBLE_PRECISION(), nullable=False),
        sa.Column("started_at", tz, nullable=False),
        sa.Column("last_seen_at", tz, nullable=False),
        sa.Column("process_clock", tz, nullable=False),
        sa.Column("stopped_at", tz, nullable=True),
    )
    op.create_table(
        "outbox_no_consumer",
        sa.Column("destination", sa.Text(), primary_key=True),
        sa.Column("since", tz, nullable=False),
        sa.Column("cycles", sa.Integer(), nullable=False),
        sa.Column("rows_waiting", sa.BigInteger(), nullable=False),
        sa.Column("alerted_at", tz, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("outbox_no_consumer")
    op.drop_table("outbox_process")
