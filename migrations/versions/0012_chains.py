"""Chains: the row whose settlement wrote this one, and why a settled row's next
steps could not all be written.

``parent_id`` is the id of the row whose ``sent`` (``via = 'then'``) or certain failure
(``via = 'on_failure'``) wrote this row in the same statement; the batch values are reserved for
batches (0014). No foreign key: a parent is purged to the key ledger before its children may
be. ``chain_problem`` says why a settled row's declared next steps were not all written (the
``then`` function raised, a step exists with another payload): the reconciler alerts it once and
``outbox repair`` rewrites what is missing. The ledger keeps ``parent_id``/``via`` so that a purged
compensation still blocks the replay of the step it compensated.

Added nullable columns only (no table rewrite); the CHECK is ``NOT VALID`` (every existing row
holds NULL, and a validating scan would hold its lock over the whole table). The previous release
never reads them.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

VIA = "via IS NULL OR via IN ('then', 'on_failure', 'batch_then', 'batch_catch')"


def upgrade() -> None:
    for table in ("outbox_message", "outbox_key_ledger"):
        op.add_column(table, sa.Column("parent_id", sa.BigInteger(), nullable=True))
        op.add_column(table, sa.Column("via", sa.Text(), nullable=True))
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_via_check CHECK ({VIA}) NOT VALID")
    op.add_column("outbox_message", sa.Column("chain_problem", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("outbox_message", "chain_problem")
    for table in ("outbox_message", "outbox_key_ledger"):
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_via_check")
        op.drop_column(table, "via")
        op.drop_column(table, "parent_id")
