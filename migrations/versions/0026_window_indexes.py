"""Flow control: the indexes of the relay's dispatch window (outbox.windows).

* ``outbox_message_windowed_idx`` (destination) of ``dispatched`` rows that a window published
  (``windowed``, 0025): a limited destination's window counts them without reading every
  destination's published rows, and a row the relay's other take publishes writes no entry
  (an index of every published row cost the relay's drain 15-24 % of its rows a second).
* ``outbox_message_fair_idx`` (destination, priority, fairness key or '', available_at, id) of
  ``pending`` rows: the windowed take reads the head of each priority and fairness key of one
  destination without reading a large tenant's backlog. Every row is in it while pending (one
  index entry more per row written; a partial index of rows with a key or a priority would
  leave the take reading the whole backlog to find the others).

A revision of its own, after 0025's columns: an interrupted concurrent build is simply run again
(see 0011). The code works without them, only slower (SCHEMA_OLDEST stays 0025).

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_index_concurrently(
        op,
        "outbox_message_windowed_idx",
        "outbox_message",
        ["destination"],
        postgresql_where=sa.text("state = 'dispatched' AND windowed"),
    )
    create_index_concurrently(
        op,
        "outbox_message_fair_idx",
        "outbox_message",
        ["destination", "priority", sa.text("COALESCE(fairness_key, '')"), "available_at", "id"],
        postgresql_where=sa.text("state = 'pending'"),
    )


def downgrade() -> None:
    # Not CONCURRENTLY: a downgrade runs in the migration's transaction, and the drops are brief.
    op.drop_index("outbox_message_fair_idx", table_name="outbox_message", if_exists=True)
    op.drop_index("outbox_message_windowed_idx", table_name="outbox_message", if_exists=True)
