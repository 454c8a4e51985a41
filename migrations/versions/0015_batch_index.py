"""The members of each batch by state: ``outbox batch show`` counts them, and the
reconciler's ``batches`` job asks whether any is still open, in a few index probes whatever the
batch's size. Rows outside a batch are not in it. A revision of its own, after 0014's column: an
interrupted concurrent build is simply run again (see 0011).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_batch_idx",
        "outbox_message",
        ["batch_id", "state"],
        postgresql_where=sa.text("batch_id IS NOT NULL"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drop is brief.
    op.drop_index("outbox_message_batch_idx", table_name="outbox_message", if_exists=True)
