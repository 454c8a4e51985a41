"""An index of the waiting rows that carry a deadline: the reconciler fails the rows
of a held-back destination whose deadline passed (``outbox.store.recovery.fail_past_deadline``),
found by deadline rather than by scanning the backlog.

A revision of its own, after 0010's columns: a build CONCURRENTLY commits what came before it in
its revision, so an interrupted build in 0010 would leave its columns behind with the version
still at 0009, and every later ``outbox migrate`` would fail on them. Here an interrupted build is
simply run again (the helper drops an INVALID leftover first).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_deadline_idx",
        "outbox_message",
        ["deadline"],
        postgresql_where=sa.text("state IN ('pending', 'dispatched') AND deadline IS NOT NULL"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drop is brief.
    op.drop_index("outbox_message_deadline_idx", table_name="outbox_message", if_exists=True)
