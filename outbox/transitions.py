"""Every change of an ``outbox_message`` row: one guarded statement per move, all of them here.

The product's safety rests on this: a row moves only if it is still where the mover saw it (its
state, its claim token, its dispatch time or failure time), in ONE statement, so two movers
acting at once cannot both win. To check that, a reviewer reads this module alone: nothing else
in ``outbox``, ``relay`` or ``reconciler`` writes ``outbox_message``
(tests/unit/test_transitions_home.py greps for it). The state table in :mod:`outbox.states`
names the function behind each move.

====================================  ==============================  ============================
function                              move                            called by
====================================  ==============================  ============================
:func:`insert`                        (none) -> pending               ``outbox.write``
:func:`cancel_by_key`                 pending/dispatched -> cancelled ``outbox.cancel``
:func:`insert_batch`                  (a batch: ``outbox_batch``)     ``outbox.batch``
:func:`insert_member`                 (none) -> pending, in a batch   ``outbox.write(batch=)``
:func:`finish_batch`                  (a batch's then/catch row)      reconciler (batches)
:func:`strip_batches`                 (a finished batch's payloads)   reconciler (purge)
:func:`drop_batches`                  (a finished batch, at horizon)  reconciler (purge)
:func:`dispatch_due`                  pending -> dispatched           relay (a batch)
:func:`undispatch`                    dispatched -> pending           relay (Redis refused)
:func:`claim`                         pending/dispatched -> in_flight consumer
:func:`record`                        in_flight/unknown -> any        consumer (the call's outcome)
:func:`record_outcome`                (the same, with next steps)     consumer (outbox.chains)
:func:`release`                       in_flight/unknown -> pending    consumer (no call was made)
:func:`fail_unhandled`                pending/dispatched -> failed    consumer (no handler)
:func:`expire_leases`                 in_flight -> unknown            reconciler
:func:`settle_unknown`                unknown -> sent/pending/failed  reconciler (a lookup)
:func:`defer_unknown`                 unknown (asked again later)     reconciler
:func:`park_unknown`                  unknown (waits for a human)     reconciler
:func:`park_past_key_ttl`             unknown (waits for a human)     reconciler
:func:`requeue`                       dispatched -> pending           reconciler (message lost)
:func:`fail_past_deadline`            pending/dispatched -> failed    reconciler (held back; ->
                                                                      unknown if it may have charged)
:func:`write_next_steps`              (a sent row's next steps)       reconciler, ``outbox repair``
:func:`clear_uncomputed`              (a sent row needs none)         reconciler
:func:`repair_found`                  failed -> sent                  ``outbox repair`` (a lookup)
:func:`note_history`                  (history only)                  ``outbox repair``
:func:`purge`                         sent/cancelled -> key ledger    reconciler
:func:`mark_alerted`                  failed/unknown (alerted once)   reconciler
:func:`replay_planned`                failed -> pending               ``outbox replay``
:func:`replay_forced`                 failed -> pending               ``outbox replay --force``
:func:`resolve_sent`                  unknown -> sent                 ``outbox resolve --sent``
:func:`resolve_not_sent`              unknown -> pending              ``outbox resolve --not-sent``
:func:`resolve_failed`                unknown -> failed               ``outbox resolve --failed``
:func:`skip_head`                     failed (its ordering key goes)  ``outbox skip``
:func:`cancel_rows`                   pending/dispatched -> cancelled ``outbox cancel``
:func:`elapse`                        (instants only)                 tests: time passes
====================================  ==============================  ============================

Connections: the application's moves take the caller's SQLAlchemy ``Session``/``Connection``
(the caller owns the transaction: nothing here commits), as do the operator's; the relay's,
the consumer's and the reconciler's take psycopg connections, in autocommit mode unless said.

One clock: every instant these statements compare is computed in SQL from the database's clock.
Python passes intervals (a lease, a backoff, a wait before the first lookup), never a timestamp
of its own; only the application's own ``available_at``/``deadline`` come from outside.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import text

from . import chains, db, ordering, outcomes, sanitize
from .schema import NOTIFY_CHANNEL

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session


@functools.cache
def _text(sql: str) -> Any:
    # One construct per statement, made once: `outbox.write` runs in the application's hot path.
    return text(sql)


# == chains (outbox.chains): the next steps a settling statement writes ==========================

#: The next steps of the plan, as rows (an empty set when the parameter is NULL).
_PLANNED = (
    "jsonb_to_recordset(CAST(%(follow)s AS jsonb)) "
    "AS n(step text, destination text, payload jsonb, via text, payload_version integer)"
)


def _follow_sql(moved: str, *, certain: str = "false") -> str:
    """The CTE (``, followed AS (…)``) that writes the plan's rows after the row of CTE ``moved``
    (which returns ``id, key, state, trace_context``): the ``then`` steps when it moved to
    ``sent``, the ``on_failure`` steps when it moved to ``failed`` and ``certain`` (an SQL
    expression over ``moved``) holds. ``ON CONFLICT DO NOTHING`` and the key ledger's guard make
    a step that exists already a no-op; :func:`_conflict_sql` tells whether it differs."""
    return f"""
, followed AS (
    INSERT INTO outbox_message (key, step, destination, payload, parent_id, via, trace_context,
                                payload_version)
    SELECT {moved}.key, n.step, n.destination, n.payload, {moved}.id, n.via, {moved}.trace_context,
           COALESCE(n.payload_version, 1)
    FROM {moved}, {_PLANNED}
    WHERE (n.via = '{chains.THEN}' AND {moved}.state = 'sent')
       OR (n.via = '{chains.ON_FAILURE}' AND {moved}.state = 'failed' AND {certain})
    ON CONFLICT (key, step) DO NOTHING
    RETURNING id
)"""


def _conflict_sql(row: str, new_state: str) -> str:
    """An expression, in the SET of the statement that moves ``row`` to ``new_state`` (SQL
    expressions), that says which planned steps exist already with another destination or
    payload (a live row, or a purged one in the key ledger); NULL when none does. Read on the
    statement's snapshot: a conflicting row committed while it runs is not seen."""
    return f"""(SELECT string_agg('step ' || n.step || ' exists already with another '
                  || CASE WHEN COALESCE(e.destination, l.destination) <> n.destination
                          THEN 'destination' ELSE 'payload' END, '; ')
    FROM {_PLANNED}
    LEFT JOIN outbox_message e ON e.key = {row}.key AND e.step = n.step
    LEFT JOIN outbox_key_ledger l ON l.key = {row}.key AND l.step = n.step
    WHERE n.via = CASE {new_state} WHEN 'sent' THEN '{chains.THEN}'
                                   WHEN 'failed' THEN '{chains.ON_FAILURE}' END
      AND (e.destination <> n.destination OR e.payload <> n.payload
           OR l.destination <> n.destination OR l.payload_hash <> outbox_payload_digest(n.payload)))"""


def _problem_sql(row: str, new_state: str) -> str:
    """``chain_problem`` after the move: the plan's own problem (``%(chain_problem)s``, from
    Python) and the conflicts, when the row moves to a state that writes steps; else unchanged."""
    return f"""CASE WHEN CAST(%(follow)s AS jsonb) IS NULL AND CAST(%(chain_problem)s AS text) IS NULL
         THEN {row}.chain_problem
         WHEN {new_state} IN ('sent', 'failed')
         THEN NULLIF(concat_ws('; ', CAST(%(chain_problem)s AS text), {_conflict_sql(row, new_state)}), '')
         ELSE {row}.chain_problem END"""


def _certain_failure_sql(row_id: str, token: str) -> str:
    """No call of row ``row_id`` other than the one under ``token`` may have taken effect."""
    return f"""NOT EXISTS (SELECT 1 FROM outbox_attempt a
                    WHERE a.message_id = {row_id} AND a.claim_token IS DISTINCT FROM {token}
                      AND {outcomes.may_have_taken_effect_sql("a")})"""


# == the application: write and cancel, in the caller's transaction ================================

_INSERT = """
INSERT INTO outbox_message (key, step, destination, payload, available_at, deadline, trace_context,
                            payload_version, ordering_key)
VALUES (:key, :step, :destination, CAST(:payload AS jsonb),
        COALESCE(CAST(:available_at AS timestamptz), now()), :deadline, CAST(:trace_context AS jsonb),
        :payload_version, :ordering_key)
ON CONFLICT (key, step) DO NOTHING
RETURNING id
"""

_CANCEL_BY_KEY = """
UPDATE outbox_message
SET state = 'cancelled', completed_at = now(), claim_token = NULL
WHERE key = :key AND step = :step AND state IN ('pending', 'dispatched')
  -- Not `attempts = 0`: a replay resets attempts, but its earlier claims may have charged.
  AND NOT EXISTS (SELECT 1 FROM outbox_attempt a WHERE a.message_id = outbox_message.id)
RETURNING id
"""


def insert(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> ``pending``: the new row's id, or None when ``(key, step)`` exists already (or is
    in the key ledger: the insert guard trigger then inserts nothing)."""
    return target.execute(_text(_INSERT), params).scalar()


async def insert_async(target: AsyncSession | AsyncConnection, params: Mapping[str, Any]) -> int | None:
    return (await target.execute(_text(_INSERT), params)).scalar()


def cancel_by_key(target: Session | Connection, *, key: str, step: str) -> bool:
    """``pending``/``dispatched`` -> ``cancelled``, only for a row no consumer ever claimed (no
    fence row): once a call was attempted it may have taken effect."""
    return target.execute(_text(_CANCEL_BY_KEY), {"key": key, "step": step}).first() is not None


async def cancel_by_key_async(target: AsyncSession | AsyncConnection, *, key: str, step: str) -> bool:
    return (await target.execute(_text(_CANCEL_BY_KEY), {"key": key, "step": step})).first() is not None


# == batches (outbox.batches): a group of rows written in one transaction ========================

# ON CONFLICT: a batch of that name exists (the caller's retry of a committed transaction, or a
# name reused): the caller compares it (outbox.batches), the transaction stays usable.
_INSERT_BATCH = """
INSERT INTO outbox_batch (name, then_step, catch_step)
VALUES (:name, CAST(:then_step AS jsonb), CAST(:catch_step AS jsonb))
ON CONFLICT (name) DO NOTHING
RETURNING id
"""

# A row joins a batch only in the transaction that created the batch (created_txid): once the
# batch commits, its members are fixed, and "every member is terminal" means the same thing to
# every reader. Casts: in a SELECT list a bare parameter would be text.
_INSERT_MEMBER = """
INSERT INTO outbox_message (key, step, destination, payload, available_at, deadline, trace_context, batch_id,
                            payload_version, ordering_key)
SELECT CAST(:key AS text), CAST(:step AS text), CAST(:destination AS text), CAST(:payload AS jsonb),
       COALESCE(CAST(:available_at AS timestamptz), now()), CAST(:deadline AS timestamptz),
       CAST(:trace_context AS jsonb), b.id, CAST(:payload_version AS integer), CAST(:ordering_key AS text)
