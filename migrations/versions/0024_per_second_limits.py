"""Flow control: a destination's calls per second, paced at the claim by the database.

* ``outbox_destination`` gains the operator's rate (``outbox limit D --per-second R``):
  ``limit_per_second`` (calls a second, > 0; the reason, who and when are the in-flight limit's
  columns, one set for the destination's limits), ``declared_per_second`` (the hint that live
  processes' handlers declare ``max_calls_per_second``, as ``declared_in_flight`` is for
  ``max_in_flight``) and ``last_call_at``: the latest start booked so far (the next may be no
  earlier than 1/rate after it: a GCRA scheduler, with no burst). The last start is kept, not
  the next one, so that a new rate spaces the very next start: after a slow rate, a faster one
  would otherwise wait out the slow rate's period. ``outbox_process.declared_per_second``
  holds what each process declares.

* ``outbox_message.call_at``: when the claimed call may start, set by the trigger on a claim of a
  paced destination (NULL otherwise). The worker waits until then before it calls. This
  release's claim sets it first to the latest start it accepts (its handler's start bound
  leaves that much room), which the trigger reads and replaces.

* ``outbox_message_in_flight_limit`` (0023's trigger function, replaced): after the in-flight
  check, a paced destination's claim books the next start: ``greatest(last_call_at + 1 / rate,
  now + lead)`` (the lead, 0.1 s at most, lets the claim's reply arrive before the start), and
  records it in ``last_call_at``. A start later than the claim accepts
  refuses the claim instead, so a claimed row never waits past its call's start bound: the
  claim's ``call_at`` when it set one (at most a second ahead), else (an older release's claim)
  a second or a quarter of its lease, whichever is shorter. Starts are spaced 1/rate apart
  whichever process claims, so no one-second window holds more than rate + 1 booked starts;
  a group claim books one start per row, in order. A killed process's booked start passes
  unused; nothing is held for it.

  Enforced, not gated: a worker of an older release claims through the same trigger; it does not
  wait for ``call_at``, so during a rolling deploy its calls may start up to PACE_AHEAD early
  (docs/flow-control.md says what that allows). Its refused claim is acked, and the row waits
  ``dispatched`` for the reconciler's re-dispatch, as for the in-flight limit.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

# heartbeat.LIVE as it stands: a process heard from within three of its intervals plus 5 s.
_LIVE = "p.stopped_at IS NULL AND p.last_seen_at > now() - (p.interval_seconds * 3 + 5) * interval '1 second'"

_CALLS_IN_FLIGHT = """((
        SELECT count(*) FROM outbox_message
        WHERE destination = NEW.destination AND state = 'in_flight'
    ) + (
        SELECT count(*) FROM outbox_message
        WHERE destination = NEW.destination AND state = 'unknown'
          AND available_at > now() AND landing_until > now()
    ))"""

# The latest start a claim accepts: what this release's claim set in call_at (an older release's
# claim leaves the old row's value there), else a second or a quarter of its lease, whichever is
# shorter. NEW.lease_expires_at - NEW.claimed_at is the claim's lease (any release's claim sets
# both).
_LATEST_START = """CASE WHEN NEW.call_at IS DISTINCT FROM OLD.call_at THEN NEW.call_at
        ELSE clock_timestamp()
             + least(interval '1 second', (NEW.lease_expires_at - NEW.claimed_at) / 4) END"""

# A start is booked a little ahead of now (0.1 s, or a quarter of what the claim accepts if
# less), so that the claim's reply reaches its worker before the start: a call started late
# shares its second with the next ones on time, and the first calls after an idle spell, which
# find every worker's thread cold, are the latest. Under load the booked starts run ahead anyway.
_LEAD = "least(interval '0.1 second', (latest - clock_timestamp()) / 4)"

# The hints (declared_*) say only that some process declared a limit; the lowest live one is
# read here, under the lock (0023). Each statement of a plpgsql function takes its own snapshot:
# what follows the lock sees every claim committed before it was granted. The booking's UPDATE
# is a statement of its own, after the claim statement's breaker probe (which the claim's WHERE
# reads before its row reaches this trigger).
_LIMITS = f"""
CREATE OR REPLACE FUNCTION outbox_message_in_flight_limit() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    cap integer;
    declared integer;
    rate float8;
    declared_rate float8;
    last_at timestamptz;
    slot timestamptz;
    latest timestamptz;
