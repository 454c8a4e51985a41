"""Per-key ordering: ``outbox_message.ordering_key`` and what keeps one key's rows in
order, in the database rather than in any process.

* ``ordering_key`` (text, NULL for most rows): rows of one ordering key are claimed one at a
  time, in commit order (outbox.ordering).
* A BEFORE INSERT trigger serialises the writers of one ordering key: it takes a transaction
  advisory lock on the key, then gives the row its id. Ids come from a sequence at INSERT, not at
  COMMIT, so without it two writers of one key could commit in the other order than their ids;
  with it, the second writer waits for the first to end, and its id comes after. Plain-SQL
  writers get the same.
* ``skip_when_failed``: set by the claim from the handler's ``on_failed_head`` ("skip"): a
  ``failed`` row so marked no longer holds its key back; ``order_skipped_at``: an operator's
  ``outbox skip`` of a failed head.
* An AFTER UPDATE trigger sends the relay's NOTIFY when an ordered row settles (or is skipped):
  the next row of its key is published at once, not at the next poll.

Nullable or constant-default columns: no table rewrite; the previous release neither reads nor
writes them. The index is 0018's (concurrently).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_message", sa.Column("ordering_key", sa.Text(), nullable=True))
    op.add_column(
        "outbox_message",
        sa.Column("skip_when_failed", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    op.add_column("outbox_message", sa.Column("order_skipped_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "ALTER TABLE outbox_message ADD CONSTRAINT outbox_message_ordering_key_check "
        "CHECK (ordering_key IS NULL OR char_length(ordering_key) BETWEEN 1 AND 200) NOT VALID"
    )
    op.execute("ALTER TABLE outbox_message VALIDATE CONSTRAINT outbox_message_ordering_key_check")
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_message_ordering_serialize() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            -- A 64-bit hash: with hashtext's 32 bits, two keys of a few hundred thousand
            -- collided and their writers waited for each other.
            PERFORM pg_advisory_xact_lock(hashtextextended('outbox.ordering:' || NEW.ordering_key, 0));
            NEW.id := nextval(pg_get_serial_sequence('outbox_message', 'id'));
            RETURN NEW;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER outbox_message_ordering_serialize
        BEFORE INSERT ON outbox_message
        FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL)
        EXECUTE FUNCTION outbox_message_ordering_serialize()
        """
    )
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_message_ordering_wake() RETURNS trigger
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
        CREATE TRIGGER outbox_message_ordering_wake
        AFTER UPDATE ON outbox_message
        FOR EACH ROW WHEN (
            NEW.ordering_key IS NOT NULL
            AND ((OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('sent', 'cancelled', 'failed'))
                 OR OLD.order_skipped_at IS DISTINCT FROM NEW.order_skipped_at))
        EXECUTE FUNCTION outbox_message_ordering_wake()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS outbox_message_ordering_wake ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_message_ordering_wake()")
    op.execute("DROP TRIGGER IF EXISTS outbox_message_ordering_serialize ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_message_ordering_serialize()")
    op.drop_column("outbox_message", "order_skipped_at")
    op.drop_column("outbox_message", "skip_when_failed")
    op.drop_column("outbox_message", "ordering_key")
