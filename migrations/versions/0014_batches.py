"""Batches: rows written in one transaction as a group whose end writes one row.

``outbox_batch`` holds a batch's name (the business key of the row its end writes), the step it
writes when every member is sent (``then_step``) or when any failed (``catch_step``), each
``{"step", "destination", "payload"}``, and the transaction that created it (``created_txid``):
a row joins a batch only in that transaction, so a batch's members are fixed when it commits.
``finished_at``/``outcome`` are set once, by the one guarded statement that also writes the
then/catch row (the reconciler's ``batches`` job), with the members' counts at that moment, the
id of the row it wrote (``written_id``) or why none was (``problem``: a row of that key and step
exists already).

``outbox_message.batch_id`` names the batch a row belongs to, and the key ledger keeps it so that
``write(batch=)`` answers for a purged member as before the purge: nullable columns (no table
rewrite); the previous release never reads them. The message index is 0015's (concurrently).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_batch",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("then_step", JSONB(), nullable=True),
        sa.Column("catch_step", JSONB(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("created_txid", sa.BigInteger(), nullable=False, server_default=sa.text("txid_current()")),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=True),
        sa.Column("sent", sa.Integer(), nullable=True),
        sa.Column("failed", sa.Integer(), nullable=True),
        sa.Column("cancelled", sa.Integer(), nullable=True),
        sa.Column("written_id", sa.BigInteger(), nullable=True),
        sa.Column("problem", sa.Text(), nullable=True),
        sa.CheckConstraint("char_length(name) > 0", name="outbox_batch_name_check"),
        sa.CheckConstraint(
            "(finished_at IS NULL AND outcome IS NULL)"
            " OR (finished_at IS NOT NULL AND outcome IN ('then', 'catch'))",
            name="outbox_batch_outcome_check",
        ),
        sa.UniqueConstraint("name", name="outbox_batch_name_key"),
    )
    op.create_index(
        "outbox_batch_open_idx", "outbox_batch", ["id"], postgresql_where=sa.text("finished_at IS NULL")
    )
    for table in ("outbox_message", "outbox_key_ledger"):
        op.add_column(table, sa.Column("batch_id", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in ("outbox_message", "outbox_key_ledger"):
        op.drop_column(table, "batch_id")
    op.drop_index("outbox_batch_open_idx", table_name="outbox_batch")
    op.drop_table("outbox_batch")
