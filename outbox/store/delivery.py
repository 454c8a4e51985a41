"""The delivery's statements, run by the worker (outbox.consumer) for each message: the claim
(``pending``/``dispatched -> in_flight``, the lease, the attempt row), the record of the call's
outcome, the release of a claim that made no call, the failure of a row nobody handles."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from .. import chains, db, ordering, outcomes, sanitize
from ..schema import NOTIFY_CHANNEL
from ..settings import DESTINATION_EPISODE_GAP_SECONDS, PACE_AHEAD_SECONDS
from .sql import (
    ASYNC_COMMIT_SQL,
    BREAKER_CLOSE_SET,
    DUE_SQL,
    EPISODE_START_SQL,
    LIMITED_SQL,
    LOCK_WAIT_SQL,
    NEW_STATE_SQL,
    PAST_DEADLINE_SQL,
    Recorded,
    certain_failure_sql,
    follow_sql,
    problem_sql,
    stored,
)


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
def _old_call(row_id: str) -> str:
    return f"""
SELECT 1 FROM outbox_attempt a
WHERE a.message_id = {row_id} AND {outcomes.may_have_taken_effect_sql("a")}
  AND a.started_at <= now() - CAST(%(key_ttl)s AS float8) * interval '1 second'
"""


_OLD_CALL = _old_call("%(id)s")


# A row behind the head of its ordering key is not claimed, whatever brought its message (a
# re-dispatch, a replay): the order is kept by the claim too, not only by the relay.
def _claimable(rows: str, gate: str) -> str:
    return f"""
    {LOCK_WAIT_SQL}
    AND {rows} AND destination = %(destination)s
    AND (state = 'dispatched' OR (state = 'pending' AND available_at <= now()))
    AND NOT EXISTS (SELECT 1 FROM gate WHERE {gate})
    AND NOT {ordering.blocked_sql("outbox_message")}
"""


_CLAIMABLE = _claimable("id = %(id)s", "paused OR (open AND NOT probe_free)")


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


def _claimed(token: str, probe: bool) -> str:
    """The claim's UPDATE, its attempt row and its result; ``token``: the claim token's SQL,
    ``probe``: whether the statement has the ``probe`` CTE (a group has none)."""
    opened = (
        "(NOT EXISTS (SELECT 1 FROM gate WHERE open) OR EXISTS (SELECT 1 FROM probe))"
        if probe
        else "NOT EXISTS (SELECT 1 FROM gate WHERE open)"
    )
    got_probe = "EXISTS (SELECT 1 FROM probe)" if probe else "false"
    return (
        f"""
claimed AS (
    UPDATE outbox_message m
    SET state = 'in_flight',
        claim_token = {token},
        attempts = m.attempts + 1,
        -- The handler's on_failed_head (outbox.ordering): whether this row, failed, lets the
        -- rows of its ordering key behind it go.
        skip_when_failed = %(skip_when_failed)s,
        claimed_at = clock_timestamp(),
        lease_expires_at = clock_timestamp() + %(lease_seconds)s * interval '1 second',
        -- The latest start this claim accepts, should its destination be paced: the trigger of
        -- migration 0024 books the start (or refuses the claim) and puts it here, else NULL.
        call_at = clock_timestamp() + %(pace_ahead_seconds)s * interval '1 second'
    FROM held
    WHERE m.id = held.id
      AND m.destination = %(destination)s
      AND (m.state = 'dispatched' OR (m.state = 'pending' AND m.available_at <= now()))
      -- An open breaker lets only its probe through.
      AND {opened}
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
              m.trace_context, m.payload_version, m.call_at
), fence AS (
    -- started_at is the clock now, not now(): now() is when the statement arrived, before it
    -- was planned and took the snapshot that let the row go; a claim of the next row of an
    -- ordering key could then carry a start before the end of the claim it waited for.
    INSERT INTO outbox_attempt (message_id, attempt, claim_token, started_at)
    SELECT id, attempts, claim_token, clock_timestamp() FROM claimed
)
SELECT id, key, step, destination, payload, attempts, deadline, claim_token,
       COALESCE(deadline_passed, false), since_written, since_published, written_to_published,
       trace_context, {got_probe}, COALESCE((SELECT breaker_failures FROM gate), 0),
       false, payload_version,
       -- Whether an earlier claim's call may have taken effect: what decides a row that gets no
       -- call (deadline passed, payload invalid) between failed and unknown. Asked here, in the
       -- claim's snapshot (an earlier call's late record can only make it safer since), and
       -- only of a row claimed before: a first attempt had no earlier call.
       CASE WHEN attempts > 1 THEN EXISTS (
           SELECT 1 FROM outbox_attempt a
           WHERE a.message_id = claimed.id AND a.claim_token <> claimed.claim_token
             AND """
        + outcomes.may_have_taken_effect_sql("a")
        + """) ELSE false END,
       -- A paced destination's booked start (outbox.limits): seconds from now, on the database's
       -- clock, so that no two machines' clocks need agree.
       date_part('epoch', call_at - clock_timestamp())
