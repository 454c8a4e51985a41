"""Key ledger: (key, step) outlives the purge of its row.

``outbox_key_ledger`` holds one compact row per purged ``(key, step)``; a BEFORE INSERT row trigger
on ``outbox_message`` skips an insert whose key is ledgered or whose row the inserting statement
still sees, so uniqueness across live rows and the ledger holds for every writer, not only
``outbox.write``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# One statement, so one snapshot: the purge deletes the row and ledgers its key atomically, hence
# this snapshot shows the live row or the ledger entry (or neither for a new key). The live-row
# probe is what stops a REPEATABLE READ writer whose snapshot predates a purge: the unique index no
# longer sees the deleted row, the snapshot still does. RETURN NULL (not an error) so that
# `INSERT … ON CONFLICT DO NOTHING RETURNING id` answers "nothing inserted" without aborting the
# caller's transaction.
# jsonb equality compares numbers as numerics (10 = 10.0) but its text keeps their scale: the
# ledger hashes a copy with every number's trailing zeros trimmed, so a key compared by hash after
# the purge answers as the jsonb comparison did before it. Key order and whitespace are already
# canonical in jsonb's text.
NORMAL_FUNCTION = """
CREATE OR REPLACE FUNCTION outbox_jsonb_normal(j jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT CASE jsonb_typeof(j)
    WHEN 'number' THEN to_jsonb(trim_scale((j #>> '{}')::numeric))
    WHEN 'object' THEN COALESCE(
        (SELECT jsonb_object_agg(e.key, outbox_jsonb_normal(e.value)) FROM jsonb_each(j) AS e),
        '{}'::jsonb)
    WHEN 'array' THEN COALESCE(
        (SELECT jsonb_agg(outbox_jsonb_normal(a.value) ORDER BY a.n)
         FROM jsonb_array_elements(j) WITH ORDINALITY AS a(value, n)),
        '[]'::jsonb)
    ELSE j
END
$$
"""

DIGEST_FUNCTION = """
CREATE OR REPLACE FUNCTION outbox_payload_digest(payload jsonb) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT sha256(convert_to(outbox_jsonb_normal(payload)::text, 'UTF8'))
$$
"""

GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION outbox_message_key_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_message m WHERE m.key = NEW.key AND m.step = NEW.step)
       OR EXISTS (SELECT 1 FROM outbox_key_ledger l WHERE l.key = NEW.key AND l.step = NEW.step)
    THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
"""


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    # Fixed-width columns first: no alignment padding between them.
    op.create_table(
        "outbox_key_ledger",
        sa.Column("message_id", sa.BigInteger(), nullable=False),
        sa.Column("completed_at", tz, nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("confirmed", sa.Integer(), nullable=False),
        sa.Column("ambiguous", sa.Boolean(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("payload_hash", sa.LargeBinary(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("provider_ref", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("key", "step", name="outbox_key_ledger_pkey"),
        sa.CheckConstraint("state IN ('sent', 'failed', 'cancelled')", name="outbox_key_ledger_state_check"),
    )
    op.create_index("outbox_key_ledger_completed_idx", "outbox_key_ledger", ["completed_at"])
    op.execute(NORMAL_FUNCTION)
    op.execute(DIGEST_FUNCTION)
    op.execute(GUARD_FUNCTION)
    op.execute(
        """
        CREATE TRIGGER outbox_message_key_guard
        BEFORE INSERT ON outbox_message
        FOR EACH ROW EXECUTE FUNCTION outbox_message_key_guard()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS outbox_message_key_guard ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_message_key_guard()")
    op.drop_table("outbox_key_ledger")
    op.execute("DROP FUNCTION IF EXISTS outbox_payload_digest(jsonb)")
    op.execute("DROP FUNCTION IF EXISTS outbox_jsonb_normal(jsonb)")
