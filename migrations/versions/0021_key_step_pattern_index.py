"""One index on (key, step) instead of two (issue 17): the unique index on (key, step) is rebuilt
with ``text_pattern_ops`` on key, so it also serves ``key LIKE 'order:4%'`` under any collation,
and the separate prefix index of 0019 goes.

Every state change of a row is a non-HOT update (the state is in the partial indexes' predicates),
so each index on every row gets a new entry at the insert and at each of the three moves of a
delivery: the second index on key cost about 340 bytes of WAL a delivery (3,010 → 2,670, bench/e2e.py
--steady max) and its share of the backends' CPU. Equality under ``text_pattern_ops`` is the
text type's own ``=``, so uniqueness is what it was, and ``ON CONFLICT (key, step)`` infers this
index as it did the constraint. A unique constraint cannot be backed by an index with a
non-default operator class, so this is a unique index named as the constraint was: a
UniqueViolation still names ``outbox_message_key_step_key``.

Backward compatible (the previous release's statements use ON CONFLICT (key, step) and LIKE,
both served by the new index). The index is built CONCURRENTLY (see 0011); the swap (drop the
constraint, rename the index, drop the prefix index) is one short transaction. The downgrade
keeps the new index (it serves 0020's code as it is).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op
from outbox.migrations.helpers import create_index_concurrently

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_NEW = "outbox_message_key_step_pattern_idx"


def upgrade() -> None:
    create_index_concurrently(
        op,
        _NEW,
        "outbox_message",
        ["key", "step"],
        unique=True,
        postgresql_ops={"key": "text_pattern_ops"},
    )
    op.execute("ALTER TABLE outbox_message DROP CONSTRAINT IF EXISTS outbox_message_key_step_key")
    op.execute("DROP INDEX IF EXISTS outbox_message_key_step_key")  # what a downgrade left
    op.execute(f"ALTER INDEX {_NEW} RENAME TO outbox_message_key_step_key")
    op.execute("DROP INDEX IF EXISTS outbox_message_key_prefix_idx")


def downgrade() -> None:
    # Nothing: the unique index serves what the constraint and the prefix index of 0020 served
    # (uniqueness, ON CONFLICT (key, step), LIKE 'p%'), under the same name, and rebuilding them
    # would lock the live table for the whole build. An upgrade again rebuilds it (above).
    pass