BEGIN
    SELECT limit_in_flight, declared_in_flight, limit_per_second, declared_per_second
    INTO cap, declared, rate, declared_rate
    FROM outbox_destination WHERE destination = NEW.destination;
    IF cap IS NULL AND declared IS NULL AND rate IS NULL AND declared_rate IS NULL THEN
        NEW.call_at := NULL;
        RETURN NEW;
    END IF;
    latest := {_LATEST_START};
    NEW.call_at := NULL;
    SELECT limit_in_flight, declared_in_flight, limit_per_second, declared_per_second, last_call_at
    INTO cap, declared, rate, declared_rate, last_at
    FROM outbox_destination WHERE destination = NEW.destination FOR NO KEY UPDATE;
    IF cap IS NULL AND declared IS NOT NULL THEN
        SELECT min(CAST(p.declared_in_flight ->> NEW.destination AS integer)) INTO cap
        FROM outbox_process p
        WHERE p.declared_in_flight ? NEW.destination AND {_LIVE};
    END IF;
    IF cap IS NOT NULL AND {_CALLS_IN_FLIGHT} >= cap THEN
        RETURN NULL;
    END IF;
    IF rate IS NULL AND declared_rate IS NOT NULL THEN
        SELECT min(CAST(p.declared_per_second ->> NEW.destination AS float8)) INTO rate
        FROM outbox_process p
        WHERE p.declared_per_second ? NEW.destination AND {_LIVE};
    END IF;
    IF rate IS NOT NULL THEN
        slot := greatest(last_at + interval '1 second' / rate, clock_timestamp() + {_LEAD});
        IF slot > latest THEN
            RETURN NULL;
        END IF;
        UPDATE outbox_destination SET last_call_at = slot WHERE destination = NEW.destination;
        NEW.call_at := slot;
    END IF;
    RETURN NEW;
END
$$
"""

# 0023's function, for the downgrade.
_IN_FLIGHT_ONLY = f"""
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
    SELECT limit_in_flight INTO cap
    FROM outbox_destination WHERE destination = NEW.destination FOR NO KEY UPDATE;
    IF cap IS NULL THEN
        SELECT min(CAST(p.declared_in_flight ->> NEW.destination AS integer)) INTO cap
        FROM outbox_process p
        WHERE p.declared_in_flight ? NEW.destination AND {_LIVE};
    END IF;
    IF cap IS NOT NULL AND {_CALLS_IN_FLIGHT} >= cap THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
"""

#: The rates accepted (settings.MIN_CALLS_PER_SECOND, MAX_CALLS_PER_SECOND): one call in about
#: 17 minutes at least, so that a period is always a valid interval.
_MIN_PER_SECOND = 0.001
_MAX_PER_SECOND = 1_000_000


def upgrade() -> None:
    for column in ("limit_per_second", "declared_per_second"):
        op.add_column("outbox_destination", sa.Column(column, postgresql.DOUBLE_PRECISION(), nullable=True))
    op.add_column("outbox_destination", sa.Column("last_call_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("outbox_process", sa.Column("declared_per_second", postgresql.JSONB(), nullable=True))
    op.add_column("outbox_message", sa.Column("call_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        "outbox_destination_limit_per_second_check",
        "outbox_destination",
        " AND ".join(
            f"({c} IS NULL OR ({c} >= {_MIN_PER_SECOND} AND {c} <= {_MAX_PER_SECOND}))"
            for c in ("limit_per_second", "declared_per_second")
        ),
    )
    op.execute(_LIMITS)


def downgrade() -> None:
    op.execute(_IN_FLIGHT_ONLY)
    op.drop_constraint("outbox_destination_limit_per_second_check", "outbox_destination")
    op.drop_column("outbox_message", "call_at")
    op.drop_column("outbox_process", "declared_per_second")
    for column in ("last_call_at", "declared_per_second", "limit_per_second"):
        op.drop_column("outbox_destination", column)
