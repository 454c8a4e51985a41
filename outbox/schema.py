"""SQLAlchemy table metadata, the single description the migrations are checked against.

The invariants live here, not in Python: one row per business operation (unique ``key, step``),
a closed set of states (CHECK), ``sent`` rows always carry the provider's reference, and one
partial index per sweeper so that each of them reads only the rows it may move.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, DOUBLE_PRECISION, JSONB, UUID

from . import states

#: NOTIFY channel of the statement-level insert trigger; the relay LISTENs on it.
NOTIFY_CHANNEL = "outbox_message"

#: Alembic keeps its revision in a table of its own so that it never collides with the
#: application's own Alembic history in the same database.
VERSION_TABLE = "outbox_alembic_version"
#: Written by "contract" migrations (``outbox.migrations.helpers.require_code_from``) and by
#: ``outbox features enable``: the oldest code, named by the newest revision it knows, that may
#: still run on the database.
FLOOR_TABLE = "outbox_schema_floor"

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
    # The writer's trace context (propagation fields, e.g. traceparent), with OpenTelemetry only.
    Column("trace_context", JSONB, nullable=True),
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
# Rows of a held-back destination whose deadline passes (migration 0011).
Index(
    "outbox_message_deadline_idx",
    outbox_message.c.deadline,
    postgresql_where=text("state IN ('pending', 'dispatched') AND deadline IS NOT NULL"),
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

# -- 0002_lease: claims given back without a call -------------------------------------------------
# Claims given back without a call (outcome `released` on their attempt row): not attempts, but a
# row released again and again is held by something an operator must find.
outbox_message.append_column(
    Column("releases", Integer, nullable=False, server_default=text("0")),
)
outbox_message.append_constraint(CheckConstraint("releases >= 0", name="outbox_message_releases_check"))

# -- key ledger (migration 0003) -------------------------------------------------------------------
# One compact row per purged (key, step), kept for OUTBOX_LEDGER_HORIZON after completed_at, so
# that writing the key again answers as it did before the purge. The BEFORE INSERT trigger
# `outbox_message_key_guard` (created by the migration) keeps live rows and ledger entries unique.

outbox_key_ledger = Table(
    "outbox_key_ledger",
    metadata,
    # The purged row's id: `write` answers `created=False` with it, `KeyConflict` names it.
    Column("message_id", BigInteger, nullable=False),
    Column("completed_at", DateTime(timezone=True), nullable=False),
    # Attempt rows (claims) the row had, and how many of them the provider confirmed.
    Column("attempts", Integer, nullable=False),
    Column("confirmed", Integer, nullable=False),
    # An attempt ended unknown / lease_expired (or never recorded), or an operator resolved it
    # out of `unknown`: the provider may hold an effect the attempt rows do not prove.
    Column("ambiguous", Boolean, nullable=False),
    Column("key", Text, nullable=False),
    Column("step", Text, nullable=False),
    Column("destination", Text, nullable=False),
    # outbox_payload_digest(payload): SHA-256 of the jsonb's canonical text, numbers' trailing
    # zeros trimmed, computed by PostgreSQL (key order, whitespace, 10 vs 10.0 do not matter).
    Column("payload_hash", LargeBinary, nullable=False),
    Column("state", Text, nullable=False),
    Column("provider_ref", Text, nullable=True),
    PrimaryKeyConstraint("key", "step", name="outbox_key_ledger_pkey"),
    CheckConstraint("state IN ('sent', 'failed', 'cancelled')", name="outbox_key_ledger_state_check"),
)
# The horizon drop deletes by age in batches along this index.
Index("outbox_key_ledger_completed_idx", outbox_key_ledger.c.completed_at)

# -- 0004_replay: how an ambiguous call was settled (see outbox.outcomes) -------------------------
outbox_attempt.append_column(Column("settled", Text, nullable=True))
outbox_attempt.append_column(Column("settled_at", DateTime(timezone=True), nullable=True))
outbox_attempt.append_constraint(
    CheckConstraint(
        "settled IS NULL OR (settled IN ('lookup_not_found', 'operator_not_sent', 'operator_forced', "
        "'idempotent_retry') AND settled_at IS NOT NULL)",
        name="outbox_attempt_settled_check",
    )
)

# -- transport (migration 0005) --------------------------------------------------------------------

#: One row per running outbox process (workers beat; see ``outbox.heartbeat``): what it serves,
#: when the database last heard from it, and its own clock at that moment (skew = the difference).
outbox_process = Table(
    "outbox_process",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("kind", Text, nullable=False),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queues", ARRAY(Text), nullable=False, server_default=text("'{}'")),
    Column("interval_seconds", DOUBLE_PRECISION, nullable=False),
    # Database clock, both.
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("last_seen_at", DateTime(timezone=True), nullable=False),
    # The process's own clock when it sent its last beat.
    Column("process_clock", DateTime(timezone=True), nullable=False),
    Column("stopped_at", DateTime(timezone=True), nullable=True),
    # The schema range the process's code accepts (migration 0022; outbox.features): NULL on the
    # beats of older releases, which count as older than every feature.
    Column("schema_oldest", Text, nullable=True),
    Column("schema_newest", Text, nullable=True),
)

#: The features an operator enabled (``outbox features enable``; outbox.features): a feature an
#: older running process would break stays refused by the database until it is listed here.
#: ``needs_code``: the revision its code needs, also written to the floor when enabled.
outbox_feature = Table(
    "outbox_feature",
    metadata,
    Column("name", Text, primary_key=True),
    Column("needs_code", Text, nullable=False),
    Column("enabled_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("enabled_by", Text, nullable=False),
    Column("reason", Text, nullable=True),
)

#: One row per destination with rows waiting and no live process serving its queue, kept by the
#: reconciler's ``no_consumer`` job: the episode starts at ``since`` and ends (row deleted) when a
#: consumer appears or nothing waits any more; ``alerted_at`` makes the alert once per episode.
outbox_no_consumer = Table(
    "outbox_no_consumer",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("since", DateTime(timezone=True), nullable=False),
    Column("cycles", Integer, nullable=False),
    Column("rows_waiting", BigInteger, nullable=False),
    Column("alerted_at", DateTime(timezone=True), nullable=True),
)

# -- migration 0009: paused destinations ---------------------------------------------------------

#: A destination is paused while ``paused_until`` is in the future (``infinity``: until resumed);
#: written by ``outbox pause`` / ``outbox resume`` (outbox.pauses), read by every claim.
outbox_destination = Table(
    "outbox_destination",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("paused_until", DateTime(timezone=True), nullable=True),
    Column("paused_at", DateTime(timezone=True), nullable=True),
    Column("paused_by", Text, nullable=True),
    Column("pause_reason", Text, nullable=True),
    Column("resumed_at", DateTime(timezone=True), nullable=True),
    Column("resumed_by", Text, nullable=True),
    CheckConstraint("paused_until IS NULL OR paused_at IS NOT NULL", name="outbox_destination_paused_check"),
)

# -- migration 0010: the circuit breaker of each destination (outbox.breaker) ---------------------

# The consecutive "not processed" outcomes counted since breaker_window_at (the worker).
outbox_destination.append_column(
    Column("breaker_failures", Integer, nullable=False, server_default=text("0"))
)
outbox_destination.append_column(Column("breaker_window_at", DateTime(timezone=True), nullable=True))
# Open while set (the worker trips it; the probe's worker or `outbox resume` closes it).
outbox_destination.append_column(Column("breaker_opened_at", DateTime(timezone=True), nullable=True))
# No claim before this; after it, one probe (half-open).
outbox_destination.append_column(Column("breaker_open_until", DateTime(timezone=True), nullable=True))
outbox_destination.append_column(Column("breaker_open_seconds", DOUBLE_PRECISION, nullable=True))
# The probe's claim token, reserved by that claim until breaker_probe_until (its lease).
outbox_destination.append_column(Column("breaker_probe_token", UUID(as_uuid=True), nullable=True))
outbox_destination.append_column(Column("breaker_probe_until", DateTime(timezone=True), nullable=True))
# Probes in the current (or last) episode; trips ever.
outbox_destination.append_column(Column("breaker_probes", Integer, nullable=False, server_default=text("0")))
outbox_destination.append_column(Column("breaker_reason", Text, nullable=True))
outbox_destination.append_column(Column("breaker_trips", Integer, nullable=False, server_default=text("0")))
outbox_destination.append_column(Column("breaker_closed_at", DateTime(timezone=True), nullable=True))
# The episode's start, kept by a trip that follows a close within outbox.pauses.EPISODE_GAP_SECONDS.
outbox_destination.append_column(Column("breaker_since", DateTime(timezone=True), nullable=True))
# When the reconciler's `held_destinations` job alerted the current pause / breaker episode.
outbox_destination.append_column(Column("pause_alerted_at", DateTime(timezone=True), nullable=True))
outbox_destination.append_column(Column("breaker_alerted_at", DateTime(timezone=True), nullable=True))
outbox_destination.append_constraint(
    CheckConstraint(
        "breaker_opened_at IS NULL OR (breaker_open_until IS NOT NULL AND breaker_open_seconds > 0)",
        name="outbox_destination_breaker_check",
    )
)

# -- migration 0006: failover detection -------------------------------------------------------------

#: The database history (system identifier, timeline) the outbox last ran on, one row; written
#: by the first process and by `outbox failover --accept`, compared by outbox.failover.
outbox_db_identity = Table(
    "outbox_db_identity",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("system_identifier", Text, nullable=True),
    Column("timeline", Integer, nullable=True),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("recorded_by", Text, nullable=False),
    Column("note", Text, nullable=True),
    # Set by the first process that saw the server on another history; cleared by --accept.
    Column("mismatch_seen_at", DateTime(timezone=True), nullable=True),
    Column("mismatch", Text, nullable=True),
    CheckConstraint("id = 1", name="outbox_db_identity_one_row_check"),
)

# -- migrations 0012, 0013: chains -----------------------------------------------------------------

#: The row whose settlement wrote this one in the same statement (outbox.chains): its ``sent``
#: (``via = 'then'``) or its certain failure (``via = 'on_failure'``). No foreign key: a parent is
#: purged to the key ledger before its children may be.
for _table in (outbox_message, outbox_key_ledger):
    _table.append_column(Column("parent_id", BigInteger, nullable=True))
    _table.append_column(Column("via", Text, nullable=True))
    _table.append_constraint(
        CheckConstraint(
            "via IS NULL OR via IN ('then', 'on_failure', 'batch_then', 'batch_catch')",
            name=f"{_table.name}_via_check",
        )
    )
#: Why a settled row's declared next steps were not all written (the function raised, a step
#: exists with another payload): alerted once by the reconciler, cleared by ``outbox repair``.
outbox_message.append_column(Column("chain_problem", Text, nullable=True))
Index(
    "outbox_message_chain_problem_idx",
    outbox_message.c.id,
    postgresql_where=text("chain_problem IS NOT NULL AND alerted_at IS NULL"),
)

# -- migrations 0014, 0015: batches (outbox.batches) ---------------------------------------------

#: A group of rows written in one transaction (``created_txid``: only that transaction adds
#: members); when every member is terminal, the reconciler's ``batches`` job writes its
#: ``then_step`` (none failed) or its ``catch_step`` (any failed) as row ``(name, step)`` and sets
#: ``finished_at``/``outcome`` and the counts, in one guarded statement, once.
outbox_batch = Table(
    "outbox_batch",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("name", Text, nullable=False),
    Column("then_step", JSONB, nullable=True),
    Column("catch_step", JSONB, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("created_txid", BigInteger, nullable=False, server_default=text("txid_current()")),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("outcome", Text, nullable=True),
    Column("total", Integer, nullable=True),
    Column("sent", Integer, nullable=True),
    Column("failed", Integer, nullable=True),
    Column("cancelled", Integer, nullable=True),
    #: The then/catch row the finish wrote; ``problem`` says why none was (its key exists).
    Column("written_id", BigInteger, nullable=True),
    Column("problem", Text, nullable=True),
    CheckConstraint("char_length(name) > 0", name="outbox_batch_name_check"),
    CheckConstraint(
        "(finished_at IS NULL AND outcome IS NULL)"
        " OR (finished_at IS NOT NULL AND outcome IN ('then', 'catch'))",
        name="outbox_batch_outcome_check",
    ),
    UniqueConstraint("name", name="outbox_batch_name_key"),
)
Index("outbox_batch_open_idx", outbox_batch.c.id, postgresql_where=text("finished_at IS NULL"))
# Migration 0021: the purge's way to finished batches, oldest finish first (those that still
# carry a then/catch payload; all of them).
Index(
    "outbox_batch_payload_idx",
    outbox_batch.c.finished_at,
    postgresql_where=text("finished_at IS NOT NULL AND (then_step ? 'payload' OR catch_step ? 'payload')"),
)
Index(
    "outbox_batch_finished_idx", outbox_batch.c.finished_at, postgresql_where=text("finished_at IS NOT NULL")
)
#: The batch the row belongs to (outbox.batches); NULL for most rows. The ledger keeps it.
outbox_message.append_column(Column("batch_id", BigInteger, nullable=True))
outbox_key_ledger.append_column(Column("batch_id", BigInteger, nullable=True))
Index(
    "outbox_message_batch_idx",
    outbox_message.c.batch_id,
    outbox_message.c.state,
    postgresql_where=text("batch_id IS NOT NULL"),
)

# -- migration 0016: payload versions (outbox.payloads) ---------------------------------------------
#: The version of the payload's shape its writer meant; the worker upgrades older ones and
#: leaves newer ones to a newer worker. CHECK payload_version >= 1 (added NOT VALID, validated).
outbox_message.append_column(Column("payload_version", Integer, nullable=False, server_default=text("1")))
# Migration 0022: when code that knows chains last settled the row; a move to `sent` that leaves
# it unchanged came from an older release, and a trigger marks the row for the chains job.
outbox_message.append_column(Column("chains_known_at", DateTime(timezone=True), nullable=True))

# -- migrations 0017, 0018: per-key ordering (outbox.ordering) -------------------------------------
#: Rows of one ordering key are claimed one at a time, in commit order. Triggers (not in the
#: metadata): outbox_message_ordering_serialize (BEFORE INSERT: the writers of one key in turn)
#: and outbox_message_ordering_wake (AFTER UPDATE: a settled head wakes the relay).
outbox_message.append_column(Column("ordering_key", Text, nullable=True))
#: Set by the claim from the handler's on_failed_head="skip": this row, failed, holds nothing back.
outbox_message.append_column(
    Column("skip_when_failed", Boolean, nullable=False, server_default=text("false"))
)
#: An operator skipped this failed head (outbox skip).
outbox_message.append_column(Column("order_skipped_at", DateTime(timezone=True), nullable=True))
Index(
    "outbox_message_ordering_idx",
    outbox_message.c.ordering_key,
    outbox_message.c.id,
    postgresql_where=text("ordering_key IS NOT NULL AND state NOT IN ('sent', 'cancelled')"),
)

# -- migration 0019: the dashboard's search --------------------------------------------------------
#: Keys by prefix under any collation (text_pattern_ops), rows by the provider's reference.
Index(
    "outbox_message_key_prefix_idx",
    outbox_message.c.key,
    postgresql_ops={"key": "text_pattern_ops"},
)
Index(
    "outbox_message_provider_ref_idx",
    outbox_message.c.provider_ref,
    postgresql_where=text("provider_ref IS NOT NULL"),
)

# -- migration 0020: dashboard sessions signed out before they expired --------------------------------
outbox_dashboard_session_end = Table(
    "outbox_dashboard_session_end",
    metadata,
    Column("sid", Text, primary_key=True),
    Column("ended_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

# -- migration 0007: a new row's step holds no ':' --------------------------------------------------
# CHECK outbox_message_step_colon_check: strpos(step, ':') = 0 OR id <= <highest id at upgrade>,
# NOT VALID. Not declared here: its bound is each database's own (rows stored before the upgrade
# keep their step), and check constraints are not part of the metadata comparison.

# -- migration 0023: in-flight limits (outbox.limits) ----------------------------------------------
# The operator's limit (`outbox limit D --in-flight N`), and the lowest its live workers' handlers
# declare (their heartbeats write it); the claim trigger holds the first set of the two.
outbox_destination.append_column(Column("limit_in_flight", Integer, nullable=True))
outbox_destination.append_column(Column("limit_reason", Text, nullable=True))
outbox_destination.append_column(Column("limit_set_by", Text, nullable=True))
outbox_destination.append_column(Column("limit_set_at", DateTime(timezone=True), nullable=True))
outbox_destination.append_column(Column("declared_in_flight", Integer, nullable=True))
outbox_destination.append_constraint(
    CheckConstraint(
        "(limit_in_flight IS NULL OR limit_in_flight > 0)"
        " AND (declared_in_flight IS NULL OR declared_in_flight > 0)",
        name="outbox_destination_limit_in_flight_check",
    )
)
# What each process's handlers declare, by destination ({"payments.charge": 10}); NULL: none, or
# a release before 0023.
outbox_process.append_column(Column("declared_in_flight", JSONB, nullable=True))
# Until when an unknown row's call may still land at the provider (a lease that expired, a call
# that timed out): counted as in flight by the claim trigger until then (outbox.limits).
outbox_message.append_column(Column("landing_until", DateTime(timezone=True), nullable=True))

# -- migration 0024: calls per second (outbox.limits) ---------------------------------------------
# The operator's rate (`outbox limit D --per-second R`), the hint that live processes declare one,
# and the latest start booked so far (the claim trigger books the next 1/rate after it).
outbox_destination.append_column(Column("limit_per_second", DOUBLE_PRECISION, nullable=True))
outbox_destination.append_column(Column("declared_per_second", DOUBLE_PRECISION, nullable=True))
outbox_destination.append_column(Column("last_call_at", DateTime(timezone=True), nullable=True))
outbox_destination.append_constraint(
    CheckConstraint(
        "(limit_per_second IS NULL OR (limit_per_second >= 0.001 AND limit_per_second <= 1000000))"
        " AND (declared_per_second IS NULL"
        " OR (declared_per_second >= 0.001 AND declared_per_second <= 1000000))",
        name="outbox_destination_limit_per_second_check",
    )
)
# What each process's handlers declare, by destination ({"payments.charge": 50.0}).
outbox_process.append_column(Column("declared_per_second", JSONB, nullable=True))
# When the claimed call may start (a paced destination's claim books it; NULL otherwise).
outbox_message.append_column(Column("call_at", DateTime(timezone=True), nullable=True))

# -- migrations 0025, 0026: priority and fairness (outbox.windows) ---------------------------------
# Ordering the relay's take of a limited destination: priority first (1 high, 0 normal, -1 low),
# then one row of each fairness key in turn. CHECKs (added NOT VALID, validated):
# outbox_message_priority_check, outbox_message_fairness_key_check.
outbox_message.append_column(Column("priority", SmallInteger, nullable=False, server_default=text("0")))
outbox_message.append_column(Column("fairness_key", Text, nullable=True))
outbox_message.append_constraint(
    CheckConstraint("priority IN (-1, 0, 1)", name="outbox_message_priority_check")
)
outbox_message.append_constraint(
    CheckConstraint(
        "fairness_key IS NULL OR char_length(fairness_key) BETWEEN 1 AND 200",
        name="outbox_message_fairness_key_check",
    )
)
# Set by the relay's window take: its published rows are counted along this partial index.
outbox_message.append_column(Column("windowed", Boolean, nullable=False, server_default=text("false")))
Index(
    "outbox_message_windowed_idx",
    outbox_message.c.destination,
    postgresql_where=text("state = 'dispatched' AND windowed"),
)
# The head of each priority and fairness key (or '') of a destination's pending rows.
Index(
    "outbox_message_fair_idx",
    outbox_message.c.destination,
    outbox_message.c.priority,
    text("COALESCE(fairness_key, '')"),
    outbox_message.c.available_at,
    outbox_message.c.id,
    postgresql_where=text("state = 'pending'"),
)