FROM claimed"""
    )


_CLAIMED = _claimed("%(token)s", probe=True)


# Two statements, not one with a switch: with the key_ttl branch behind a parameter, PostgreSQL
# re-planned the whole statement at every execution (a custom plan pruned the branch, a generic
# one could not), which costs every claim CPU (docs/decisions/hot-path-costs.md).
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
SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, NULL, NULL, NULL, NULL, false, 0, true, NULL,
       false, NULL
FROM aged
"""


# A group: the rows of one fetch claimed in one statement and one commit, each under its own
# token (the ``rows`` CTE pairs them), locked in id order, so that two groups, or a group and the
# relay, wait for each other rather than deadlock. A group claims nothing while its destination's
# breaker is open: the half-open breaker's one probe is a single claim's (the rows the group left
# are claimed one at a time). A row it does not return was not claimable, or not claimable
# together: its delivery claims it alone, which finds out why.
_GROUP_ROWS = (
    "rows AS (SELECT * FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(tokens)s AS uuid[])) AS r(id, token))"
)
_GROUP_CLAIMABLE = _claimable("id IN (SELECT id FROM rows)", "paused OR open")


def _group_held(also: str = "") -> str:
    return f"""
held AS (
    SELECT outbox_message.id, rows.token FROM outbox_message JOIN rows USING (id)
    WHERE {_GROUP_CLAIMABLE}{also}
    ORDER BY outbox_message.id
    FOR UPDATE OF outbox_message
)"""


_GROUP_CLAIMED = _claimed("held.token", probe=False)


_CLAIM_GROUP = f"""
WITH {_GATE}, {_GROUP_ROWS}, {_group_held()}, {_GROUP_CLAIMED}
"""


_GROUP_OLD_CALL = _old_call("outbox_message.id")


_CLAIM_GROUP_IDEMPOTENT = f"""
WITH {_GATE}, {_GROUP_ROWS}, aged AS (
    UPDATE outbox_message
    SET state = 'unknown', unknown_since = now(), available_at = now(), last_error = %(aged_error)s
    WHERE {_GROUP_CLAIMABLE} AND EXISTS ({_GROUP_OLD_CALL})
    RETURNING id
), {_group_held(f" AND NOT EXISTS ({_GROUP_OLD_CALL})")}, {_GROUP_CLAIMED}
UNION ALL
SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, NULL, NULL, NULL, NULL, false, 0, true, NULL,
       false, NULL
FROM aged
"""


