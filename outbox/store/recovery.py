"""The reconciler's statements: expired leases, unknown rows settled by a lookup, deferred or
parked, lost messages re-queued, rows failed past their deadline, next steps written, finished
batches, the purge into the key ledger, alerts marked."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from .. import chains, outcomes, sanitize
from .sql import (
    DUE_SQL,
    LIMITED_SQL,
    NEW_STATE_SQL,
    PAST_DEADLINE_SQL,
    Recorded,
    conflict_sql,
    follow_sql,
    problem_sql,
    stored,
)

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
    SELECT m.state, m.priority, m.fairness_key FROM outbox_message m WHERE m.batch_id = %(id)s FOR SHARE
), counts AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE state = 'sent') AS sent,
           count(*) FILTER (WHERE state = 'failed') AS failed,
           count(*) FILTER (WHERE state = 'cancelled') AS cancelled,
           -- What the then/catch row inherits (outbox.windows): the members' highest priority,
           -- and their fairness key when they all share one.
           COALESCE(max(priority), 0) AS priority,
           CASE WHEN count(DISTINCT COALESCE(fairness_key, '')) = 1 THEN max(fairness_key) END AS fairness_key
    FROM members
), due AS (
    -- The batch row, locked: a second finisher waits here, then finds finished_at set.
    SELECT b.id, b.name, c.total, c.sent, c.failed, c.cancelled, c.priority, c.fairness_key,
           CASE WHEN c.failed > 0 THEN 'catch' ELSE 'then' END AS outcome,
           CASE WHEN c.failed > 0 THEN b.catch_step ELSE b.then_step END AS next_step
    FROM outbox_batch b, counts c
    WHERE b.id = %(id)s AND b.finished_at IS NULL AND c.sent + c.failed + c.cancelled = c.total
      AND NOT EXISTS ({LATE_RECORD_SQL})
    FOR UPDATE OF b
), written AS (
    INSERT INTO outbox_message (key, step, destination, payload, via, payload_version, priority,
                                fairness_key)
    SELECT d.name, d.next_step->>'step', d.next_step->>'destination', d.next_step->'payload',
           'batch_' || d.outcome, COALESCE(CAST(d.next_step->>'payload_version' AS integer), 1),
           d.priority, d.fairness_key
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


# The claim token is kept: a late recording by the same claim is better evidence than a lookup
# and may still settle the row (see :func:`record`). The attempt row is closed in the same statement,
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
        -- Its call may still land until then: an in-flight limit counts it (outbox.limits).
        landing_until = now() + COALESCE(
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
# found" (or an idempotent retry) marks the row's ambiguous attempt rows in the same statement
# (outbox.outcomes), and only while every call that may have taken effect is younger than the
# destination's key_ttl (database clock): past it, the provider may have forgotten the call, and
# the row does not move.
def _settle_unknown_sql(follow: bool) -> str:
    # As for the record (:func:`_record_sql`): the next steps' INSERT only in a statement of its own.
    chain_set = (
        ",\n    -- Next steps (outbox.chains): only of a row found sent; no compensation out of unknown.\n"
        f"    chain_problem = {problem_sql('outbox_message', NEW_STATE_SQL)}"
        if follow
        else ""
    )
    follow_cte = follow_sql("moved") if follow else ""
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
RETURNING id, key, state, trace_context, priority, fairness_key
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
# key is in neither table (the insert guard would let a new row for it through). Its attempt rows
# are read here, in the statement's snapshot, before the cascade removes them.
#
# A transaction whose snapshot predates a row's insertion sees neither the row nor its ledger
# entry, so the guard cannot stop it from inserting the key again; such a snapshot is older than
# the row's completed_at. Rows completed after the oldest open client transaction began wait for
# it to end. Sessions of other roles show no xact_start without pg_read_all_stats: the hold-back
# would be blind to them, so without that privilege the reconciler does not run the purge.
_PURGE = f"""
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
          AND completed_at >= COALESCE(CAST(%(after)s AS timestamptz), '-infinity')
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
           f.ambiguous OR g.history @> '[{{"action": "resolve", "from": "unknown"}}]'::jsonb,
           g.key, g.step, g.destination, outbox_payload_digest(g.payload),
           g.state, g.provider_ref, g.parent_id, g.via, g.batch_id
    FROM gone g CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE NOT {outcomes.is_fence_sql("a")}) AS claims,  -- committed claims
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
SELECT (SELECT count(*) FROM ledgered), (SELECT max(completed_at) FROM gone WHERE isfinite(completed_at))
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
    follow: chains.Plan = chains.NO_NEXT_STEPS,
) -> str | None:
    """``unknown`` -> ``state`` (sent, pending or failed) after a lookup: the state the row moved
    to, or None when it had moved meanwhile (or, with ``key_ttl``, when a call that may have
    taken effect is older than it). ``settled`` marks the row's ambiguous attempt rows in the same
    statement (:mod:`outbox.outcomes`); ``follow``'s ``then`` steps are written with a ``sent``
    (never its ``on_failure`` steps: a failure out of unknown is not certain)."""
    params = {
        "follow": follow.param,
        "chain_problem": follow.problem,
        **stored(ref=ref, response=response, error=error, deadline_error=deadline_error),
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


# A destination held back (paused, its breaker open, or limited: outbox.limits) may have no claim
# to fail its rows whose deadline passes (the claim would, "deadline passed before the call"):
# the reconciler does, so that the failure is reported when it happens, not when the provider
# is back. No call follows a deadline either way. A row whose earlier call may have taken effect
# (an idempotent destination's ambiguous call, retried) is not failed but sent to `unknown`: the
# lookup (or a human) says whether the provider holds it (failed, it could hide a charge the
# provider made).
_HELD_BACK_BECAUSE = (
    "' passed while its destination was held back ('"
    " || CASE WHEN d.paused_until > now() THEN 'paused'"
    " WHEN d.breaker_opened_at IS NOT NULL THEN 'its breaker open' ELSE 'limited' END || ')'"
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
    -- it (outbox.ordering).
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
  AND (d.paused_until > now() OR d.breaker_opened_at IS NOT NULL
       OR {LIMITED_SQL})
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
    deadline has passed while their destination is held back (paused, its breaker open, or
    limited: no claim may come to fail them); -> ``unknown`` instead for a row whose earlier call may have
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
                                         {conflict_sql("outbox_message", "'sent'")}), ''),
        -- A new problem is alerted (again).
        alerted_at = NULL
    WHERE id = %(id)s AND state = 'sent' AND chain_problem IS NOT DISTINCT FROM %(expected)s
    RETURNING id, key, state, trace_context, priority, fairness_key, chain_problem
){follow_sql("moved")}
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


