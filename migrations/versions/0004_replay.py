"""Replay rules: settlement of ambiguous outcomes.

Each fence row records whether (and how) its call's ambiguity was settled, written in the
statement that settles the message: ``outbox replay`` and ``outbox audit`` read it, and the
reconciler's key_ttl check skips the calls it covers (see ``outbox.outcomes``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Kept literal: a migration must not change when outbox.outcomes does.
SETTLED = "'lookup_not_found', 'operator_not_sent', 'operator_forced', 'idempotent_retry'"


def upgrade() -> None:
    # Nullable, no default: adding them rewrites nothing, on any table size.
    op.add_column("outbox_attempt", sa.Column("settled", sa.Text(), nullable=True))
    op.add_column("outbox_attempt", sa.Column("settled_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        "outbox_attempt_settled_check",
        "outbox_attempt",
        f"settled IS NULL OR (settled IN ({SETTLED}) AND settled_at IS NOT NULL)",
    )


def downgrade() -> None:
    op.drop_constraint("outbox_attempt_settled_check", "outbox_attempt", type_="check")
    op.drop_column("outbox_attempt", "settled_at")
    op.drop_column("outbox_attempt", "settled")
