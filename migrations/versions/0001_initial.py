"""outbox_message and outbox_attempt, partial indexes and the insert NOTIFY trigger.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATES = "'pending', 'dispatched', 'in_flight', 'unknown', 'sent', 'failed', 'cancelled'"


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "outbox_message",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False, server_default=sa.text("'pending'")),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("available_at", tz, nullable=False, server_default=sa.text("now()")),
        sa.Column("deadline", tz, nullable=True),
        sa.Column("created_at", tz, nullable=False, server_default=sa.text("now()")),
        sa.Column("dispatched_at", tz, nullable=True),
        sa.Column("claimed_at", tz, nullable=True),
        sa.Column("lease_expires_at", tz, nullable=True),
        sa.Column("completed_at", tz, nullable=True),
        sa.Column("unknown_since", tz, nullable=True),
        sa.Column("alerted_at", tz, nullable=True),
        sa.Column("claim_token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("provider_ref", sa.Text(), nullable=True),
        sa.Column("response", postgresql.JSONB(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("history", postgresql.JSONB(), nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.UniqueConstraint("key", "step", name="outbox_message_key_step_key"),
        sa.CheckConstraint(f"state IN ({STATES})", name="outbox_message_state_check"),
        sa.CheckConstraint("attempts >= 0", name="outbox_message_attempts_check"),
        sa.CheckConstraint(
            "char_length(key) > 0 AND char_length(step) > 0",
            name="outbox_message_key_step_check",
        ),
        sa.CheckConstraint(
            "state <> 'sent' OR provider_ref IS NOT NULL", name="outbox_message_sent_ref_check"
        ),
        sa.CheckConstraint(
            "state <> 'in_flight' OR (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name="outbox_message_in_flight_check",
        ),
    )
    op.create_index(
        "outbox_message_pending_idx",
        "outbox_message",
        ["available_at", "id"],
        postgresql_where=sa.text("state = 'pending'"),
    )
    op.create_index(
        "outbox_message_in_flight_idx",
        "outbox_message",
        ["lease_expires_at"],
        postgresql_where=sa.text("state = 'in_flight'"),
    )
    op.create_index(
        "outbox_message_dispatched_idx",
        "outbox_message",
        ["dispatched_at"],
        postgresql_where=sa.text("state = 'dispatched'"),
    )
    op.create_index(
        "outbox_message_unknown_idx",
        "outbox_message",
        ["available_at"],
        postgresql_where=sa.text("state = 'unknown'"),
    )
    op.create_index(
        "outbox_message_failed_idx",
        "outbox_message",
        ["destination"],
        postgresql_where=sa.text("state = 'failed'"),
    )
    op.create_index(
        "outbox_message_purge_idx",
        "outbox_message",
        ["completed_at"],
        postgresql_where=sa.text("state IN ('sent', 'cancelled')"),
    )

    op.create_table(
        "outbox_attempt",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column(
            "message_id",
            sa.BigInteger(),
            sa.ForeignKey("outbox_message.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("claim_token", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("started_at", tz, nullable=False, server_default=sa.text("now()")),
        sa.Column("finished_at", tz, nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("claim_token", name="outbox_attempt_claim_token_key"),
    )
    op.create_index("outbox_attempt_message_idx", "outbox_attempt", ["message_id"])

    # Statement-level, so a bulk insert costs one NOTIFY; rows written by plain SQL from any
    # language wake the relay too.
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_message_notify() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox_message', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER outbox_message_notify
        AFTER INSERT ON outbox_message
        FOR EACH STATEMENT EXECUTE FUNCTION outbox_message_notify()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS outbox_message_notify ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_message_notify()")
    op.drop_table("outbox_attempt")
    op.drop_table("outbox_message")