FROM outbox_batch b
WHERE b.id = :batch_id AND b.created_txid = txid_current()
ON CONFLICT (key, step) DO NOTHING
RETURNING id
"""


def insert_batch(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> an open batch: its id, or None when a batch of that name exists."""
    return target.execute(_text(_INSERT_BATCH), params).scalar()


async def insert_batch_async(target: AsyncSession | AsyncConnection, params: Mapping[str, Any]) -> int | None:
    return (await target.execute(_text(_INSERT_BATCH), params)).scalar()


def insert_member(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> ``pending``, a member of batch ``batch_id``: the new row's id, or None when
    ``(key, step)`` exists already or the batch was not created by this transaction."""
    return target.execute(_text(_INSERT_MEMBER), params).scalar()


async def insert_member_async(
    target: AsyncSession | AsyncConnection, params: Mapping[str, Any]
) -> int | None:
    return (await target.execute(_text(_INSERT_MEMBER), params)).scalar()


# When every member of the batch is terminal: the batch is finished, with its counts, and its
# then step (none failed) or catch step (any failed) is written as row (name, step), by this one
# statement. The members are read FOR SHARE: a member replayed (failed -> pending) after this
# statement's snapshot is read as it is now (or waited for), never as it was. Two reconcilers
# running it at once: the second waits on the batch row's lock, finds finished_at set, and
# writes nothing. ON CONFLICT: a row (name, step) that exists already is left as it is.
#: A failed member of batch ``b`` whose claim may still record a late answer (its worker past
#: the call): not before a lease and a time_limit of its destination after that claim
#: (``%(late_record)s``: ``{destination: seconds}``; ``%(late_record_default)s`` for the others).
LATE_RECORD_SQL = """SELECT 1 FROM outbox_message m
    WHERE m.batch_id = b.id AND m.state = 'failed'
      AND m.claimed_at > now() - COALESCE(CAST(CAST(%(late_record)s AS jsonb) ->> m.destination AS float8),
                                          CAST(%(late_record_default)s AS float8)) * interval '1 second'"""

_FINISH_BATCH = f"""
WITH members AS (
    SELECT m.state FROM outbox_message m WHERE m.batch_id = %(id)s FOR SHARE
), counts AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE state = 'sent') AS sent,
           count(*) FILTER (WHERE state = 'failed') AS failed,
           count(*) FILTER (WHERE state = 'cancelled') AS cancelled
    FROM members
), due AS (
    -- The batch row, locked: a second finisher waits here, then finds finished_at set.
    SELECT b.id, b.name, c.total, c.sent, c.failed, c.cancelled,
           CASE WHEN c.failed > 0 THEN 'catch' ELSE 'then' END AS outcome,
           CASE WHEN c.failed > 0 THEN b.catch_step ELSE b.then_step END AS next_step
    FROM outbox_batch b, counts c
    WHERE b.id = %(id)s AND b.finished_at IS NULL AND c.sent + c.failed + c.cancelled = c.total
      AND NOT EXISTS ({LATE_RECORD_SQL})
    FOR UPDATE OF b
), written AS (
    INSERT INTO outbox_message (key, step, destination, payload, via, payload_version)
    SELECT d.name, d.next_step->>'step', d.next_step->>'destination', d.next_step->'payload',
           'batch_' || d.outcome, COALESCE(CAST(d.next_step->>'payload_version' AS integer), 1)
    FROM due d WHERE d.next_step IS NOT NULL
    ON CONFLICT (key, step) DO NOTHING
    RETURNING id
), done AS (
    UPDATE outbox_batch b
    SET finished_at = now(), outcome = d.outcome,
        total = d.total, sent = d.sent, failed = d.failed, cancelled = d.cancelled,
        written_id = (SELECT id FROM written),
        -- Not written: a row of that key and step exists (or its key is in the ledger).
        problem = CASE WHEN d.next_step IS NOT NULL AND NOT EXISTS (SELECT 1 FROM written)
                       THEN format('its %%s step %%s was not written: %%s:%%s exists already',
                                   d.outcome, d.next_step->>'step', d.name, d.next_step->>'step') END
    FROM due d WHERE b.id = d.id
    RETURNING b.outcome, b.written_id, b.problem, d.next_step->>'step' AS step,
              d.next_step->>'destination' AS destination, EXTRACT(EPOCH FROM now() - b.created_at) AS age
)
SELECT outcome, written_id, problem, step, destination, age FROM done
"""


@dataclass(frozen=True)
class Finished:
    """What :func:`finish_batch` did: the outcome, the row it wrote (None: no step declared, or
    ``problem``), and the step it meant to write."""

    outcome: str
    written_id: int | None
    problem: str | None
    step: str | None
    destination: str | None
    #: Seconds since the batch was created.
    age: float


def finish_batch(
    conn: psycopg.Connection[Any],
    *,
    batch_id: int,
    late_record_seconds: Mapping[str, float] | None = None,
    late_record_default_seconds: float = 0.0,
) -> Finished | None:
    """An open batch whose members are all terminal -> finished (``then`` or ``catch``; no row
    written when it declares no such step, or when a row of that key and step exists, which
    ``problem`` says), or None when a member is
    still open, a failed member was claimed less than its destination's ``late_record_seconds``
    (else ``late_record_default_seconds``) ago, when its worker may still record a late answer,
    or the batch was finished already."""
    params = {
        "id": batch_id,
        "late_record": json.dumps(dict(late_record_seconds or {})),
        "late_record_default": late_record_default_seconds,
    }
    row = conn.execute(_FINISH_BATCH, params).fetchone()
    if row is None:
        return None
    return Finished(str(row[0]), row[1], row[2], row[3], row[4], float(row[5]))


# A finished batch outlives its members for as long as a purged key does (the key ledger), so that
# ``outbox.batch`` answers for its name as ``write`` answers for a ledgered key. Its then/catch
# payloads are needed by nothing after the finish: at the retention each gives way to its SHA-256
# (what the ledger keeps of a row's payload), which ``outbox.batch`` compares a retry against.
# Members cannot join a committed batch (created_txid), so "no member left in outbox_message"
# stays true once true; an unfinished batch is never touched.
#: A then/catch step (jsonb ``{step}``) with its payload replaced by ``payload_sha256``.
STRIPPED_STEP_SQL = (
    "CASE WHEN {step} ? 'payload' THEN ({step} - 'payload') || jsonb_build_object("
    "'payload_sha256', encode(outbox_payload_digest({step} -> 'payload'), 'hex')) ELSE {step} END"
)

# Along outbox_batch_payload_idx (0021): the batches still holding a payload, oldest finish first.
STRIP_BATCHES_SQL = f"""
UPDATE outbox_batch b
SET then_step = {STRIPPED_STEP_SQL.format(step="b.then_step")},
    catch_step = {STRIPPED_STEP_SQL.format(step="b.catch_step")}