# The message row moves only if this claim still owns it: a late recording after the lease was
# taken over updates the attempt row alone, marked superseded. An `unknown` row with the same
# token is this claim's own call, expired by the reconciler: the worker's answer is better
# evidence than a lookup, so it may still settle it.
def _record_sql(follow: bool) -> str:
    """The record; ``follow``: with the CTEs that write the next steps (outbox.chains). Two
    statements, not one: the INSERT of an empty plan would still fire the table's statement-level
    NOTIFY trigger, waking the relay at every delivery (docs/decisions/hot-path-costs.md)."""
    chain_set = f",\n        chain_problem = {problem_sql('outbox_message', NEW_STATE_SQL)}" if follow else ""
    chain_returning = (
        f""", chain_problem,
              -- Compensation only for a certain failure (outbox.chains).
              CASE WHEN %(outcome)s = 'unknown' THEN false
                   ELSE {certain_failure_sql("outbox_message.id", "%(token)s")} END AS certain"""
        if follow
        else ""
    )
    follow_cte = follow_sql("moved", certain="moved.certain") if follow else ""
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
        -- An ambiguous call may still land until its first lookup: an in-flight limit counts it.
        landing_until = CASE WHEN %(state)s = 'unknown' THEN COALESCE({DUE_SQL}, available_at) END,
        dispatched_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE dispatched_at END,
        -- A row alerted while unknown and then settled must be able to alert again (failed).
        alerted_at = NULL,
        lease_expires_at = NULL{chain_set}
    -- A confirmed answer also settles a row that a lookup sent back (pending, dispatched) or
    -- failed while this claim's call was still on its way, as long as no newer claim owns it:
    -- the provider's confirmation beats the lookup's earlier "not found". Not an operator's
    -- resolve --failed ("refunded by hand"): only another operator overrules that (a forced
    -- repair or replay); the attempt row keeps the answer (superseded:sent, which the audit shows).
    WHERE {LOCK_WAIT_SQL} AND {ASYNC_COMMIT_SQL}
      AND id = %(id)s AND claim_token = %(token)s
      AND (state IN ('in_flight', 'unknown')
           OR (%(state)s = 'sent' AND state IN ('pending', 'dispatched'))
           OR (%(state)s = 'sent' AND state = 'failed'
               AND NOT {outcomes.operator_failed_unknown_sql("outbox_message")}))
    RETURNING id, key, state, last_error, trace_context, priority, fairness_key{chain_returning}
){follow_cte}
UPDATE outbox_attempt
SET finished_at = now(),
    -- An ambiguous call keeps "unknown" on its attempt row even when the row fails (an idempotent
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
# handler: outbox.payloads), the claim is not counted as an attempt, and the attempt row says
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
    WHERE {LOCK_WAIT_SQL} AND id = %(id)s AND claim_token = %(token)s AND state IN ('in_flight', 'unknown')
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
_FAIL_UNHANDLED = f"""
UPDATE outbox_message
SET state = 'failed', completed_at = now(), last_error = %(error)s
WHERE {LOCK_WAIT_SQL} AND id = %(id)s AND state IN ('pending', 'dispatched')
RETURNING id
"""


# A claim whose reply was lost may not have run yet: queued in a pooler, or in the network, it
# can still commit after the worker has moved on. Its attempt row carries its token under a
# unique index, so inserting that token first fences it: the late claim's insert then fails and
# the whole claim rolls back. A claim still running makes this insert wait for its end. Finding
# the token taken by anything but this fence means the claim committed. The fence row is no
# claim (attempt 0, outcome released: outbox.outcomes); a row gone meanwhile can be claimed by
# nothing either.
LOST_CLAIM_FENCE_ERROR = "fenced: the reply to this claim was lost before the claim committed; it never will"
_FENCE_LOST_CLAIM = f"""
WITH target AS (
    SELECT id FROM outbox_message WHERE {LOCK_WAIT_SQL} AND id = %(id)s
), fence AS (
    INSERT INTO outbox_attempt (message_id, attempt, claim_token, started_at, finished_at, outcome, error)
    SELECT id, {outcomes.FENCE_ATTEMPT}, %(token)s, now(), now(), 'released', %(error)s FROM target
    ON CONFLICT (claim_token) DO NOTHING
    RETURNING 1
)
SELECT NOT EXISTS (SELECT 1 FROM target) OR EXISTS (SELECT 1 FROM fence)
       OR EXISTS (SELECT 1 FROM outbox_attempt a
                  WHERE a.claim_token = %(token)s AND {outcomes.is_fence_sql("a")})
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
    #: An earlier claim of the row made a call the provider may hold (outbox.outcomes), as the
    #: claim saw it: False for a first attempt.
    earlier_call: bool = False
    #: Seconds to wait before the call, from when the claim's reply came: its paced destination
    #: booked this start (outbox.limits); 0 when unpaced or already due.
    pace_seconds: float = 0.0


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


# A claim a limit refused (the trigger of migrations 0023/0024) leaves the row as it was: still
# claimable, its destination limited. Paused rows, a row behind its ordering key and a row of a
# payload version not enabled yet are refused for their own reasons and are not held here.
# The claim statement reserves a half-open breaker's probe before its UPDATE meets the trigger:
# a probe reserved under the refused claim's token is freed here, or the breaker would wait out
# that lease for a probe nobody makes. The rate is the operator's or the hint's (the lowest
# declared when the hint was written): for the log and the wait, not for the decision.
_HELD_BY_LIMIT = f"""
WITH freed AS (
    UPDATE outbox_destination SET breaker_probe_token = NULL, breaker_probe_until = NULL
    WHERE destination = %(destination)s AND breaker_probe_token = %(token)s
    RETURNING destination
)
SELECT COALESCE(d.limit_in_flight, d.declared_in_flight),
       COALESCE(d.limit_per_second, d.declared_per_second),
       date_part('epoch', d.last_call_at
                 + interval '1 second' / COALESCE(d.limit_per_second, d.declared_per_second)
                 - clock_timestamp())
FROM outbox_destination d JOIN outbox_message m ON m.destination = d.destination
WHERE d.destination = %(destination)s AND m.id = %(id)s
  AND {LIMITED_SQL}
  AND COALESCE(d.paused_until <= now(), true)
  -- A half-open breaker whose probe this claim had reserved (freed above, after this snapshot)
  -- or nobody has: the claim is held to be the probe once the limit lets it.
  AND (d.breaker_opened_at IS NULL
       OR (d.breaker_open_until <= now()
           AND (NOT COALESCE(d.breaker_probe_until > now(), false) OR d.breaker_probe_token = %(token)s)))
  AND (m.state = 'dispatched' OR (m.state = 'pending' AND m.available_at <= now()))
  AND NOT {ordering.blocked_sql("m")}
  AND (m.payload_version = 1 OR EXISTS (SELECT 1 FROM outbox_feature WHERE name = 'payload_versions'))
"""


@dataclass(frozen=True)
class Held:
    """Why a claim of a claimable row moved nothing: its destination's limits."""

    #: The in-flight limit, or None.
    in_flight: int | None
    #: The calls a second, or None.
    per_second: float | None
    #: Seconds until the destination's next call may start (its booked starts run that far
    #: ahead); None or <= 0: not paced, or no start booked ahead.
    booked_ahead_seconds: float | None


def held_by_limit(
    conn: psycopg.Connection[Any], *, row_id: int, destination: str, token: uuid.UUID | None = None
) -> Held | None:
    """The limits that hold ``row_id`` back after an empty claim under ``token`` (the row is still
    claimable and its destination has a limit), or None: the claim was empty for another
    reason. Frees a breaker probe that claim reserved."""
    params = {"destination": destination, "id": row_id, "token": token}
    row = conn.execute(_HELD_BY_LIMIT, params).fetchone()
    if row is None:
        return None
    return Held(
        int(row[0]) if row[0] is not None else None,
        float(row[1]) if row[1] is not None else None,
        float(row[2]) if row[2] is not None else None,
    )


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
    pace_ahead_seconds: float = PACE_AHEAD_SECONDS,
) -> Claimed | Aged | None:
    """Move the row to `in_flight` under a new claim token and insert its attempt row.

    None when the row is not claimable (already claimed, settled, cancelled, not yet due, not
    for this destination, its destination is paused, or an earlier row of its ordering key holds
    it back): the run is then empty. ``skip_when_failed``: the handler's
    ``on_failed_head="skip"``, recorded on the row (outbox.ordering). Pass ``token``
    to know it before the statement is sent: if its reply is lost, the token says whether the
    claim committed. ``key_ttl`` (an idempotent destination's): a row whose earlier call may
    have taken effect longer ago goes to `unknown` instead (:class:`Aged`).
    ``pace_ahead_seconds``: on a paced destination, the latest start the call may be booked for
    (outbox.limits), from now; a later one refuses the claim.
    """
    aged_error = _aged_error(key_ttl)
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
                "pace_ahead_seconds": float(pace_ahead_seconds),
            },
        )
        .fetchone()
    )
    if row is None:
        return None
    return _claim_result(row, aged_error)


