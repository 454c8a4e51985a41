"""Flow control, part 3: a row's priority and fairness key, which order the relay's take of a
limited destination (outbox.windows).

* ``outbox_message.priority`` (smallint, 1 high, 0 normal, -1 low; default 0) and
  ``outbox_message.fairness_key`` (text, NULL: none). ``outbox.write(priority=,
  fairness_key=)`` sets them; a next step (``Next``) and a batch's then/catch row inherit them;
  a replay keeps them (it moves the same row).
* CHECKs added NOT VALID, then validated: the validation reads the table under a lock that lets
  writes through (SHARE UPDATE EXCLUSIVE).

A constant default and a nullable column: no table rewrite. The previous release neither reads
nor writes them: its rows are normal, without a fairness key, and its relay takes every
destination's rows oldest first, as it always did. The indexes are 0026's (concurrently).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "outbox_message",
        sa.Column("priority", sa.SmallInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column("outbox_message", sa.Column("fairness_key", sa.Text(), nullable=True))
    op.execute(
        "ALTER TABLE outbox_message ADD CONSTRAINT outbox_message_priority_check "
        "CHECK (priority IN (-1, 0, 1)) NOT VALID"
    )
    op.execute("ALTER TABLE outbox_message VALIDATE CONSTRAINT outbox_message_priority_check")
    op.execute(
        "ALTER TABLE outbox_message ADD CONSTRAINT outbox_message_fairness_key_check "
        "CHECK (fairness_key IS NULL OR char_length(fairness_key) BETWEEN 1 AND 200) NOT VALID"
    )
    op.execute("ALTER TABLE outbox_message VALIDATE CONSTRAINT outbox_message_fairness_key_check")


def downgrade() -> None:
    op.drop_constraint("outbox_message_fairness_key_check", "outbox_message")
    op.drop_constraint("outbox_message_priority_check", "outbox_message")
    op.drop_column("outbox_message", "fairness_key")
    op.drop_column("outbox_message", "priority")
