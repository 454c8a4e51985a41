"""SQLAlchemy table metadata, the single description the migrations are checked against.

The invariants live here, not in Python: one row per business operation (unique ``key, step``),
a closed set of states (CHECK), ``sent`` rows always carry the provider's reference, and one
partial index per sweeper so that each of them reads only the rows it may move.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from . import states

#: NOTIFY channel of the statement-level insert trigger; the relay LISTENs on it.
NOTIFY_CHANNEL = "outbox_message"

#: Alembic keeps its revision in a table of its own so that it never collides with the
#: application's own Alembic history in the same database.
VERSION_TABLE = "outbox_alembic_version"

metadata = MetaData()

_state_list = ", ".join(f"'{s}'" for s in states.ALL)

outbox_message = Table(
    "outbox_message",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("key", Text, nullable=False),
    Column("step", Text, nullable=False),
    Column("destination", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    # When the row is next due: publication for pending rows, the next lookup for unknown rows.
    Column("available_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("deadline", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("dispatched_at", DateTime(timezone=True), nullable=True),
    Column("claimed_at", DateTime(timezone=True), nullable=True),
    Column("lease_expires_at", DateTime(timezone=True), nullable=True),
    Column("completed_at", DateTime(timezone=True), nullable=True),
    # Set when the row entered `unknown`; the alert threshold is measured from it.
    Column("unknown_since", DateTime(timezone=True), nullable=True),
    # Set when the alert hook reported this row (failed, or unknown for too long); reset by replay.
    Column("alerted_at", DateTime(timezone=True), nullable=True),
    Column("claim_token", UUID(as_uuid=True), nullable=True),
    Column("provider_ref", Text, nullable=True),
    Column("response", JSONB, nullable=True),
    Column("last_error", Text, nullable=True),
    # Operator actions (replay, resolve): who, when, why. Never the payload.
    Column("history", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    UniqueConstraint("key", "step", name="outbox_message_key_step_key"),
    CheckConstraint(f"state IN ({_state_list})", name="outbox_message_state_check"),
    CheckConstraint("attempts >= 0", name="outbox_message_attempts_check"),
    CheckConstraint("char_length(key) > 0 AND char_length(step) > 0", name="outbox_message_key_step_check"),
    CheckConstraint("state <> 'sent' OR provider_ref IS NOT NULL", name="outbox_message_sent_ref_check"),
    CheckConstraint(
        "state <> 'in_flight' OR (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="outbox_message_in_flight_check",
    ),
)

# One partial index per sweeper.
Index(
    "outbox_message_pending_idx",
    outbox_message.c.available_at,
    outbox_message.c.id,
    postgresql_where=text("state = 'pending'"),
)
Index(
    "outbox_message_in_flight_idx",
    outbox_message.c.lease_expires_at,
    postgresql_where=text("state = 'in_flight'"),
)
Index(
    "outbox_message_dispatched_idx",
    outbox_message.c.dispatched_at,
    postgresql_where=text("state = 'dispatched'"),
)
Index(
    "outbox_message_unknown_idx",
    outbox_message.c.available_at,
    postgresql_where=text("state = 'unknown'"),
)
Index(
    "outbox_message_failed_idx",
    outbox_message.c.destination,
    postgresql_where=text("state = 'failed'"),
)
Index(
    "outbox_message_purge_idx",
    outbox_message.c.completed_at,
    postgresql_where=text("state IN ('sent', 'cancelled')"),
)

outbox_attempt = Table(
    "outbox_attempt",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column(
        "message_id",
        BigInteger,
        ForeignKey("outbox_message.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("attempt", Integer, nullable=False),
    Column("claim_token", UUID(as_uuid=True), nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    # What the consumer concluded (sent, retry, failed, unknown, or released: given back without
    # a call) or what the reconciler did (lease_expired); `superseded` when a late recording lost
    # to a newer claim.
    Column("outcome", Text, nullable=True),
    Column("http_status", Integer, nullable=True),
    Column("error", Text, nullable=True),
    UniqueConstraint("claim_token", name="outbox_attempt_claim_token_key"),
)
Index("outbox_attempt_message_idx", outbox_attempt.c.message_id)

# -- 0002_lease (issue 9 classes 1, 2, 8) ---------------------------------------------------------
# Claims given back without a call (outcome `released` on their fence row): not attempts, but a
# row released again and again is held by something an operator must find.
outbox_message.append_column(
    Column("releases", Integer, nullable=False, server_default=text("0")),
)
outbox_message.append_constraint(CheckConstraint("releases >= 0", name="outbox_message_releases_check"))
