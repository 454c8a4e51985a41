"""Flow control: a row's priority and fairness key, which order the relay's take of a
limited destination (outbox.windows).

* ``outbox_message.priority`` (smallint, 1 high, 0 normal, -1 low; default 0) and
  ``outbox_message.fairness_key`` (text, NULL: none). ``outbox.write(priority=,
  fairness_key=)`` sets them; a next step (``Next``) and a batch's then/catch row inherit them;
  a replay keeps them (it moves the same row).
* ``outbox_message.windowed``: set by the relay's window take (outbox.windows), so that a
  window counts the rows it published along a partial index of those rows alone (0026): the
  take of every other row writes no index entry more.
* CHECKs added NOT VALID, then validated: the validation reads the table under a lock that lets
  writes through (SHARE UPDATE EXCLUSIVE).

* Feature ``fairness`` (outbox.features), gated: a relay older than 0025 would publish a limited
  destination's rows oldest first, past its window and its priority and fairness turns. Until
  an operator runs ``outbox features enable fairness`` (refused while a process older than 0025
  is live), a BEFORE INSERT OR UPDATE OF priority, fairness_key trigger refuses a row with a
  priority other than normal or a fairness key (SQLSTATE OB001; ``outbox.write`` raises
  ``FeatureNotEnabled``), whoever writes it; next steps inherit only from rows that have them,
  so they pass. A database migrated with no live process has it on at once, without raising
  the floor (unlike ``outbox features enable``): a release rolled back to afterwards still
  starts, and its relay publishes in due order, which loses the order of the turns, never a row.

A constant default and a nullable column: no table rewrite. The previous release neither reads
nor writes them: its rows are normal, without a fairness key. The indexes are 0026's
(concurrently).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import forget_code_requirement

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


# Refuses a row that uses the feature while it is off (the trigger's WHEN picks those rows).
_GATE = """
CREATE OR REPLACE FUNCTION outbox_fairness_gate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_feature WHERE name = 'fairness') THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'priority and fairness keys are not enabled on this database: row %',
        NEW.key || ':' || NEW.step
        USING ERRCODE = 'OB001',
              HINT = 'once no process older than revision 0025 runs: outbox features enable fairness';
END
$$
"""

# heartbeat.LIVE as it stands: a process heard from within three of its intervals plus 5 s; and
# the relays, workers and reconcilers that hold a failover connection (older relays do not beat).
_LIVE = "stopped_at IS NULL AND last_seen_at > now() - (interval_seconds * 3 + 5) * interval '1 second'"
_NO_PROCESS = f"""NOT EXISTS (SELECT 1 FROM outbox_process WHERE {_LIVE})
    AND NOT EXISTS (SELECT 1 FROM pg_stat_activity
                    WHERE datname = current_database() AND application_name LIKE 'outbox-failover%%')"""


def upgrade() -> None:
    op.add_column(
        "outbox_message",
        sa.Column("priority", sa.SmallInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column("outbox_message", sa.Column("fairness_key", sa.Text(), nullable=True))
    op.add_column(
        "outbox_message", sa.Column("windowed", sa.Boolean(), nullable=False, server_default=sa.text("false"))
    )
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
    op.execute(_GATE)
    op.execute(
        """
        CREATE TRIGGER outbox_message_fairness_gate
        BEFORE INSERT OR UPDATE OF priority, fairness_key ON outbox_message
        FOR EACH ROW WHEN (NEW.priority <> 0 OR NEW.fairness_key IS NOT NULL)
        EXECUTE FUNCTION outbox_fairness_gate()
        """
    )
    op.execute(
        f"""
        INSERT INTO outbox_feature (name, needs_code, enabled_by, reason)
        SELECT 'fairness', '0025', 'migration 0025', 'no live process at migration'
        WHERE {_NO_PROCESS}
        """
    )


def downgrade() -> None:
    forget_code_requirement(op, migration="feature:fairness")
    op.execute("DELETE FROM outbox_feature WHERE name = 'fairness'")
    op.execute("DROP TRIGGER IF EXISTS outbox_message_fairness_gate ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_fairness_gate()")
    op.drop_constraint("outbox_message_fairness_key_check", "outbox_message")
    op.drop_constraint("outbox_message_priority_check", "outbox_message")
    op.drop_column("outbox_message", "windowed")
    op.drop_column("outbox_message", "fairness_key")
    op.drop_column("outbox_message", "priority")
