"""The purge of finished batches: their then/catch payloads at the retention, their rows at the
ledger horizon (reconciler/jobs/purge.py), each found oldest finish first without reading the
table. ``outbox_batch_payload_idx`` holds only the batches that still carry a payload, so the
stripped ones kept until the horizon are not read again at every run.

Expand only: two indexes, built CONCURRENTLY (see 0011); the previous release neither reads nor
needs them, and this code runs without them (a slower purge) on 0017 to 0020.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_batch_payload_idx",
        "outbox_batch",
        ["finished_at"],
        postgresql_where=sa.text(
            "finished_at IS NOT NULL AND (then_step ? 'payload' OR catch_step ? 'payload')"
        ),
    )
    create_index_concurrently(
        op,
        "outbox_batch_finished_idx",
        "outbox_batch",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drop is brief.
    op.drop_index("outbox_batch_finished_idx", table_name="outbox_batch", if_exists=True)
    op.drop_index("outbox_batch_payload_idx", table_name="outbox_batch", if_exists=True)
