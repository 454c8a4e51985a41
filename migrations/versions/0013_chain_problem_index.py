"""An index of the settled rows whose next steps could not all be written and that nobody has
been told of yet: the reconciler's alert job finds them without reading every sent
row. A revision of its own, after 0012's columns: an interrupted concurrent build is simply run
again (see 0011).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_chain_problem_idx",
        "outbox_message",
        ["id"],
        postgresql_where=sa.text("chain_problem IS NOT NULL AND alerted_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("outbox_message_chain_problem_idx", table_name="outbox_message", if_exists=True)
