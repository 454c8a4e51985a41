"""The dashboard's search: keys by prefix and rows by provider reference, on a table
of a million rows, without reading it.

``key LIKE 'order:4%'`` can use the unique (key, step) index only under the C collation; under
any other (en_US.UTF-8, the usual default) it needs an index with ``text_pattern_ops``. A
provider reference is looked up when the provider's support or a customer quotes one; only rows
that have one are indexed. Both are built CONCURRENTLY (see 0011): writers never wait for them.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_key_prefix_idx",
        "outbox_message",
        ["key"],
        postgresql_ops={"key": "text_pattern_ops"},
    )
    create_index_concurrently(
        op,
        "outbox_message_provider_ref_idx",
        "outbox_message",
        ["provider_ref"],
        postgresql_where=sa.text("provider_ref IS NOT NULL"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drop is brief.
    op.drop_index("outbox_message_provider_ref_idx", table_name="outbox_message", if_exists=True)
    op.drop_index("outbox_message_key_prefix_idx", table_name="outbox_message", if_exists=True)