def _aged_error(key_ttl: float | None) -> str | None:
    return (
        f"not called again: an earlier call may have taken effect more than key_ttl ({key_ttl:g} s) "
        "ago, and the provider may have forgotten its Idempotency-Key; the lookup decides"
        if key_ttl is not None
        else None
    )


def _claim_result(row: Any, aged_error: str | None) -> Claimed | Aged:
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
        earlier_call=bool(row[17]),
        pace_seconds=max(float(row[18]), 0.0) if row[18] is not None else 0.0,
    )


_CLAIM_GROUP_STATEMENT = db.Statement(_CLAIM_GROUP)


_CLAIM_GROUP_IDEMPOTENT_STATEMENT = db.Statement(_CLAIM_GROUP_IDEMPOTENT)


def claim_group(
    conn: psycopg.Connection[Any],
    *,
    tokens: Mapping[int, uuid.UUID],
    destination: str,
    lease_seconds: float,
    key_ttl: float | None = None,
    skip_when_failed: bool = False,
    pace_ahead_seconds: float = PACE_AHEAD_SECONDS,
) -> dict[int, Claimed | Aged]:
    """Claim the rows of ``tokens`` (row id -> its claim token) in one statement and one commit,
    as :func:`claim` claims one; the result holds the rows claimed (or aged), by id. A row left
    out was not claimed: not claimable (as for :func:`claim`), or its destination's breaker is
    open, whose probe only a single claim takes. Raises as :func:`claim` does, for every row:
    a lost reply leaves each token's claim to be fenced."""
    aged_error = _aged_error(key_ttl)
    ids = list(tokens)
    rows = (
        (_CLAIM_GROUP_STATEMENT if key_ttl is None else _CLAIM_GROUP_IDEMPOTENT_STATEMENT)
        .execute(
            conn,
            {
                "ids": ids,
                "tokens": [tokens[i] for i in ids],
                "lease_seconds": float(lease_seconds),
                "destination": destination,
                "key_ttl": key_ttl,
                "aged_error": aged_error,
                "skip_when_failed": skip_when_failed,
                "pace_ahead_seconds": float(pace_ahead_seconds),
            },
        )
        .fetchall()
    )
    return {row[0]: _claim_result(row, aged_error) for row in rows}