WHERE b.id IN (
    SELECT x.id FROM outbox_batch x
    WHERE x.finished_at IS NOT NULL AND (x.then_step ? 'payload' OR x.catch_step ? 'payload')
      AND x.finished_at < now() - %(retention)s * interval '1 second'
      -- A member still here (failed, waiting for a human; a replay) keeps its batch as it was.
      AND NOT EXISTS (SELECT 1 FROM outbox_message m WHERE m.batch_id = x.id)
    ORDER BY x.finished_at
    LIMIT %(limit)s
)
AND b.finished_at IS NOT NULL AND (b.then_step ? 'payload' OR b.catch_step ? 'payload')
"""

# Along outbox_batch_finished_idx (0021). The ledger entries of its members stay as long as the
# batch (the purge's ledger drop passes over them), so a retried member write keeps answering
# while the batch does, and go right after it. The row its end wrote (or the row that took its
# step) holds the name: a batch of that name could not write that step again, and a retry would
# be refused with "exists already" instead of answered.
DROP_BATCHES_SQL = """
DELETE FROM outbox_batch b
WHERE b.id IN (
    SELECT x.id FROM outbox_batch x
    WHERE x.finished_at IS NOT NULL
      AND x.finished_at < now() - %(horizon)s * interval '1 second'
      AND NOT EXISTS (SELECT 1 FROM outbox_message m WHERE m.batch_id = x.id)
      AND NOT EXISTS (SELECT 1 FROM outbox_message w
                      WHERE w.key = x.name AND w.step IN (x.then_step ->> 'step', x.catch_step ->> 'step'))
      AND NOT EXISTS (SELECT 1 FROM outbox_key_ledger l
                      WHERE l.key = x.name AND l.step IN (x.then_step ->> 'step', x.catch_step ->> 'step'))
    ORDER BY x.finished_at
    LIMIT %(limit)s
)
AND b.finished_at IS NOT NULL
"""


def strip_batches(conn: psycopg.Connection[Any], *, retention_seconds: float, limit: int) -> int:
    """Finished batches older than ``retention_seconds`` whose members are all purged: their
    then/catch payloads replaced by their SHA-256, at most ``limit``; how many."""
    return conn.execute(STRIP_BATCHES_SQL, {"retention": float(retention_seconds), "limit": limit}).rowcount


def drop_batches(conn: psycopg.Connection[Any], *, horizon_seconds: float, limit: int) -> int:
    """Finished batches older than ``horizon_seconds`` with nothing left of them (no member, no
    then/catch row, in ``outbox_message`` or the key ledger): deleted, their names free again, at
    most ``limit``; how many."""
    return conn.execute(DROP_BATCHES_SQL, {"horizon": float(horizon_seconds), "limit": limit}).rowcount


# == the relay ======================================================================================

# The ids are locked first (SKIP LOCKED, so several relays share the load) and handed to the
# UPDATE as an array, which keeps the UPDATE a primary-key lookup whatever the statistics say.
# Joined to a CTE instead, with a backlog of 100,000 analyzed pending rows the planner chose a
# hash join over a sequential scan of the whole table for every batch (EXPLAIN ANALYZE: 57 of
# 85 ms per 1,000 rows; 40-50 ms this way). The outer UPDATE has no `state = 'pending'` of its
# own on purpose: the rows are locked, so it would add nothing, and it makes the partial pending
# index eligible, which the planner picked before the table's first ANALYZE, scanning the whole
# index for each id (1 s per 1,000-row batch).
# All rows of a batch get the same dispatched_at (now() is the transaction's start time).
# Only the head of an ordering key is taken (outbox.ordering): the rows behind it wait `pending`.
DISPATCH_DUE_SQL = f"""
UPDATE outbox_message
SET state = 'dispatched', dispatched_at = now()
WHERE id = ANY(ARRAY(
    SELECT id FROM outbox_message
    WHERE state = 'pending' AND available_at <= now() AND NOT {ordering.blocked_sql("outbox_message")}
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING id, destination, dispatched_at
"""

# Rows of a destination whose publication Redis refused go back to `pending`, due again after
# this long: left due, they would come first in every batch and, a batch of them, starve the
# other destinations' rows behind them. One statement, in the relay's transaction.
_UNDISPATCH = """
UPDATE outbox_message
SET state = 'pending', dispatched_at = NULL,
    -- The refusal stays on record: the latency metrics count the row from its writing.
    available_at = now() + %(retry_after)s * interval '1 second',
    last_error = %(error)s
WHERE id = ANY(%(ids)s) AND state = 'dispatched'
"""


_DISPATCH_DUE_STATEMENT = db.Statement(DISPATCH_DUE_SQL)


def dispatch_due(conn: psycopg.Connection[Any], *, limit: int) -> list[Any]:
    """``pending`` -> ``dispatched`` for up to ``limit`` due rows, oldest due first; returns
    ``(id, destination, dispatched_at)`` per row. Run it in the transaction that publishes the
    rows: if the publish raises, the move rolls back with it. (The relay "takes" rows; only a
    consumer "claims" one.)"""
    return _DISPATCH_DUE_STATEMENT.execute(conn, {"limit": limit}).fetchall()


def undispatch(
    conn: psycopg.Connection[Any], *, ids: Sequence[int], retry_after_seconds: float, error: str
) -> None:
    """``dispatched`` -> ``pending``, due ``retry_after_seconds`` from now, ``error`` as their
    last_error: rows whose publication Redis refused, in the transaction that took them."""
    params = {"ids": list(ids), "retry_after": retry_after_seconds, "error": sanitize.clean_text(error)}
    conn.execute(_UNDISPATCH, params)


# == the consumer ===================================================================================

# The lease counts from when the row is held: the `held` CTE takes the row lock first, so the
# `clock_timestamp()` of the UPDATE is read after any lock wait (the relay between its push and
# its commit, an application transaction holding the row, even one that only ran SELECT … FOR
# UPDATE), where the statement's `now()` would date from before it. A commit wait after the
# statement is not covered here: the worker bounds that with its own monotonic clock.
# A paused destination's rows are not claimed (outbox.pauses), nor those of a destination whose
# breaker is open (outbox.breaker), but for the one probe of a half-open breaker: the guard is
# part of the claim, so a pause or a trip committed before it is obeyed by every worker, on the
# database's clock. The pause is checked in `held` only: a second check in the UPDATE would
# read the same snapshot (a pause committed during a lock wait is not seen either way; the
# runbook says so); the UPDATE checks that an open breaker's claim got the probe.
#
# On an idempotent destination (``%(key_ttl)s`` set), a row whose earlier call may have taken
# effect longer than key_ttl ago is not called again: the provider may have forgotten that
# call's Idempotency-Key, so a retry could charge twice (a pause, or an outage of the workers,
# outlasting key_ttl between the call and its retry). It goes to `unknown` instead, where the
# lookup (or a human) decides; the two branches are exclusive on the statement's snapshot.
_OLD_CALL = f"""
SELECT 1 FROM outbox_attempt a
WHERE a.message_id = %(id)s AND {outcomes.may_have_taken_effect_sql("a")}
  AND a.started_at <= now() - CAST(%(key_ttl)s AS float8) * interval '1 second'
"""
# A row behind the head of its ordering key is not claimed, whatever brought its message (a
# re-dispatch, a replay): the order is kept by the claim too, not only by the relay.
_CLAIMABLE = f"""
    id = %(id)s AND destination = %(destination)s
    AND (state = 'dispatched' OR (state = 'pending' AND available_at <= now()))
    AND NOT EXISTS (SELECT 1 FROM gate WHERE paused OR (open AND NOT probe_free))
    AND NOT {ordering.blocked_sql("outbox_message")}
"""
# The destination's row (outbox.pauses, outbox.breaker), read once: paused, breaker open (and
# whether the probe is free: half-open, no probe under way), the consecutive failures counted.
_GATE = """
gate AS (
    SELECT COALESCE(paused_until > now(), false) AS paused,
           breaker_opened_at IS NOT NULL AS open,
           COALESCE(breaker_open_until <= now() AND NOT COALESCE(breaker_probe_until > now(), false),
                    false) AS probe_free,
           breaker_failures
    FROM outbox_destination WHERE destination = %(destination)s
)"""
# A half-open breaker's probe: reserved by the claim that holds a row, under its claim token,
# for its lease. Two claims racing for it: the second waits for the first's row lock, re-reads
# the row and finds the probe taken, so exactly one claim gets it.
_PROBE = """
probe AS (
    UPDATE outbox_destination p
    SET breaker_probe_token = %(token)s,
        breaker_probe_until = clock_timestamp() + %(lease_seconds)s * interval '1 second',
        breaker_probes = p.breaker_probes + 1
    WHERE p.destination = %(destination)s AND p.breaker_opened_at IS NOT NULL
      AND p.breaker_open_until <= now() AND NOT COALESCE(p.breaker_probe_until > now(), false)
      AND EXISTS (SELECT 1 FROM held)
    RETURNING true AS probe
)"""
_CLAIMED = """
claimed AS (
    UPDATE outbox_message m
    SET state = 'in_flight',
        claim_token = %(token)s,
        attempts = m.attempts + 1,
        -- The handler's on_failed_head (outbox.ordering): whether this row, failed, lets the
        -- rows of its ordering key behind it go.
        skip_when_failed = %(skip_when_failed)s,
        claimed_at = clock_timestamp(),
        lease_expires_at = clock_timestamp() + %(lease_seconds)s * interval '1 second'
    FROM held
    WHERE m.id = held.id
      AND m.destination = %(destination)s
      AND (m.state = 'dispatched' OR (m.state = 'pending' AND m.available_at <= now()))
      -- An open breaker lets only its probe through.
      AND (NOT EXISTS (SELECT 1 FROM gate WHERE open) OR EXISTS (SELECT 1 FROM probe))
    RETURNING m.id, m.key, m.step, m.destination, m.payload, m.attempts, m.deadline, m.claim_token,
              m.deadline <= clock_timestamp() AS deadline_passed,
              -- For the latency metrics: since the row was written (or, on a first attempt that
              -- no release preceded, since it was due, when written for later) and since it was
              -- published. A release leaves its reason in last_error and moves available_at.
              date_part('epoch', clock_timestamp() - CASE WHEN m.attempts = 1 AND m.last_error IS NULL
                  THEN GREATEST(m.created_at, m.available_at) ELSE m.created_at END) AS since_written,
              date_part('epoch', clock_timestamp() - m.dispatched_at) AS since_published,
              -- Written -> published, at the row's first claim (no earlier claim, none released):
              -- from its writing (or due time) to the publication this claim came from.
              CASE WHEN m.attempts = 1 AND m.releases = 0 THEN date_part('epoch', m.dispatched_at -
                  CASE WHEN m.last_error IS NULL THEN GREATEST(m.created_at, m.available_at)
                  ELSE m.created_at END) END AS written_to_published,
              m.trace_context, m.payload_version
), fence AS (
    -- started_at is the clock now, not now(): now() is when the statement arrived, before it
    -- was planned and took the snapshot that let the row go; a claim of the next row of an
    -- ordering key could then carry a start before the end of the claim it waited for.
    INSERT INTO outbox_attempt (message_id, attempt, claim_token, started_at)
    SELECT id, attempts, claim_token, clock_timestamp() FROM claimed
)
SELECT id, key, step, destination, payload, attempts, deadline, claim_token,
       COALESCE(deadline_passed, false), since_written, since_published, written_to_published,
       trace_context, EXISTS (SELECT 1 FROM probe), COALESCE((SELECT breaker_failures FROM gate), 0),
       false, payload_version
FROM claimed"""

# Two statements, not one with a switch: with the key_ttl branch behind a parameter, PostgreSQL
# re-planned the whole statement at every execution (a custom plan pruned the branch, a generic
# one could not), and the claim cost 0.4 ms more of its CPU per delivery (bench/e2e.py).
_CLAIM = f"""
WITH {_GATE}, held AS (
    SELECT id FROM outbox_message WHERE {_CLAIMABLE}
    FOR UPDATE
), {_PROBE}, {_CLAIMED}
"""
_CLAIM_IDEMPOTENT = f"""
WITH {_GATE}, aged AS (
    UPDATE outbox_message
    SET state = 'unknown', unknown_since = now(), available_at = now(), last_error = %(aged_error)s
    WHERE {_CLAIMABLE} AND EXISTS ({_OLD_CALL})
    RETURNING id
), held AS (
    SELECT id FROM outbox_message WHERE {_CLAIMABLE} AND NOT EXISTS ({_OLD_CALL})
    FOR UPDATE
), {_PROBE}, {_CLAIMED}
UNION ALL
SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, NULL, NULL, NULL, NULL, false, 0, true, NULL
FROM aged
"""

#: SQL fragments shared by the record and the reconciler's settlement of a lookup: when a
#: row is due again (``%(delay)s`` seconds from the database's now, or NULL to keep
#: ``available_at``), and whether a retry would fall on or after the row's deadline, in which
#: case the row is failed instead (with ``%(deadline_error)s`` as its reason).
DUE_SQL = "now() + CAST(%(delay)s AS float8) * interval '1 second'"
PAST_DEADLINE_SQL = f"(%(state)s = 'pending' AND deadline IS NOT NULL AND {DUE_SQL} >= deadline)"
NEW_STATE_SQL = f"(CASE WHEN {PAST_DEADLINE_SQL} THEN 'failed' ELSE %(state)s END)"


# The message row moves only if this claim still owns it: a late recording after the lease was
# taken over updates the attempt row alone, marked superseded. An `unknown` row with the same
# token is this claim's own call, expired by the reconciler: the worker's answer is better
# evidence than a lookup, so it may still settle it.
def _record_sql(follow: bool) -> str:
    """The record; ``follow``: with the CTEs that write the next steps (outbox.chains). Two
    statements, not one: the INSERT of an empty plan would still fire the table's statement-level
    NOTIFY trigger, waking the relay at every delivery (bench/e2e.py: 20% fewer deliveries/s)."""
    chain_set = (
        f",\n        chain_problem = {_problem_sql('outbox_message', NEW_STATE_SQL)}" if follow else ""
    )
    chain_returning = (
        f""", chain_problem,
              -- Compensation only for a certain failure (outbox.chains).
              CASE WHEN %(outcome)s = 'unknown' THEN false
                   ELSE {_certain_failure_sql("outbox_message.id", "%(token)s")} END AS certain"""
        if follow
        else ""
    )
    follow_cte = _follow_sql("moved", certain="moved.certain") if follow else ""
    chain_tail = "(SELECT count(*) FROM followed), (SELECT chain_problem FROM moved)" if follow else "0, NULL"
    return f"""
WITH moved AS (
    UPDATE outbox_message
    SET state = {NEW_STATE_SQL},
        -- Settled by code that knows chains (migration 0022's trigger marks a move to sent
        -- without it, by an older release, for the reconciler's chains job).
        chains_known_at = clock_timestamp(),
        -- A breaker's probe that found the provider still down is not an attempt of its row
        -- (outbox.breaker): the row only carried the question.
        attempts = GREATEST(attempts - %(refund)s, 0),
        provider_ref = COALESCE(%(ref)s, provider_ref),
        response = COALESCE(CAST(%(response)s AS jsonb), response),
        last_error = CASE WHEN {PAST_DEADLINE_SQL} THEN %(deadline_error)s ELSE %(error)s END,
        available_at = COALESCE({DUE_SQL}, available_at),
        completed_at = CASE WHEN {NEW_STATE_SQL} IN ('sent', 'failed') THEN now() END,
        unknown_since = CASE WHEN %(state)s = 'unknown' THEN COALESCE(unknown_since, now()) END,
        dispatched_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE dispatched_at END,
        -- A row alerted while unknown and then settled must be able to alert again (failed).
        alerted_at = NULL,
        lease_expires_at = NULL{chain_set}
    -- A confirmed answer also settles a row that a lookup sent back (pending, dispatched) or
    -- failed while this claim's call was still on its way, as long as no newer claim owns it:
    -- the provider's confirmation beats the lookup's earlier "not found". Not an operator's
    -- resolve --failed ("refunded by hand"): only another operator overrules that (a forced
    -- repair or replay); the fence row keeps the answer (superseded:sent, which the audit shows).
    WHERE id = %(id)s AND claim_token = %(token)s
      AND (state IN ('in_flight', 'unknown')
           OR (%(state)s = 'sent' AND state IN ('pending', 'dispatched'))
           OR (%(state)s = 'sent' AND state = 'failed'
               AND NOT {outcomes.operator_failed_unknown_sql("outbox_message")}))
    RETURNING id, key, state, last_error, trace_context{chain_returning}
){follow_cte}
UPDATE outbox_attempt
SET finished_at = now(),
    -- An ambiguous call keeps "unknown" on its fence row even when the row fails (an idempotent
    -- destination out of attempts or past its deadline): a later replay must see it
    -- (outbox.outcomes).
    outcome = COALESCE((SELECT CASE WHEN state = 'failed' AND %(outcome)s <> 'unknown' THEN 'failed'
                                    ELSE %(outcome)s END FROM moved),
                       'superseded:' || %(outcome)s),
    http_status = %(http_status)s,
    error = COALESCE((SELECT last_error FROM moved), %(error)s),
    -- An ambiguous call retried on an idempotent destination (outbox.outcomes): covered by the
    -- provider's deduplication, which is not a settlement for a later replay.
    -- A late record keeps what a lookup or an operator settled meanwhile.
    settled = CASE WHEN %(outcome)s = 'unknown' AND (SELECT state FROM moved) = 'pending'
                        AND settled IS NULL
                   THEN 'idempotent_retry' ELSE settled END,
    settled_at = CASE WHEN %(outcome)s = 'unknown' AND (SELECT state FROM moved) = 'pending'
                           AND settled IS NULL
                      THEN now() ELSE settled_at END
WHERE claim_token = %(token)s
RETURNING (SELECT state FROM moved), {chain_tail}
"""


_RECORD = _record_sql(follow=False)
_RECORD_FOLLOW = _record_sql(follow=True)

# The claim is given back without a call: the row is due again at once (the relay re-publishes
# it; a NOTIFY wakes it) or after ``%(delay)s`` seconds (a payload newer than this worker's
# handler: outbox.payloads), the claim is not counted as an attempt, and the fence row says
# `released`. From `unknown`
# too: the reconciler may have expired the lease meanwhile, but this claim knows no call was
# made, which is better evidence than any lookup.
_RELEASE = f"""
WITH released AS (
    UPDATE outbox_message
    SET state = 'pending',
        attempts = GREATEST(attempts - 1, 0),
        releases = releases + 1,
        available_at = now() + CAST(%(delay)s AS float8) * interval '1 second',
        dispatched_at = NULL,
        lease_expires_at = NULL,
        unknown_since = NULL,
        alerted_at = NULL,
        last_error = %(reason)s
    WHERE id = %(id)s AND claim_token = %(token)s AND state IN ('in_flight', 'unknown')
    RETURNING id, key, step, releases, destination, date_part('epoch', now() - created_at) AS waited
), fenced AS (
    UPDATE outbox_attempt
    SET outcome = 'released', finished_at = now(), error = %(reason)s
    WHERE claim_token = %(token)s AND EXISTS (SELECT 1 FROM released)
), probe_freed AS (
    -- A probe that made no call proved nothing: the next claim may probe.
    UPDATE outbox_destination
    SET breaker_probe_token = NULL, breaker_probe_until = NULL
    WHERE destination = (SELECT destination FROM released) AND breaker_probe_token = %(token)s
)
SELECT key, step, releases, waited,
       CASE WHEN CAST(%(delay)s AS float8) = 0 THEN pg_notify('{NOTIFY_CHANNEL}', '') END
FROM released
"""

# For a message whose destination no handler in this deploy knows: never retried forever.
_FAIL_UNHANDLED = """
UPDATE outbox_message
SET state = 'failed', completed_at = now(), last_error = %(error)s
WHERE id = %(id)s AND state IN ('pending', 'dispatched')
RETURNING id
"""


@dataclass(frozen=True)
class Claimed:
    id: int
    key: str
    step: str
    destination: str
    payload: dict[str, Any]
    attempt: int
    deadline: datetime | None
    token: uuid.UUID
    #: The row's deadline had passed when the claim held it (on the database's clock).
    deadline_passed: bool = False
    #: Seconds from the row's writing (its due time, on a first attempt scheduled for later) to
    #: the claim, and from its latest publication to the claim (None: never published), on the
    #: database's clock: for the latency metrics only.
    since_written_seconds: float | None = None
    since_published_seconds: float | None = None
    #: At the row's first claim only: seconds from its writing (its due time when written for
    #: later; its writing when Redis refused a publication) to the publication this claim came
    #: from, on the database's clock.
    written_to_published_seconds: float | None = None
    #: The writer's trace context as stored (jsonb; None when it had none): outbox.tracing
    #: reads only its string fields, whatever a plain-SQL writer put there.
    trace_context: Any = None
    #: This claim holds the probe of its destination's half-open breaker (outbox.breaker).
    probe: bool = False
    #: The consecutive "not processed" outcomes its destination's breaker had counted.
    breaker_failures: int = 0
    #: The version of the payload's shape (outbox.payloads).
    payload_version: int = 1


@dataclass(frozen=True)
class Aged:
    """What a claim did instead of claiming: the row went to `unknown`, its earlier call older
    than the destination's key_ttl (see ``_CLAIM``)."""

    id: int
    error: str


@dataclass(frozen=True)
class Released:
    key: str
    step: str
    #: How many claims of this row have been released so far, this one included.
    releases: int
    #: Seconds since the row was written.
    waited_seconds: float = 0.0


_CLAIM_STATEMENT = db.Statement(_CLAIM)
_CLAIM_IDEMPOTENT_STATEMENT = db.Statement(_CLAIM_IDEMPOTENT)


def claim(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    destination: str,
    lease_seconds: float,
    token: uuid.UUID | None = None,
    key_ttl: float | None = None,
    skip_when_failed: bool = False,
) -> Claimed | Aged | None:
    """Move the row to `in_flight` under a new claim token and insert its fence row.

    None when the row is not claimable (already claimed, settled, cancelled, not yet due, not
    for this destination, its destination is paused, or an earlier row of its ordering key holds
    it back): the run is then empty. ``skip_when_failed``: the handler's
    ``on_failed_head="skip"``, recorded on the row (outbox.ordering). Pass ``token``
    to know it before the statement is sent: if its reply is lost, the token says whether the
    claim committed. ``key_ttl`` (an idempotent destination's): a row whose earlier call may
    have taken effect longer ago goes to `unknown` instead (:class:`Aged`).
    """
    aged_error = (
        f"not called again: an earlier call may have taken effect more than key_ttl ({key_ttl:g} s) "
        "ago, and the provider may have forgotten its Idempotency-Key; the lookup decides"
        if key_ttl is not None
        else None
    )
    row = (
        (_CLAIM_STATEMENT if key_ttl is None else _CLAIM_IDEMPOTENT_STATEMENT)
        .execute(
            conn,
            {
                "token": token or uuid.uuid4(),
                "lease_seconds": float(lease_seconds),
                "id": row_id,
                "destination": destination,
                "key_ttl": key_ttl,
                "aged_error": aged_error,
                "skip_when_failed": skip_when_failed,
            },
        )
        .fetchone()
    )
    if row is None:
        return None
    if row[15]:
        return Aged(row[0], str(aged_error))
    row_id, key, step, destination, payload, attempt, deadline, token, passed = row[:9]
    written, published, published_after, trace, probe, failures = row[9:15]  # row[15]: aged
    return Claimed(
        row_id,
        key,
        step,
        destination,
        payload,
        attempt,
        deadline,
        token,
        passed,
        since_written_seconds=float(written) if written is not None else None,
        since_published_seconds=float(published) if published is not None else None,
        written_to_published_seconds=float(published_after) if published_after is not None else None,
        trace_context=trace,
        probe=bool(probe),
        breaker_failures=int(failures),
        payload_version=int(row[16]) if row[16] is not None else 1,
    )


@dataclass(frozen=True)
class Recorded:
    #: The state the row moved to, or None when a newer claim owns it.
    state: str | None
    #: Next steps (outbox.chains) this record wrote.
    followed: int = 0
    #: Why declared next steps were not all written (outbox.chains), or None.
    chain_problem: str | None = None


def record(conn: psycopg.Connection[Any], **kwargs: Any) -> str | None:
    """:func:`record_outcome`'s state: the state the row moved to, or None when a newer claim
    owns it."""
    return record_outcome(conn, **kwargs).state


_RECORD_STATEMENT = db.Statement(_RECORD)
_RECORD_FOLLOW_STATEMENT = db.Statement(_RECORD_FOLLOW)


def record_outcome(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    token: uuid.UUID,
    state: str,
    outcome: str,
    ref: str | None = None,
    response: dict[str, Any] | None = None,
    error: str | None = None,
    http_status: int | None = None,
    delay_seconds: float | None = None,
    deadline_error: str | None = None,
    refund_attempt: bool = False,
    follow: chains.Plan = chains.NOTHING,
) -> Recorded:
    """Record a claim's outcome, and write the next steps of ``follow`` (outbox.chains) in the
    same statement: its ``then`` steps if the row moves to ``sent``, its ``on_failure`` steps if
    it moves to ``failed`` for a certain reason.

    ``delay_seconds``: the row is due again that long after the database's now (the backoff of
    a retry, the wait before the first lookup of an unknown row). A retry that would fall on or
    after the row's deadline fails the row instead, with ``deadline_error`` as its reason.
    ``refund_attempt``: this claim is not counted as an attempt of the row (a breaker's probe that
    found the provider still down, outbox.breaker).

    What the provider sent is stored through :mod:`outbox.sanitize` (storable, no card data).
    Should the database still refuse it, the row is recorded without the response summary: a
    confirmed charge must reach `sent`, never stay `in_flight` because of its summary.
    """
    params = {
        **_stored(ref=ref, response=response, error=error, deadline_error=deadline_error),
        "state": state,
        "outcome": outcome,
        "delay": float(delay_seconds) if delay_seconds is not None else None,
        "http_status": http_status,
        "id": row_id,
        "token": token,
        "refund": 1 if refund_attempt else 0,
        "follow": follow.param,
        "chain_problem": follow.problem,
    }
    statement = (
        _RECORD_STATEMENT if follow.param is None and follow.problem is None else _RECORD_FOLLOW_STATEMENT
    )
    try:
        row = statement.execute(conn, params).fetchone()
    except psycopg.DataError as exc:
        # Autocommit: the refused statement changed nothing; the second one stores no summary.
        params["response"] = sanitize.encode_response({"unstorable_response": type(exc).__name__})
        # A database whose encoding is not UTF-8 refuses some characters: ASCII always fits.
        if ref is not None and not str(params["ref"]).isascii():
            params["ref"] = str(params["ref"]).encode("ascii", "backslashreplace").decode()
        for name in ("error", "deadline_error"):
            text = params[name]
            if isinstance(text, str):
                params[name] = text.encode("ascii", "replace").decode()
        if params["follow"] is not None:
            # Nor the next steps: recorded as a chain problem, `outbox repair` writes them.
            params["follow"] = None
            params["chain_problem"] = f"next steps refused by the database ({type(exc).__name__})"
        row = statement.execute(conn, params).fetchone()
    if row is None:
        return Recorded(None)
    return Recorded(row[0], int(row[1] or 0), row[2])


def release(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    token: uuid.UUID,
    reason: str,
    retry_after_seconds: float = 0.0,
) -> Released | None:
    """Give back a claim that made no call, the row due again in ``retry_after_seconds``; None
    when ``token`` does not own the row (the claim never committed, or the row has moved on)."""
    params = {"id": row_id, "token": token, "reason": reason, "delay": retry_after_seconds}
    row = conn.execute(_RELEASE, params).fetchone()
    return Released(row[0], row[1], row[2], float(row[3] or 0.0)) if row else None


def fail_unhandled(conn: psycopg.Connection[Any], *, row_id: int, error: str) -> bool:
    """``pending``/``dispatched`` -> ``failed``: no handler in this deploy knows its destination."""
    params = {"id": row_id, "error": sanitize.clean_text(error)}
    return conn.execute(_FAIL_UNHANDLED, params).fetchone() is not None


def _stored(
    *, ref: str | None, response: dict[str, Any] | None, error: str | None, deadline_error: str | None
) -> dict[str, Any]:
    """What a provider or a lookup answered, as stored (:mod:`outbox.sanitize`: storable, no card
    data); shared by :func:`record` and :func:`settle_unknown`."""
    return {
        "ref": sanitize.clean_ref(ref) if ref is not None else None,
        "response": sanitize.encode_response(response),
        "error": sanitize.clean_optional_text(error),
        "deadline_error": sanitize.clean_optional_text(deadline_error or error),
    }


# == the reconciler =================================================================================

# The claim token is kept: a late recording by the same claim is better evidence than a lookup
# and may still settle the row (see :func:`record`). The fence row is closed in the same statement,
# so an operator sees why the claim ended. The first lookup waits one time_limit of the row's
# destination (on the database's clock): a call that overran its lease may still be landing at
# the provider, and a lookup before it lands would find nothing and let the row be charged again.
_EXPIRE_LEASES = """
WITH waits AS (
    SELECT * FROM unnest(CAST(%(destinations)s AS text[]), CAST(%(waits)s AS float8[]))
        AS w(destination, seconds)
), expired AS (
    UPDATE outbox_message m
    SET state = 'unknown',
        unknown_since = now(),
        available_at = now() + COALESCE(
            (SELECT w.seconds FROM waits w WHERE w.destination = m.destination),
            %(default_wait)s) * interval '1 second',
        lease_expires_at = NULL,
        last_error = %(error)s
    WHERE state = 'in_flight' AND lease_expires_at < now()
      AND (CAST(%(only)s AS text[]) IS NULL OR m.destination = ANY(CAST(%(only)s AS text[])))
    RETURNING id, claim_token
), fenced AS (
    UPDATE outbox_attempt a
    SET outcome = 'lease_expired', finished_at = now()
    FROM expired e
    WHERE a.claim_token = e.claim_token AND a.finished_at IS NULL
    RETURNING a.id
)
SELECT (SELECT count(*) FROM expired), (SELECT count(*) FROM fenced)
"""


# A call of this row that the provider may hold and may have forgotten by now.
CALL_OLDER_THAN_KEY_TTL_SQL = f"""
SELECT 1 FROM outbox_attempt a
WHERE a.message_id = outbox_message.id AND {outcomes.may_have_taken_effect_sql("a")}
  AND a.started_at <= now() - CAST(%(key_ttl)s AS float8) * interval '1 second'
"""

# Parks a row whose lookup said "not found" when a call is older than key_ttl; a new reason is
# alerted again (alerted_at cleared), the same one only once.
_PARK_PAST_KEY_TTL = f"""
UPDATE outbox_message
SET available_at = now() + %(seconds)s * interval '1 second',
    alerted_at = CASE WHEN last_error IS DISTINCT FROM %(error)s THEN NULL ELSE alerted_at END,
    last_error = %(error)s
WHERE id = %(id)s AND state = 'unknown'
  AND claim_token IS NOT DISTINCT FROM CAST(%(token)s AS uuid)
  AND EXISTS ({CALL_OLDER_THAN_KEY_TTL_SQL})
RETURNING id
"""


# Resolution of an unknown row by a lookup: sent, pending (retry) or failed. The history entry
# names what the reconciler saw, never the payload. A retry is due %(delay)s seconds from the
# database's now, and fails the row instead when that falls on or after its deadline. A "not
# found" (or an idempotent retry) marks the row's ambiguous fence rows in the same statement
# (outbox.outcomes), and only while every call that may have taken effect is younger than the
# destination's key_ttl (database clock): past it, the provider may have forgotten the call, and
# the row does not move.
def _settle_unknown_sql(follow: bool) -> str:
    # As for the record (:func:`_record_sql`): the next steps' INSERT only in a statement of its own.
    chain_set = (
        ",\n    -- Next steps (outbox.chains): only of a row found sent; no compensation out of unknown.\n"
        f"    chain_problem = {_problem_sql('outbox_message', NEW_STATE_SQL)}"
        if follow
        else ""
    )
    follow_cte = _follow_sql("moved") if follow else ""
    return f"""
WITH moved AS (
UPDATE outbox_message
SET state = {NEW_STATE_SQL},
    chains_known_at = clock_timestamp(),
    provider_ref = COALESCE(%(ref)s, provider_ref),
    response = COALESCE(CAST(%(response)s AS jsonb), response),
    last_error = CASE WHEN {PAST_DEADLINE_SQL} THEN %(deadline_error)s ELSE %(error)s END,
    available_at = COALESCE({DUE_SQL}, available_at),
    dispatched_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE dispatched_at END,
    completed_at = CASE WHEN {NEW_STATE_SQL} IN ('sent', 'failed') THEN now() END,
    lease_expires_at = NULL,
    unknown_since = NULL,
    -- A row alerted while unknown is alerted again if it ends up failed.
    alerted_at = NULL,
    history = history || jsonb_build_array(jsonb_build_object(
        'at', now(), 'by', 'reconciler', 'action', 'lookup',
        'result', CAST(%(result)s AS text), 'state', {NEW_STATE_SQL},
        'provider_ref', CAST(%(ref)s AS text))){chain_set}
WHERE id = %(id)s AND state = 'unknown'
  AND claim_token IS NOT DISTINCT FROM CAST(%(token)s AS uuid)
  AND (CAST(%(key_ttl)s AS float8) IS NULL OR NOT EXISTS ({CALL_OLDER_THAN_KEY_TTL_SQL}))
RETURNING id, key, state, trace_context
){follow_cte}, settled AS (
    UPDATE outbox_attempt a SET settled = %(settled)s, settled_at = now()
    FROM moved
    WHERE a.message_id = moved.id AND CAST(%(settled)s AS text) IS NOT NULL
      AND {outcomes.unsettled_ambiguous_sql("a")}
)
SELECT state FROM moved
"""


_SETTLE_UNKNOWN = _settle_unknown_sql(follow=False)
_SETTLE_UNKNOWN_FOLLOW = _settle_unknown_sql(follow=True)

# The next lookup waits as long as the row has already waited (10 s to 1 h): a provider that is
# down for hours is not asked every few seconds, a blip is retried quickly.
_DEFER_UNKNOWN = """
UPDATE outbox_message
SET available_at = now() + LEAST(3600, GREATEST(10,
        EXTRACT(EPOCH FROM now() - COALESCE(unknown_since, now())))) * interval '1 second',
    last_error = COALESCE(%(error)s, last_error)
WHERE id = %(id)s AND state = 'unknown'
  AND claim_token IS NOT DISTINCT FROM CAST(%(token)s AS uuid)
RETURNING id
"""

_PARK_UNKNOWN = """
UPDATE outbox_message
SET available_at = now() + %(seconds)s * interval '1 second',
    last_error = %(error)s
WHERE id = %(id)s AND state = 'unknown'
  AND claim_token IS NOT DISTINCT FROM CAST(%(token)s AS uuid)
RETURNING id
"""


# One statement for the batch, each row guarded by its own state and dispatch time: a row that a
# consumer claimed, or that was already re-queued and published again, does not match.
# last_error says why the row is pending again (`outbox show`), and makes the latency metrics
# count it from its writing: available_at moves here, so it no longer tells a row written for
# later.
_REQUEUE = """
UPDATE outbox_message m
SET state = 'pending', available_at = now(), dispatched_at = NULL,
    last_error = 're-queued by the reconciler: its message was no longer in Redis'
FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(dispatched)s AS timestamptz[])) AS r(id, dispatched_at)
WHERE m.id = r.id AND m.state = 'dispatched' AND m.dispatched_at = r.dispatched_at
RETURNING m.id
"""


# The row moves into the key ledger in the statement that deletes it: no moment exists where the
# key is in neither table (the insert guard would let a new row for it through). Its fence rows
# are read here, in the statement's snapshot, before the cascade removes them.
#
# A transaction whose snapshot predates a row's insertion sees neither the row nor its ledger
# entry, so the guard cannot stop it from inserting the key again; such a snapshot is older than
# the row's completed_at. Rows completed after the oldest open client transaction began wait for
# it to end. Sessions of other roles show no xact_start without pg_read_all_stats: the hold-back
# would be blind to them, so without that privilege the reconciler does not run the purge.
_PURGE = """
WITH gone AS (
    DELETE FROM outbox_message
    WHERE id IN (
        SELECT id FROM outbox_message
        WHERE state IN ('sent', 'cancelled')
          -- A sent row whose next steps are missing (outbox.chains) stays until outbox repair
          -- writes them: the ledger keeps no chain_problem, and the chain would be forgotten.
          AND chain_problem IS NULL
          -- A batch's members stay until it is finished: its counts and its outcome are theirs.
          AND (batch_id IS NULL
               OR EXISTS (SELECT 1 FROM outbox_batch b WHERE b.id = batch_id AND b.finished_at IS NOT NULL))
          AND completed_at < now() - %(retention)s * interval '1 second'
          AND completed_at < COALESCE(
              (SELECT min(xact_start) FROM pg_stat_activity
               WHERE datname = current_database() AND backend_type = 'client backend'
                 AND pid <> pg_backend_pid()),
              'infinity')
        ORDER BY completed_at
        LIMIT %(limit)s
    )
    AND state IN ('sent', 'cancelled')
    RETURNING id, key, step, destination, payload, state, provider_ref, completed_at, history, parent_id, via,
              batch_id
),
ledgered AS (
    INSERT INTO outbox_key_ledger AS l (
        message_id, completed_at, attempts, confirmed, ambiguous,
        key, step, destination, payload_hash, state, provider_ref, parent_id, via, batch_id)
    SELECT g.id, g.completed_at, f.claims, f.confirmed,
           f.ambiguous OR g.history @> '[{"action": "resolve", "from": "unknown"}]'::jsonb,
           g.key, g.step, g.destination, outbox_payload_digest(g.payload),
           g.state, g.provider_ref, g.parent_id, g.via, g.batch_id
    FROM gone g CROSS JOIN LATERAL (
        SELECT count(*) AS claims,
               count(*) FILTER (WHERE a.outcome IN ('sent', 'superseded:sent')) AS confirmed,
               -- A claim that never recorded an outcome is as unknown as one that said so.
               COALESCE(bool_or(a.outcome IS NULL
                                OR a.outcome IN ('unknown', 'lease_expired',
                                                 'superseded:unknown', 'superseded:lease_expired')),
                        false) AS ambiguous
        FROM outbox_attempt a WHERE a.message_id = g.id
    ) f
    -- Only reachable when something bypassed the insert guard (triggers disabled, replication
    -- role): keep the evidence of both rows rather than lose the older one.
    ON CONFLICT (key, step) DO UPDATE SET
        message_id = EXCLUDED.message_id, completed_at = EXCLUDED.completed_at,
        attempts = l.attempts + EXCLUDED.attempts, confirmed = l.confirmed + EXCLUDED.confirmed,
        ambiguous = l.ambiguous OR EXCLUDED.ambiguous, destination = EXCLUDED.destination,
        payload_hash = EXCLUDED.payload_hash, state = EXCLUDED.state,
        provider_ref = EXCLUDED.provider_ref
    RETURNING 1
)
SELECT count(*) FROM ledgered
"""


_MARK_ALERTED = """
UPDATE outbox_message
SET alerted_at = now()
WHERE id = %(id)s AND state = %(state)s AND alerted_at IS NULL
RETURNING id
"""


def expire_leases(
    conn: psycopg.Connection[Any],
    *,
    waits_seconds: Mapping[str, float],
    default_wait_seconds: float,
    error: str,
    only_destinations: Sequence[str] | None = None,
) -> int:
    """``in_flight`` -> ``unknown`` for every row whose lease has expired; how many moved.

    Its first lookup is due ``waits_seconds[destination]`` later (one ``time_limit`` of its
    destination), ``default_wait_seconds`` for a destination not named. One statement, so it is
    safe against a consumer recording at the same moment: whichever commits first wins, and the
    other's guard no longer matches. On a connection inside a transaction the caller commits.
    ``only_destinations``: those destinations' rows only (test helpers); None: every row.
    """
    params = {
        "only": list(only_destinations) if only_destinations is not None else None,
        "error": error,
        "destinations": list(waits_seconds),
        "waits": [float(w) for w in waits_seconds.values()],
        "default_wait": float(default_wait_seconds),
    }
    row = conn.execute(_EXPIRE_LEASES, params).fetchone()
    return int(row[0]) if row else 0


def settle_unknown(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    token: uuid.UUID | None,
    state: str,
    result: str,
    error: str | None = None,
    ref: str | None = None,
    response: dict[str, Any] | None = None,
    delay_seconds: float | None = None,
    deadline_error: str | None = None,
    settled: str | None = None,
    key_ttl: float | None = None,
    follow: chains.Plan = chains.NOTHING,
) -> str | None:
    """``unknown`` -> ``state`` (sent, pending or failed) after a lookup: the state the row moved
    to, or None when it had moved meanwhile (or, with ``key_ttl``, when a call that may have
    taken effect is older than it). ``settled`` marks the row's ambiguous fence rows in the same
    statement (:mod:`outbox.outcomes`); ``follow``'s ``then`` steps are written with a ``sent``
    (never its ``on_failure`` steps: a failure out of unknown is not certain)."""
    params = {
        "follow": follow.param,
        "chain_problem": follow.problem,
        **_stored(ref=ref, response=response, error=error, deadline_error=deadline_error),
        "settled": settled,
        "key_ttl": key_ttl,
        "id": row_id,
        "token": token,
        "state": state,
        "result": result,
        "delay": delay_seconds,
    }
    statement = _SETTLE_UNKNOWN if follow.param is None and follow.problem is None else _SETTLE_UNKNOWN_FOLLOW
    moved = conn.execute(statement, params).fetchone()
    return str(moved[0]) if moved is not None else None


def park_past_key_ttl(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    token: uuid.UUID | None,
    seconds: float,
    error: str,
    key_ttl: float,
) -> bool:
    """An ``unknown`` row stays unknown, looked at again in ``seconds``, with ``error`` as its
    reason, when one of its calls that may have taken effect is older than ``key_ttl``: the
    provider may have forgotten it, and "not found" proves nothing. False when the row moved
    meanwhile or no call is that old."""
    params = {"id": row_id, "token": token, "seconds": seconds, "error": error, "key_ttl": key_ttl}
    return conn.execute(_PARK_PAST_KEY_TTL, params).fetchone() is not None


def park_unknown(
    conn: psycopg.Connection[Any], *, row_id: int, token: uuid.UUID | None, seconds: float, error: str
) -> bool:
    """An ``unknown`` row waits ``seconds`` for a human (``outbox resolve``), with the reason."""
    params = {"id": row_id, "token": token, "seconds": seconds, "error": sanitize.clean_text(error)}
    return conn.execute(_PARK_UNKNOWN, params).fetchone() is not None


def defer_unknown(
    conn: psycopg.Connection[Any], *, row_id: int, token: uuid.UUID | None, error: str | None
) -> bool:
    """An ``unknown`` row is looked up again later (as long again as it has waited, 10 s to 1 h)."""
    params = {"id": row_id, "token": token, "error": sanitize.clean_optional_text(error)}
    return conn.execute(_DEFER_UNKNOWN, params).fetchone() is not None


def requeue(conn: psycopg.Connection[Any], rows: Sequence[tuple[int, datetime]]) -> int:
    """``dispatched`` -> ``pending`` for each ``(id, dispatched_at)`` still dispatched at that
    time (its Redis message is gone); how many moved."""
    if not rows:
        return 0
    params = {"ids": [r[0] for r in rows], "dispatched": [r[1] for r in rows]}
    return len(conn.execute(_REQUEUE, params).fetchall())


# A destination held back (paused, or its breaker open) has no claim to fail its rows whose
# deadline passes (the claim would, "deadline passed before the call"): the reconciler does,
# so that the failure is reported when it happens, not when the provider is back. No call
# follows a deadline either way. A row whose earlier call may have taken effect (an idempotent
# destination's ambiguous call, retried) is not failed but sent to `unknown`: the lookup (or a
# human) says whether the provider holds it (attack on issue 13, F1: failed, it hid a charge).
_HELD_BACK_BECAUSE = (
    "' passed while its destination was held back ('"
    " || CASE WHEN d.paused_until > now() THEN 'paused' ELSE 'its breaker open' END || ')'"
)
_FAIL_PAST_DEADLINE = f"""
WITH due AS (
    SELECT om.id,
           EXISTS (SELECT 1 FROM outbox_attempt a
                   WHERE a.message_id = om.id AND {outcomes.may_have_taken_effect_sql("a")}) AS called
    FROM outbox_message om
    WHERE om.state IN ('pending', 'dispatched') AND om.deadline IS NOT NULL AND om.deadline <= now()
      AND om.destination = ANY(%(destinations)s)
    ORDER BY om.deadline
    LIMIT %(limit)s
    FOR UPDATE OF om SKIP LOCKED
)
UPDATE outbox_message m
SET state = CASE WHEN due.called THEN 'unknown' ELSE 'failed' END,
    completed_at = CASE WHEN due.called THEN NULL ELSE now() END,
    unknown_since = CASE WHEN due.called THEN now() END,
    available_at = CASE WHEN due.called THEN now() ELSE m.available_at END,
    dispatched_at = NULL, alerted_at = NULL,
    -- Failed before a claim recorded its handler's on_failed_head: the reconciler's module says
    -- it (outbox.ordering; attack on issue 15, A3).
    skip_when_failed = m.skip_when_failed OR m.destination = ANY(%(skip_when_failed)s),
    last_error = 'deadline ' || to_char(m.deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
                 || {_HELD_BACK_BECAUSE}
                 || CASE WHEN due.called
                         THEN '; an earlier call may have taken effect: the lookup decides'
                         ELSE '; no call was made after it' END
FROM due, outbox_destination d
WHERE m.id = due.id
  AND m.state IN ('pending', 'dispatched')
  AND d.destination = m.destination
  AND (d.paused_until > now() OR d.breaker_opened_at IS NOT NULL)
RETURNING m.state
"""


@dataclass(frozen=True)
class PastDeadline:
    failed: int = 0
    #: Rows whose earlier call may have taken effect: sent to `unknown` for the lookup.
    unknown: int = 0


def fail_past_deadline(
    conn: psycopg.Connection[Any],
    *,
    destinations: Sequence[str],
    limit: int,
    skip_when_failed: Sequence[str] = (),
) -> PastDeadline:
    """``pending``/``dispatched`` -> ``failed`` for up to ``limit`` rows of ``destinations`` whose
    deadline has passed while their destination is held back (paused, or its breaker open:
    no claim comes to fail them); -> ``unknown`` instead for a row whose earlier call may have
    taken effect. ``skip_when_failed``: the destinations whose handler says
    ``on_failed_head="skip"`` (their failed rows let their ordering keys go on)."""
    if not destinations:
        return PastDeadline()
    params = {"destinations": list(destinations), "limit": limit, "skip_when_failed": list(skip_when_failed)}
    moved = [r[0] for r in conn.execute(_FAIL_PAST_DEADLINE, params).fetchall()]
    return PastDeadline(failed=moved.count("failed"), unknown=moved.count("unknown"))


# The next steps of a row already sent (outbox.chains): written late, by the reconciler for a row
# an operator resolved without the handler module, or by `outbox repair`. Guarded by the
# chain_problem the caller read, so that two writers do not both report; the steps themselves
# are unique by (key, step) either way.
_WRITE_NEXT_STEPS = f"""
WITH moved AS (
    UPDATE outbox_message
    SET chain_problem = NULLIF(concat_ws('; ', CAST(%(chain_problem)s AS text),
                                         {_conflict_sql("outbox_message", "'sent'")}), ''),
        -- A new problem is alerted (again).
        alerted_at = NULL
    WHERE id = %(id)s AND state = 'sent' AND chain_problem IS NOT DISTINCT FROM %(expected)s
    RETURNING id, key, state, trace_context, chain_problem
){_follow_sql("moved")}
SELECT (SELECT count(*) FROM followed), chain_problem FROM moved
"""


# Rows marked "next steps not computed" whose steps need no computing: their destination's
# handler declares no @then, or a step of theirs exists (the settling release wrote it). One
# statement for many: a release before 0022 marks every row it settles (migration 0022).
_CLEAR_UNCOMPUTED = f"""
UPDATE outbox_message m SET chain_problem = NULL
WHERE m.id IN (
    SELECT id FROM outbox_message
    WHERE chain_problem = %(marker)s AND alerted_at IS NULL AND state = 'sent'
      AND (destination = ANY(%(no_then)s)
           OR EXISTS (SELECT 1 FROM outbox_message c WHERE c.key = outbox_message.key
                        AND c.parent_id = outbox_message.id AND c.via = '{chains.THEN}'))
    ORDER BY id LIMIT %(limit)s)
  AND m.chain_problem = %(marker)s AND m.state = 'sent'
"""


def clear_uncomputed(conn: psycopg.Connection[Any], *, no_then: Sequence[str], limit: int) -> int:
    """``sent`` rows marked :data:`outbox.chains.NOT_COMPUTED` whose destination has no ``@then``
    (``no_then``) or whose ``then`` step exists lose the mark, at most ``limit``; how many."""
    cur = conn.execute(
        _CLEAR_UNCOMPUTED, {"marker": chains.NOT_COMPUTED, "no_then": list(no_then), "limit": limit}
    )
    return cur.rowcount


def write_next_steps(
    conn: psycopg.Connection[Any], *, row_id: int, follow: chains.Plan, expected_problem: str | None
) -> Recorded | None:
    """Write ``follow``'s ``then`` steps after the ``sent`` row ``row_id`` and set its
    ``chain_problem`` to what is still missing, only while its ``chain_problem`` is still
    ``expected_problem`` (what the caller read); None when it was not."""
    params = {
        "id": row_id,
        "expected": expected_problem,
        "follow": follow.param,
        "chain_problem": follow.problem,
    }
    row = conn.execute(_WRITE_NEXT_STEPS, params).fetchone()
    return Recorded("sent", int(row[0]), row[1]) if row is not None else None


# `outbox repair` (outbox.ops.repair) of a row failed with an ambiguous history (a call that may
# have taken effect: failed past its deadline out of unknown, or by an operator's resolve --failed)
# whose provider, asked through the lookup, has the call: failed -> sent with its reference, and
# its then steps written by the same statement. Guarded by the failure the operator's plan read
# (completed_at is set anew at every failure), refused when the row's compensation was written (a
# charge that both happened and was undone is for a human to untangle), and refused when an
# operator failed it (resolve --failed: "refunded by hand") unless this repair overrules that by
# name, with --force and a reason (%(overrule)s; %(extra)s then says so in the history).
_REPAIR_FOUND = f"""
WITH moved AS (
    UPDATE outbox_message m
    SET state = 'sent', provider_ref = %(ref)s, response = COALESCE(CAST(%(response)s AS jsonb), response),
        chains_known_at = clock_timestamp(),
        last_error = NULL, completed_at = now(), alerted_at = NULL, unknown_since = NULL,
        lease_expires_at = NULL,
        chain_problem = {_problem_sql("m", "'sent'")},
        history = history || jsonb_build_array(jsonb_build_object(
            'at', now(), 'by', CAST(%(by)s AS text), 'action', 'repair', 'reason', CAST(%(reason)s AS text),
            'from', 'failed', 'to', 'sent', 'result', 'found', 'provider_ref', CAST(%(ref)s AS text))
            || CAST(%(extra)s AS jsonb))
    WHERE m.id = %(id)s AND m.state = 'failed' AND m.completed_at IS NOT DISTINCT FROM %(version)s
      AND NOT {chains.COMPENSATED_SQL}
      AND (CAST(%(overrule)s AS boolean) OR NOT {outcomes.operator_failed_unknown_sql("m")})
    RETURNING m.id, m.key, m.state, m.trace_context
){_follow_sql("moved")}
SELECT (SELECT count(*) FROM followed) FROM moved
"""

# A line of a row's history for an action whose own statement wrote none of its own (a lookup
# asked by `outbox repair`, the next steps it wrote): who asked and why.
_NOTE_HISTORY = """
UPDATE outbox_message
SET history = history || jsonb_build_array(jsonb_build_object(
    'at', now(), 'by', CAST(%(by)s AS text), 'action', CAST(%(action)s AS text),
    'reason', CAST(%(reason)s AS text)) || CAST(%(extra)s AS jsonb))
WHERE id = %(id)s
"""


def repair_found(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    version: datetime | None,
    ref: str | None,
    response: dict[str, Any] | None,
    follow: chains.Plan,
    by: str,
    reason: str | None,
    overrule: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> int | None:
    """``failed`` -> ``sent`` for a row whose lookup found the call (``outbox repair``), with
    ``follow``'s ``then`` steps: how many were written, or None when the row did not move (it
    changed since ``version``, its failure time, its compensation exists, or an operator failed
    it and ``overrule`` is false). ``extra``: more of the history entry (forced, overrode)."""
    params = {
        **_stored(ref=ref, response=response, error=None, deadline_error=None),
        "id": row_id,
        "version": version,
        "follow": follow.param,
        "chain_problem": follow.problem,
        "by": by,
        "reason": reason,
        "overrule": overrule,
        "extra": json.dumps(dict(extra or {})),
    }
    row = conn.execute(_REPAIR_FOUND, params).fetchone()
    return int(row[0]) if row is not None else None


def note_history(
    conn: psycopg.Connection[Any], *, row_id: int, by: str, action: str, reason: str | None, extra: str
) -> None:
    """Append ``{at, by, action, reason, **extra}`` (``extra``: a JSON object) to the row's history."""
    conn.execute(_NOTE_HISTORY, {"id": row_id, "by": by, "action": action, "reason": reason, "extra": extra})


def purge(conn: psycopg.Connection[Any], *, retention_seconds: float, limit: int) -> int:
    """``sent``/``cancelled`` rows completed more than ``retention_seconds`` ago (and before the
    oldest open client transaction began) leave the table for the key ledger, at most ``limit``;
    how many moved. Needs a role that sees every session's ``xact_start`` (superuser or
    ``pg_read_all_stats``): the caller checks."""
    row = conn.execute(_PURGE, {"retention": float(retention_seconds), "limit": limit}).fetchone()
    return int(row[0]) if row else 0


def mark_alerted(conn: psycopg.Connection[Any], *, row_id: int, state: str) -> bool:
    """A ``failed`` or ``unknown`` row was reported: not again until it changes."""
    return conn.execute(_MARK_ALERTED, {"id": row_id, "state": state}).fetchone() is not None


# == the operator: replay, resolve, cancel, in the caller's transaction ============================

# `from` is the state the row had (SET expressions read the old row), `at` the database clock.
HISTORY_ENTRY = """
history = history || jsonb_build_array(jsonb_build_object(
    'at', now(), 'by', CAST(:by AS text), 'action', CAST(:action AS text),
    'reason', CAST(:reason AS text), 'from', state, 'to', CAST(:to_state AS text)) || CAST(:extra AS jsonb))
"""

# claim_token and provider_ref stay: they are the evidence of the earlier attempts. The replayed
# row goes through the normal claim, which is what rules out a call for a row already sent.
_REPLAY_SET = (
    """
SET state = 'pending', attempts = 0, available_at = now(),
    dispatched_at = NULL, completed_at = NULL, alerted_at = NULL,
    unknown_since = NULL, lease_expires_at = NULL,
    -- Back in its ordering key's line: a new failure blocks again unless its next claim's
    -- handler, or an operator, says otherwise (attack on issue 15, A2).
    order_skipped_at = NULL, skip_when_failed = false,
"""
    + HISTORY_ENTRY
)

# The replay rules (outbox.outcomes): a fence row that may have taken effect, or an operator's
# `resolve --failed` out of unknown, refuses the replay unless the row is forced by name.
BLOCKING_ATTEMPT_SQL = (
    f"SELECT 1 FROM outbox_attempt a WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql('a')}"
)
REPLAYABLE_SQL = (
    f"NOT EXISTS ({BLOCKING_ATTEMPT_SQL}) AND NOT {outcomes.operator_failed_unknown_sql('m')}"
    # Its compensation ran (or will): replaying the step would undo the undo.
    f" AND NOT {chains.COMPENSATED_SQL}"
    # It let its ordering key go on without it: replayed, it would break the order.
    f" AND NOT {ordering.out_of_line_sql('m')}"
)


# Acts on exactly the previewed rows: each one only if it is still failed with the failure the
# preview saw (completed_at is set anew at every failure), and only if the rules still allow it.
_REPLAY_PLANNED = f"""
UPDATE outbox_message m {_REPLAY_SET}
FROM unnest(CAST(:ids AS bigint[]), CAST(:versions AS timestamptz[])) AS p(id, failed_at)
WHERE m.id = p.id AND m.state = 'failed' AND m.completed_at IS NOT DISTINCT FROM p.failed_at
  AND {REPLAYABLE_SQL}
RETURNING m.id, m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline
"""

# One row, named by the operator with a reason: the fence rows the preview showed are marked as
# forced over in the same statement. A blocker the operator did not see refuses the whole thing,
# and so does an operator's resolve --failed unless the caller overrules it (:overrule: a forced
# replay, a forced repair; not a repair's re-run on a lookup's "not found").
_REPLAY_FORCED = f"""
WITH moved AS (
    UPDATE outbox_message m {_REPLAY_SET}
    WHERE m.id = :id AND m.state = 'failed'
      AND m.completed_at IS NOT DISTINCT FROM CAST(:version AS timestamptz)
      AND NOT EXISTS ({BLOCKING_ATTEMPT_SQL} AND a.id <> ALL(CAST(:seen AS bigint[])))
      AND (CAST(:overrule AS boolean) OR NOT {outcomes.operator_failed_unknown_sql("m")})
    RETURNING m.id, m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline
), forced AS (
    UPDATE outbox_attempt a SET settled = '{outcomes.OPERATOR_FORCED}', settled_at = now()
    FROM moved WHERE a.message_id = moved.id AND a.id = ANY(CAST(:seen AS bigint[]))
)
SELECT id, past_deadline FROM moved
"""


def _sqlalchemy(sql: str) -> str:
    """psycopg's ``%(name)s`` placeholders as SQLAlchemy's ``:name``: the chain fragments
    (outbox.chains) serve both drivers."""
    return re.sub(r"%\((\w+)\)s", r":\1", sql)


# The row's then steps (outbox.chains) are written by the same statement.
_RESOLVE_SENT = f"""
WITH moved AS (
    UPDATE outbox_message
    SET state = 'sent', provider_ref = :ref, completed_at = now(), last_error = NULL,
        response = CAST(:response AS jsonb), chains_known_at = clock_timestamp(),
        unknown_since = NULL, lease_expires_at = NULL, alerted_at = NULL,
        chain_problem = {_sqlalchemy(_problem_sql("outbox_message", "'sent'"))},
    {HISTORY_ENTRY}
    WHERE id = :id AND state = 'unknown'
    RETURNING id, key, state, trace_context
){_sqlalchemy(_follow_sql("moved"))}
SELECT id, (SELECT count(*) FROM followed) FROM moved
"""
# attempts stay: the earlier call is known not to have taken effect, but it counted. The row's
# ambiguous fence rows are marked settled in the same statement (what lets a later replay through);
# a call the provider confirmed is not "not sent", whatever anyone says, so it refuses.
_RESOLVE_NOT_SENT = f"""
WITH moved AS (
    UPDATE outbox_message m
    SET state = 'pending', available_at = now(), dispatched_at = NULL, completed_at = NULL,
        unknown_since = NULL, lease_expires_at = NULL,
    {HISTORY_ENTRY}
    WHERE m.id = :id AND m.state = 'unknown'
      AND NOT EXISTS (SELECT 1 FROM outbox_attempt a WHERE a.message_id = m.id
                      AND {outcomes.is_confirmed_sql("a")}
                      AND a.settled IS DISTINCT FROM '{outcomes.OPERATOR_FORCED}')
    RETURNING m.id
), settled AS (
    UPDATE outbox_attempt a SET settled = '{outcomes.OPERATOR_NOT_SENT}', settled_at = now()
    FROM moved WHERE a.message_id = moved.id AND {outcomes.unsettled_ambiguous_sql("a")}
)
SELECT id FROM moved
"""
_RESOLVE_FAILED = (
    """
UPDATE outbox_message
SET state = 'failed', last_error = :error, completed_at = now(),
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
)


# An operator lets an ordering key go past its failed head (the AFTER UPDATE trigger wakes the
# relay). A failed row only: an unknown or in_flight head may have charged, and is never skipped.
_SKIP_HEAD = (
    """
UPDATE outbox_message
SET order_skipped_at = now(),
"""
    + HISTORY_ENTRY
    + """ WHERE id = :id AND state = 'failed' AND ordering_key IS NOT NULL
        AND order_skipped_at IS NULL AND NOT skip_when_failed RETURNING id"""
)


# The operator's guard is wider than outbox.cancel's (:func:`cancel_by_key`: only a row no
# consumer ever claimed): a pending or dispatched row whose every call is known not to have taken effect
# (a safe outcome, or an ambiguous call settled). Without it a row re-pending after a failover,
# or one of a retired destination with an earlier 503, could be stopped by nothing and would be
# called again. A call that may have taken effect still refuses: cancelling would hide a charge.
CANCELLABLE_SQL = f"""state IN ('pending', 'dispatched')
    AND NOT EXISTS (SELECT 1 FROM outbox_attempt a WHERE a.message_id = outbox_message.id
                    AND NOT {outcomes.known_not_taken_effect_sql("a")})"""

_CANCEL_ROWS = (
    """
UPDATE outbox_message
SET state = 'cancelled', completed_at = now(), claim_token = NULL, last_error = :error,
"""
    + HISTORY_ENTRY
    + f" WHERE id = ANY(:ids) AND {CANCELLABLE_SQL} RETURNING id"
)


def replay_planned(
    connection: Connection,
    *,
    ids: Sequence[int],
    versions: Sequence[datetime | None],
    history: Mapping[str, Any],
) -> list[Any]:
    """``failed`` -> ``pending`` (attempts reset) for each of ``ids`` still failed with the
    failure its preview saw (``versions``: its ``completed_at`` then) and still replayable under
    the rules; returns ``(id, past_deadline)`` per row moved. ``history``: the entry's
    ``action``, ``to_state``, ``by``, ``reason``, ``extra`` (JSON text)."""
    params = {**history, "ids": list(ids), "versions": list(versions)}
    return list(connection.execute(_text(_REPLAY_PLANNED), params))


def replay_forced(
    connection: Connection,
    *,
    row_id: int,
    version: datetime | None,
    seen: Sequence[int],
    history: Mapping[str, Any],
    overrule: bool = True,
) -> Any | None:
    """``failed`` -> ``pending`` for one row the rules refuse, named with a reason: only if no
    blocking fence row other than ``seen`` (the ones the operator was shown) exists; those are
    marked ``operator_forced``. ``overrule``: also over an operator's ``resolve --failed``.
    ``(id, past_deadline)``, or None when it did not move."""
    params = {**history, "id": row_id, "version": version, "seen": list(seen), "overrule": overrule}
    return connection.execute(_text(_REPLAY_FORCED), params).first()


def resolve_sent(
    connection: Connection,
    *,
    row_id: int,
    ref: str,
    history: Mapping[str, Any],
    follow: chains.Plan = chains.NOTHING,
    response: str | None = None,
) -> int | None:
    """``unknown`` -> ``sent`` with the provider's reference an operator found (and ``response``,
    the summary as stored: :func:`outbox.sanitize.encode_response`'s text), and ``follow``'s
    ``then`` steps written; how many were, or None when the row did not move."""
    params = {
        **history,
        "id": row_id,
        "ref": ref,
        "response": response,
        "follow": follow.param,
        "chain_problem": follow.problem,
    }
    row = connection.execute(_text(_RESOLVE_SENT), params).first()
    return int(row[1]) if row is not None else None


def resolve_not_sent(connection: Connection, *, row_id: int, history: Mapping[str, Any]) -> bool:
    """``unknown`` -> ``pending``, its ambiguous fence rows settled; refused (False) when a fence
    row holds a call the provider confirmed."""
    params = {**history, "id": row_id}
    return connection.execute(_text(_RESOLVE_NOT_SENT), params).first() is not None


def resolve_failed(connection: Connection, *, row_id: int, error: str, history: Mapping[str, Any]) -> bool:
    """``unknown`` -> ``failed`` with the operator's reason (a later replay needs ``--force``)."""
    params = {**history, "id": row_id, "error": error}
    return connection.execute(_text(_RESOLVE_FAILED), params).first() is not None


def skip_head(connection: Connection, *, row_id: int, history: Mapping[str, Any]) -> bool:
    """A ``failed`` row of an ordering key stops holding the rows behind it (outbox.ordering); it
    stays failed. False when it did not move (not failed, no ordering key, or skipped already)."""
    params = {**history, "id": row_id}
    return connection.execute(_text(_SKIP_HEAD), params).first() is not None


def cancel_rows(
    connection: Connection, *, ids: Sequence[int], error: str | None, history: Mapping[str, Any]
) -> set[int]:
    """``pending``/``dispatched`` -> ``cancelled`` for each of ``ids`` none of whose calls may have
    taken effect (:data:`CANCELLABLE_SQL`); the ids that moved."""
    params = {**history, "error": error, "ids": list(ids)}
    return {int(r[0]) for r in connection.execute(_text(_CANCEL_ROWS), params)}


# == tests: time passes ============================================================================

# Every instant of the rows (and of their fence rows) moves back together, as if `seconds` had
# passed on the database's clock: what was due in less than that is due, a lease that had less
# left has expired, a call older than key_ttl is so. Nothing else changes, so no state is
# reached that the product could not reach itself.
_ELAPSE = """
WITH moved AS (
    UPDATE outbox_message
    SET created_at = created_at - %(s)s * interval '1 second',
        available_at = available_at - %(s)s * interval '1 second',
        deadline = deadline - %(s)s * interval '1 second',
        dispatched_at = dispatched_at - %(s)s * interval '1 second',
        claimed_at = claimed_at - %(s)s * interval '1 second',
        lease_expires_at = lease_expires_at - %(s)s * interval '1 second',
        unknown_since = unknown_since - %(s)s * interval '1 second',
        completed_at = completed_at - %(s)s * interval '1 second',
        alerted_at = alerted_at - %(s)s * interval '1 second'
    WHERE CAST(%(ids)s AS bigint[]) IS NULL OR id = ANY(CAST(%(ids)s AS bigint[]))
    RETURNING id
), fenced AS (
    UPDATE outbox_attempt a
    SET started_at = started_at - %(s)s * interval '1 second',
        finished_at = finished_at - %(s)s * interval '1 second',
        settled_at = settled_at - %(s)s * interval '1 second'
    FROM moved WHERE a.message_id = moved.id
)
SELECT count(*) FROM moved
"""


def elapse(conn: Any, seconds: float, *, ids: Sequence[int] | None = None) -> int:
    """For tests and the demo: make ``seconds`` pass for the rows ``ids`` (all rows when None) by
    moving every instant they hold back by that much; how many rows. ``conn``: a psycopg
    connection or a SQLAlchemy ``Connection``/``Session`` (the caller commits unless it is in
    autocommit mode)."""
    params = {"s": float(seconds), "ids": list(ids) if ids is not None else None}
    if isinstance(conn, psycopg.Connection):
        row = conn.execute(_ELAPSE, params).fetchone()
    else:
        row = conn.execute(_text(_ELAPSE.replace("%(s)s", ":s").replace("%(ids)s", ":ids")), params).first()
    return int(row[0]) if row else 0