@dataclass(frozen=True)
class Swept:
    """What one purge or drop statement removed: how many, and the newest ``completed_at`` among
    them (None when none), the ``after`` of the caller's next statement."""

    count: int
    newest: datetime | None


def purge(
    conn: psycopg.Connection[Any], *, retention_seconds: float, limit: int, after: datetime | None = None
) -> Swept:
    """``sent``/``cancelled`` rows completed more than ``retention_seconds`` ago (and before the
    oldest open client transaction began) leave the table for the key ledger, at most ``limit``,
    oldest first. Needs a role that sees every session's ``xact_start`` (superuser or
    ``pg_read_all_stats``): the caller checks.

    ``after``: only rows completed at or after it (None: any). The rows an earlier statement
    removed stay in the ``completed_at`` index as dead entries until a vacuum; the scan starts
    past them instead of stepping over every one. It only narrows the statement: a row it leaves
    out is purged by a later statement without it, never early."""
    row = conn.execute(
        _PURGE, {"retention": float(retention_seconds), "limit": limit, "after": after}
    ).fetchone()
    return Swept(int(row[0]), row[1]) if row else Swept(0, None)


def mark_alerted(conn: psycopg.Connection[Any], *, row_id: int, state: str) -> bool:
    """A ``failed`` or ``unknown`` row was reported: not again until it changes."""
    return conn.execute(_MARK_ALERTED, {"id": row_id, "state": state}).fetchone() is not None


# == destinations (outbox_destination): a held destination's alert, once per episode ==============

# Marked only while it is still the episode that was read (a new pause or trip since has its
# own start, and its own alert).
_MARK_DESTINATION = {
    "paused": """
        UPDATE outbox_destination SET pause_alerted_at = now()
        WHERE destination = %(d)s AND paused_at = %(since)s AND paused_until > now()
        RETURNING destination""",
    "breaker_open": """
        UPDATE outbox_destination SET breaker_alerted_at = now()
        WHERE destination = %(d)s AND COALESCE(breaker_since, breaker_opened_at) = %(since)s
          AND breaker_opened_at IS NOT NULL
        RETURNING destination""",
}
_CLEAR_DESTINATION = {
    "paused": """
        UPDATE outbox_destination SET pause_alerted_at = NULL
        WHERE destination = %(d)s AND pause_alerted_at IS NOT NULL
          AND NOT COALESCE(paused_until > now(), false)
          -- Resumed, or run out longer ago than a new hold would still continue it.
          AND (resumed_at = paused_until OR paused_until <= now() - %(gap)s * interval '1 second')
        RETURNING destination""",
    "breaker_open": """
        UPDATE outbox_destination SET breaker_alerted_at = NULL
        WHERE destination = %(d)s AND breaker_alerted_at IS NOT NULL AND breaker_opened_at IS NULL
          AND (breaker_closed_at IS NULL OR breaker_closed_at <= now() - %(gap)s * interval '1 second')
        RETURNING destination""",
}


def mark_destination_alerted(
    conn: psycopg.Connection[Any], kind: str, destination: str, *, since: Any
) -> bool:
    """The ``kind`` episode (``paused``, ``breaker_open``) of ``destination`` that began at
    ``since`` is alerted: False when another episode has begun since (it has its own alert)."""
    return conn.execute(_MARK_DESTINATION[kind], {"d": destination, "since": since}).fetchone() is not None


