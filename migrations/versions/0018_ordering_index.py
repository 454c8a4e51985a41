"""The rows of each ordering key that may still hold it back: the relay and the claim
ask "is an earlier row of this key unsettled?" in one index probe, and ``outbox ordering`` lists
the blocked keys without scanning the table. A revision of its own, after 0017's column: an
interrupted concurrent build is simply run again (see 0011).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_ordering_idx",
        "outbox_message",
        ["ordering_key", "id"],
        postgresql_where=sa.text("ordering_key IS NOT NULL AND state NOT IN ('sent', 'cancelled')"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drop is brief.
    op.drop_index("outbox_message_ordering_idx", table_name="outbox_message", if_exists=True)
