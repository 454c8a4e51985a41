"""Lease and clock: released claims, lease bookkeeping.

``releases`` counts the claims of a row that were given back without a call (too little lease
left once the claim came back, or a claim whose reply was lost): they are not attempts, but a row
released again and again is held by something an operator must find.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        "outbox_message",
        sa.Column("releases", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    op.create_check_constraint("outbox_message_releases_check", "outbox_message", "releases >= 0")


def downgrade() -> None:
    op.drop_constraint("outbox_message_releases_check", "outbox_message", type_="check")
    op.drop_column("outbox_message", "releases")