_RECORD_STATEMENT = db.Statement(_RECORD)
_RECORD_FOLLOW_STATEMENT = db.Statement(_RECORD_FOLLOW)


def record(
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
    follow: chains.Plan = chains.NO_NEXT_STEPS,
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
        **stored(ref=ref, response=response, error=error, deadline_error=deadline_error),
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


def fence_lost_claim(conn: psycopg.Connection[Any], *, row_id: int, token: uuid.UUID) -> bool:
    """Make sure the claim ``token`` of row ``row_id``, whose reply was lost, either committed
    or never will: False when it committed (it owns its attempt row), True when it is fenced
    (now, or by an earlier try of this call whose own reply was lost)."""
    params = {"id": row_id, "token": token, "error": LOST_CLAIM_FENCE_ERROR}
    try:
        row = conn.execute(_FENCE_LOST_CLAIM, params).fetchone()
    except psycopg.errors.ForeignKeyViolation:
        # The row was deleted between the read and the insert: nothing can claim it now.
        return True
    return bool(row and row[0])


def fail_unhandled(conn: psycopg.Connection[Any], *, row_id: int, error: str) -> bool:
    """``pending``/``dispatched`` -> ``failed``: no handler in this deploy knows its destination."""
    params = {"id": row_id, "error": sanitize.clean_text(error)}
    return conn.execute(_FAIL_UNHANDLED, params).fetchone() is not None


# == the destination (outbox_destination): the breaker's count and probe, a Retry-After hold ======

# A "not processed" outcome while closed: counted, and the breaker opens at the threshold. One
# statement, so that two workers counting at once cannot both miss the threshold.
_WINDOW_OPEN = "d.breaker_window_at > now() - %(window)s * interval '1 second'"
_NEW_COUNT = f"(CASE WHEN {_WINDOW_OPEN} THEN d.breaker_failures + 1 ELSE 1 END)"
_TRIPS_AT_ONE = "1 >= %(threshold)s"
# A trip that follows a close by less than the gap continues that episode (one alert for a
# flapping provider).
_EPISODE_GAP = f"interval '{DESTINATION_EPISODE_GAP_SECONDS} seconds'"
_COUNT = f"""
INSERT INTO outbox_destination AS d (destination, breaker_failures, breaker_window_at, breaker_opened_at,
                                     breaker_open_until, breaker_open_seconds, breaker_reason,
                                     breaker_trips, breaker_since)
SELECT %(destination)s, 1, now(),
       CASE WHEN {_TRIPS_AT_ONE} THEN now() END,
       CASE WHEN {_TRIPS_AT_ONE} THEN now() + %(open)s * interval '1 second' END,
       CASE WHEN {_TRIPS_AT_ONE} THEN CAST(%(open)s AS float8) END,
       CASE WHEN {_TRIPS_AT_ONE} THEN %(reason)s END,
       CASE WHEN {_TRIPS_AT_ONE} THEN 1 ELSE 0 END,
       CASE WHEN {_TRIPS_AT_ONE} THEN now() END
WHERE {LOCK_WAIT_SQL}
ON CONFLICT (destination) DO UPDATE
SET breaker_failures = {_NEW_COUNT},
    breaker_window_at = CASE WHEN {_WINDOW_OPEN} THEN d.breaker_window_at ELSE now() END,
    breaker_opened_at = CASE WHEN {_NEW_COUNT} >= %(threshold)s THEN now() END,
    breaker_open_until = CASE WHEN {_NEW_COUNT} >= %(threshold)s
                              THEN now() + %(open)s * interval '1 second' END,
    breaker_open_seconds = CASE WHEN {_NEW_COUNT} >= %(threshold)s THEN %(open)s END,
    breaker_probes = CASE WHEN {_NEW_COUNT} >= %(threshold)s THEN 0 ELSE d.breaker_probes END,
    breaker_probe_token = NULL,
    breaker_probe_until = NULL,
    breaker_reason = CASE WHEN {_NEW_COUNT} >= %(threshold)s THEN %(reason)s ELSE d.breaker_reason END,
    breaker_trips = d.breaker_trips + CASE WHEN {_NEW_COUNT} >= %(threshold)s THEN 1 ELSE 0 END,
    breaker_since = CASE WHEN {_NEW_COUNT} < %(threshold)s THEN d.breaker_since
                         WHEN d.breaker_closed_at > now() - {_EPISODE_GAP} AND d.breaker_since IS NOT NULL
                         THEN d.breaker_since ELSE now() END
WHERE d.breaker_opened_at IS NULL
RETURNING breaker_opened_at IS NOT NULL AS tripped, breaker_failures
"""

_RESET = f"""
UPDATE outbox_destination
SET breaker_failures = 0, breaker_window_at = NULL
WHERE {LOCK_WAIT_SQL} AND destination = %(destination)s AND breaker_opened_at IS NULL AND breaker_failures > 0
"""


def count_breaker_failure(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
    """A "not processed" outcome of a closed breaker (outbox.breaker.count_not_processed): the
    row ``(tripped, failures)``, or None while the breaker is open."""
    return conn.execute(_COUNT, params).fetchone()


def reset_breaker(conn: psycopg.Connection[Any], destination: str) -> None:
    """A processed outcome: the consecutive count starts again."""
    conn.execute(_RESET, {"destination": destination})


# The probe's outcome, only while this claim still holds the probe: closed, or open again for
# `%(factor)s` times as long as before (at most `%(max)s`).
_SETTLE_PROBE = f"""
UPDATE outbox_destination
SET breaker_opened_at = CASE WHEN %(close)s THEN NULL ELSE breaker_opened_at END,
    breaker_open_until = CASE WHEN %(close)s THEN NULL
        ELSE now() + LEAST(breaker_open_seconds * %(factor)s, %(max)s) * interval '1 second' END,
    breaker_open_seconds = CASE WHEN %(close)s THEN NULL
        ELSE LEAST(breaker_open_seconds * %(factor)s, %(max)s) END,
    breaker_closed_at = CASE WHEN %(close)s THEN now() ELSE breaker_closed_at END,
    breaker_failures = 0,
    breaker_window_at = NULL,
    breaker_reason = CASE WHEN %(close)s THEN breaker_reason ELSE %(reason)s END,
    breaker_probe_token = NULL,
    breaker_probe_until = NULL
WHERE {LOCK_WAIT_SQL} AND destination = %(destination)s AND breaker_probe_token = %(token)s
  AND breaker_opened_at IS NOT NULL
RETURNING breaker_opened_at IS NULL AS closed, breaker_open_seconds
"""


def settle_breaker_probe(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
    """The probe's outcome (outbox.breaker.settle_probe): the row ``(closed, open_seconds)``, or
    None when this claim no longer holds the probe."""
    return conn.execute(_SETTLE_PROBE, params).fetchone()


_FREE_PROBE = f"""
UPDATE outbox_destination
SET breaker_probe_token = NULL, breaker_probe_until = NULL
WHERE {LOCK_WAIT_SQL} AND destination = %(destination)s AND breaker_probe_token = %(token)s
"""


def free_breaker_probe(conn: psycopg.Connection[Any], destination: str, *, token: uuid.UUID) -> None:
    """The probe made no call: the next claim probes."""
    conn.execute(_FREE_PROBE, {"destination": destination, "token": token})


_CLOSE = f"""
UPDATE outbox_destination {BREAKER_CLOSE_SET}
WHERE {LOCK_WAIT_SQL} AND destination = %(destination)s AND breaker_opened_at IS NOT NULL
RETURNING destination
"""


def close_breaker(conn: psycopg.Connection[Any], destination: str) -> bool:
    """Close an open breaker whose handler no longer declares one; True when it was open."""
    return conn.execute(_CLOSE, {"destination": destination}).fetchone() is not None


# A worker's pause: only ever lengthens one (an operator's longer or indefinite pause, and its
# reason, stay as they are).
_HOLD = f"""
INSERT INTO outbox_destination AS d (destination, paused_until, paused_at, paused_by, pause_reason)
SELECT %(destination)s, now() + %(seconds)s * interval '1 second', now(), %(by)s, %(reason)s
WHERE {LOCK_WAIT_SQL}
ON CONFLICT (destination) DO UPDATE
SET paused_until = EXCLUDED.paused_until,
    paused_at = {EPISODE_START_SQL},
    paused_by = EXCLUDED.paused_by,
    pause_reason = EXCLUDED.pause_reason
WHERE d.paused_until IS NULL OR d.paused_until < EXCLUDED.paused_until
RETURNING destination
"""


def hold_destination(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> bool:
    """A worker's pause for a provider's Retry-After (outbox.pauses.hold): True when it set or
    lengthened the pause."""
    return conn.execute(_HOLD, params).fetchone() is not None
