"""Flow control: a destination's in-flight limit, enforced at the claim by the database.

* ``outbox_destination`` gains the operator's limit (``outbox limit D --in-flight N``):
  ``limit_in_flight`` (calls, > 0), ``limit_reason``, ``limit_set_by``, ``limit_set_at``; and
  ``declared_in_flight``, set by the heartbeats of this release's workers whose handlers declare
  ``max_in_flight`` (the lowest they saw): a hint that the claim must look for declarations.
  ``outbox_process.declared_in_flight`` (new here) holds what each process declares (an older
  release's beat leaves it NULL). The limit that holds: the operator's, else the lowest that a
  live process declares, read by the trigger itself.

* ``outbox_message_in_flight_limit``, a BEFORE UPDATE trigger on the claim (pending/dispatched ->
  in_flight, restricted by ``WHEN``): when the row's destination has a limit (or a declaration
  hint), it locks the destination's row, reads the limit that holds, counts the destination's
  calls in flight (rows ``in_flight``, and rows whose lease expired while the wait before their
  first lookup lasts: such a call may still land) on a snapshot taken after that lock, and refuses the claim
  (returns NULL: the statement moves nothing) when the count has reached the limit. The lock
  serialises the claims of a limited destination until each commits, so two claims cannot both
  take the last slot; a later row of the same group claim sees the rows its statement claimed
  before it (a row-level BEFORE trigger does). Destinations without a limit pay one primary-key
  read of their row per claim, no lock.

  Enforced, not gated: a worker of an older release claims through the same trigger. It reads a
  refused claim as "someone else moved it", acks its message and leaves the row ``dispatched``,
  which the reconciler re-queues after ``OUTBOX_REDISPATCH_AFTER``: later, never lost. A worker of
  this release waits for a free slot instead, its message not acked (outbox.consumer).

* ``outbox_message.landing_until``: until when an unknown row's call may still land at the
  provider (set by this release's lease expiry and by its record of an ambiguous outcome, to the
  first lookup's due time); the trigger counts such rows as in flight until then. An older
  release's reconciler or worker leaves it NULL: their unknown rows are not counted.

* No index of its own: the count reads ``outbox_message_in_flight_idx`` (every row in flight,
  of any destination; a few thousand at most), where an index by destination cost every claim of
  every destination one more index entry (more WAL at every delivery).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# heartbeat.LIVE as it stands: a process heard from within three of its intervals plus 5 s.
_LIVE = "p.stopped_at IS NULL AND p.last_seen_at > now() - (p.interval_seconds * 3 + 5) * interval '1 second'"

# The calls of a destination that may be under way at its provider: rows in flight, and unknown
# rows until their landing_until (the wait before their first lookup, set with it where a call
# may still land: a lease that expired, a call that timed out); available_at, which that wait
# set to the same instant, lets the count use the unknown rows' index.
_CALLS_IN_FLIGHT = """((
        SELECT count(*) FROM outbox_message
        WHERE destination = {destination} AND state = 'in_flight'
    ) + (
        SELECT count(*) FROM outbox_message
        WHERE destination = {destination} AND state = 'unknown'
          AND available_at > now() AND landing_until > now()
    ))"""

_NEW_ROWS_CALLS = _CALLS_IN_FLIGHT.format(destination="NEW.destination")

# declared_in_flight on the destination's row only says that some process declared a limit: the
# lowest live declaration is read here, under the lock, so a declaring process that stopped or
# went quiet stops holding the limit whoever beats (an older release's processes do not
# recompute the hint), and two first beats racing cannot leave the higher value in force.
_IN_FLIGHT_LIMIT = f"""
CREATE OR REPLACE FUNCTION outbox_message_in_flight_limit() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    cap integer;
    declared integer;
BEGIN
    SELECT limit_in_flight, declared_in_flight INTO cap, declared
    FROM outbox_destination WHERE destination = NEW.destination;
    IF cap IS NULL AND declared IS NULL THEN
        RETURN NEW;
    END IF;
    -- Each statement of a plpgsql function takes its own snapshot: what follows sees every
    -- claim committed before this lock was granted.
    SELECT limit_in_flight INTO cap
    FROM outbox_destination WHERE destination = NEW.destination FOR NO KEY UPDATE;
    IF cap IS NULL THEN
        SELECT min(CAST(p.declared_in_flight ->> NEW.destination AS integer)) INTO cap
        FROM outbox_process p
        WHERE p.declared_in_flight ? NEW.destination AND {_LIVE};
    END IF;
    IF cap IS NOT NULL AND {_NEW_ROWS_CALLS} >= cap THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
"""


def upgrade() -> None:
    op.add_column("outbox_destination", sa.Column("limit_in_flight", sa.Integer(), nullable=True))
    op.add_column("outbox_destination", sa.Column("limit_reason", sa.Text(), nullable=True))
    op.add_column("outbox_destination", sa.Column("limit_set_by", sa.Text(), nullable=True))
    op.add_column("outbox_destination", sa.Column("limit_set_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("outbox_destination", sa.Column("declared_in_flight", sa.Integer(), nullable=True))
    op.add_column("outbox_process", sa.Column("declared_in_flight", postgresql.JSONB(), nullable=True))
    op.add_column("outbox_message", sa.Column("landing_until", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        "outbox_destination_limit_in_flight_check",
        "outbox_destination",
        "(limit_in_flight IS NULL OR limit_in_flight > 0)"
        " AND (declared_in_flight IS NULL OR declared_in_flight > 0)",
    )
    op.execute(_IN_FLIGHT_LIMIT)
    op.execute(
        """
        CREATE TRIGGER outbox_message_in_flight_limit
        BEFORE UPDATE ON outbox_message FOR EACH ROW
        WHEN (NEW.state = 'in_flight' AND OLD.state IN ('pending', 'dispatched'))
        EXECUTE FUNCTION outbox_message_in_flight_limit()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS outbox_message_in_flight_limit ON outbox_message")
    op.execute("DROP FUNCTION IF EXISTS outbox_message_in_flight_limit()")
    op.drop_constraint("outbox_destination_limit_in_flight_check", "outbox_destination")
    op.drop_column("outbox_process", "declared_in_flight")
    op.drop_column("outbox_message", "landing_until")
    for column in ("declared_in_flight", "limit_set_at", "limit_set_by", "limit_reason", "limit_in_flight"):
        op.drop_column("outbox_destination", column)