def clear_destination_alert(
    conn: psycopg.Connection[Any], kind: str, destination: str, *, gap_seconds: float
) -> bool:
    """The ``kind`` episode of ``destination`` is over (resumed, closed, or run out more than
    ``gap_seconds`` ago): its mark goes, so that the next episode is alerted. True when it went."""
    return (
        conn.execute(_CLEAR_DESTINATION[kind], {"d": destination, "gap": gap_seconds}).fetchone() is not None
    )


# == the key ledger (outbox_key_ledger): entries past the horizon ==================================

# Batches along the completed_at index: each is a short transaction, and the drop keeps pace with
# the purge (the job runs both) without one long DELETE holding locks or bloating at once.
# A batch member's entry stays while its batch does (a batch is held past the horizon by its
# then/catch row, e.g. one failed and waiting for a human): outbox.batch answers a retry of its
# transaction with the old batch, whose members must then answer with their old rows.
_DROP_LEDGER = """
WITH dropped AS (
    DELETE FROM outbox_key_ledger
    WHERE (key, step) IN (
        SELECT l.key, l.step FROM outbox_key_ledger l
        WHERE l.completed_at < now() - %(horizon)s * interval '1 second'
          AND l.completed_at >= COALESCE(CAST(%(after)s AS timestamptz), '-infinity')
          AND NOT EXISTS (SELECT 1 FROM outbox_batch b WHERE b.id = l.batch_id)
        ORDER BY l.completed_at
        LIMIT %(limit)s
    )
    AND completed_at < now() - %(horizon)s * interval '1 second'
    -- The re-check reads the completed_at index too when many entries are due: from the floor,
    -- or it steps over every dead entry the floor spares the selection.
    AND completed_at >= COALESCE(CAST(%(after)s AS timestamptz), '-infinity')
    AND NOT EXISTS (SELECT 1 FROM outbox_batch b WHERE b.id = outbox_key_ledger.batch_id)
    RETURNING completed_at
)
-- A hand-written infinite time would not come back as a Python datetime: no floor from it.
SELECT count(*), max(completed_at) FILTER (WHERE isfinite(completed_at)) FROM dropped
"""


def drop_ledger(
    conn: psycopg.Connection[Any], *, horizon_seconds: float, limit: int, after: datetime | None = None
) -> Swept:
    """Drop up to ``limit`` key-ledger entries older than ``horizon_seconds`` (never a batch
    member's while its batch is kept), oldest first. After that, the key is new to ``write``.
    ``after``: as :func:`purge`'s."""
    row = conn.execute(_DROP_LEDGER, {"horizon": horizon_seconds, "limit": limit, "after": after}).fetchone()
    return Swept(int(row[0]), row[1]) if row else Swept(0, None)


# == destinations without a consumer (outbox_no_consumer), and old heartbeats (outbox_process) ===

# One episode row per destination without a consumer: inserted at the first cycle, counted up at
# each next one; `since` is kept from the first cycle.
_EPISODE = """
INSERT INTO outbox_no_consumer AS e (destination, since, cycles, rows_waiting)
VALUES (%(destination)s, %(since)s, 1, %(rows)s)
ON CONFLICT (destination) DO UPDATE
SET cycles = e.cycles + 1, rows_waiting = EXCLUDED.rows_waiting
RETURNING cycles, alerted_at
"""

# A consumer appeared, or nothing waits any more: the episode is over, the next one alerts again.
_END_EPISODES = """
DELETE FROM outbox_no_consumer WHERE destination <> ALL(%(destinations)s) RETURNING destination
"""

_MARK_EPISODE_ALERTED = """
UPDATE outbox_no_consumer SET alerted_at = now()
WHERE destination = %(destination)s AND alerted_at IS NULL
RETURNING destination
"""

_PURGE_HEARTBEATS = """
DELETE FROM outbox_process WHERE last_seen_at < now() - %(retention)s * interval '1 second'
"""


def count_no_consumer_episode(
    conn: psycopg.Connection[Any], destination: str, *, since: Any, rows_waiting: int
) -> Any:
    """One more cycle of ``destination``'s episode without a consumer: ``(cycles, alerted_at)``."""
    params = {"destination": destination, "since": since, "rows": rows_waiting}
    return conn.execute(_EPISODE, params).fetchone()


def end_no_consumer_episodes(conn: psycopg.Connection[Any], *, keep: Sequence[str]) -> list[str]:
    """End every episode but those of ``keep``: the destinations whose episode ended."""
    return [r[0] for r in conn.execute(_END_EPISODES, {"destinations": list(keep)}).fetchall()]


def mark_no_consumer_alerted(conn: psycopg.Connection[Any], destination: str) -> bool:
    """The episode is alerted (once): False when another reconciler did it first."""
    return conn.execute(_MARK_EPISODE_ALERTED, {"destination": destination}).fetchone() is not None


def purge_heartbeats(conn: psycopg.Connection[Any], *, retention_seconds: float) -> int:
    """Drop the heartbeats of processes not heard from for ``retention_seconds``: how many."""
    return conn.execute(_PURGE_HEARTBEATS, {"retention": retention_seconds}).rowcount
