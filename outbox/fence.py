"""The claim and the record: the two guarded statements that make a second run harmless.

Where is the claim? Here. Each function is one statement, one round trip, committed on return
(the connections are in autocommit mode). The claim is durable before the call; the record may
use an asynchronous commit, since a lost record only leaves the row `in_flight` until its lease
expires and the reconciler's lookup resolves it. The release gives a claim back without a call.

One clock: every instant these statements compare is computed here, in SQL, from the database's
clock. Python passes intervals (a lease, a backoff, a wait before the first lookup), never a
timestamp of its own; only the application's own ``available_at``/``deadline`` come from outside.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from . import sanitize
from .schema import NOTIFY_CHANNEL

# The lease counts from when the row is held: the `held` CTE takes the row lock first, so the
# `clock_timestamp()` of the UPDATE is read after any lock wait (the relay between its push and
# its commit, an application transaction holding the row, even one that only ran SELECT … FOR
# UPDATE), where the statement's `now()` would date from before it. A commit wait after the
# statement is not covered here: the worker bounds that with its own monotonic clock.
_CLAIM = """
WITH held AS (
    SELECT id FROM outbox_message
    WHERE id = %(id)s
      AND destination = %(destination)s
      AND (state = 'dispatched' OR (state = 'pending' AND available_at <= now()))
    FOR UPDATE
), claimed AS (
    UPDATE outbox_message m
    SET state = 'in_flight',
        claim_token = %(token)s,
        attempts = m.attempts + 1,
        claimed_at = clock_timestamp(),
        lease_expires_at = clock_timestamp() + %(lease_seconds)s * interval '1 second'
    FROM held
    WHERE m.id = held.id
      AND m.destination = %(destination)s
      AND (m.state = 'dispatched' OR (m.state = 'pending' AND m.available_at <= now()))
    RETURNING m.id, m.key, m.step, m.destination, m.payload, m.attempts, m.deadline, m.claim_token,
              m.deadline <= clock_timestamp() AS deadline_passed
), fence AS (
    INSERT INTO outbox_attempt (message_id, attempt, claim_token)
    SELECT id, attempts, claim_token FROM claimed
)
SELECT id, key, step, destination, payload, attempts, deadline, claim_token,
       COALESCE(deadline_passed, false)
FROM claimed
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
_RECORD = f"""
WITH moved AS (
    UPDATE outbox_message
    SET state = {NEW_STATE_SQL},
        provider_ref = COALESCE(%(ref)s, provider_ref),
        response = COALESCE(CAST(%(response)s AS jsonb), response),
        last_error = CASE WHEN {PAST_DEADLINE_SQL} THEN %(deadline_error)s ELSE %(error)s END,
        available_at = COALESCE({DUE_SQL}, available_at),
        completed_at = CASE WHEN {NEW_STATE_SQL} IN ('sent', 'failed') THEN now() END,
        unknown_since = CASE WHEN %(state)s = 'unknown' THEN COALESCE(unknown_since, now()) END,
        dispatched_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE dispatched_at END,
        -- A row alerted while unknown and then settled must be able to alert again (failed).
        alerted_at = NULL,
        lease_expires_at = NULL
    -- A confirmed answer also settles a row that a lookup sent back (pending, dispatched) or
    -- failed while this claim's call was still on its way, as long as no newer claim owns it:
    -- the provider's confirmation beats the lookup's earlier "not found".
    WHERE id = %(id)s AND claim_token = %(token)s
      AND (state IN ('in_flight', 'unknown')
           OR (%(state)s = 'sent' AND state IN ('pending', 'dispatched', 'failed')))
    RETURNING id, state, last_error
)
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
RETURNING (SELECT state FROM moved)
"""

# The claim is given back without a call: the row is due again at once (the relay re-publishes
# it), the claim is not counted as an attempt, and the fence row says `released`. From `unknown`
# too: the reconciler may have expired the lease meanwhile, but this claim knows no call was
# made, which is better evidence than any lookup.
_RELEASE = f"""
WITH released AS (
    UPDATE outbox_message
    SET state = 'pending',
        attempts = GREATEST(attempts - 1, 0),
        releases = releases + 1,
        available_at = now(),
        dispatched_at = NULL,
        lease_expires_at = NULL,
        unknown_since = NULL,
        alerted_at = NULL,
        last_error = %(reason)s
    WHERE id = %(id)s AND claim_token = %(token)s AND state IN ('in_flight', 'unknown')
    RETURNING id, key, step, releases
), fenced AS (
    UPDATE outbox_attempt
    SET outcome = 'released', finished_at = now(), error = %(reason)s
    WHERE claim_token = %(token)s AND EXISTS (SELECT 1 FROM released)
)
SELECT key, step, releases, pg_notify('{NOTIFY_CHANNEL}', '') FROM released
"""

# The backend that ran a claim whose reply was lost; `backend_start` tells it from a later
# backend that was given the same pid.
_BACKEND = "pid = %(pid)s AND backend_start IS NOT DISTINCT FROM %(started)s"
_BACKEND_ALIVE = f"SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE {_BACKEND})"
_TERMINATE_BACKEND = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {_BACKEND}"

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


@dataclass(frozen=True)
class Released:
    key: str
    step: str
    #: How many claims of this row have been released so far, this one included.
    releases: int


def claim(
    conn: psycopg.Connection[Any],
    *,
    row_id: int,
    destination: str,
    lease_seconds: float,
    token: uuid.UUID | None = None,
) -> Claimed | None:
    """Move the row to `in_flight` under a new claim token and insert its fence row.

    None when the row is not claimable (already claimed, settled, cancelled, not yet due, or
    not for this destination): the run is then empty. Pass ``token`` to know it before the
    statement is sent: if its reply is lost, the token says whether the claim committed.
    """
    row = conn.execute(
        _CLAIM,
        {
            "token": token or uuid.uuid4(),
            "lease_seconds": float(lease_seconds),
            "id": row_id,
            "destination": destination,
        },
    ).fetchone()
    if row is None:
        return None
    return Claimed(*row)


def record_state(
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
) -> str | None:
    """Record a claim's outcome; the state the row moved to, or None when a newer claim owns it.

    ``delay_seconds``: the row is due again that long after the database's now (the backoff of
    a retry, the wait before the first lookup of an unknown row). A retry that would fall on or
    after the row's deadline fails the row instead, with ``deadline_error`` as its reason.

    What the provider sent is stored through :mod:`outbox.sanitize` (storable, no card data).
    Should the database still refuse it, the row is recorded without the response summary: a
    confirmed charge must reach `sent`, never stay `in_flight` because of its summary.
    """
    params = {
        "state": state,
        "outcome": outcome,
        "ref": sanitize.clean_ref(ref) if ref is not None else None,
        "response": sanitize.encode_response(response),
        "error": sanitize.clean_optional_text(error),
        "deadline_error": sanitize.clean_optional_text(deadline_error or error),
        "delay": float(delay_seconds) if delay_seconds is not None else None,
        "http_status": http_status,
        "id": row_id,
        "token": token,
    }
    try:
        row = conn.execute(_RECORD, params).fetchone()
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
        row = conn.execute(_RECORD, params).fetchone()
    return row[0] if row else None


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
) -> bool:
    """Record a claim's outcome; True when the row moved, False when a newer claim owns it."""
    return (
        record_state(
            conn,
            row_id=row_id,
            token=token,
            state=state,
            outcome=outcome,
            ref=ref,
            response=response,
            error=error,
            http_status=http_status,
            delay_seconds=delay_seconds,
            deadline_error=deadline_error,
        )
        is not None
    )


def release(conn: psycopg.Connection[Any], *, row_id: int, token: uuid.UUID, reason: str) -> Released | None:
    """Give back a claim that made no call; None when ``token`` does not own the row (the claim
    never committed, or the row has moved on)."""
    row = conn.execute(_RELEASE, {"id": row_id, "token": token, "reason": reason}).fetchone()
    return Released(row[0], row[1], row[2]) if row else None


def backend_identity(conn: psycopg.Connection[Any]) -> tuple[int, datetime | None]:
    """The server process behind ``conn`` and its start time (once per connection)."""
    row = conn.execute(
        "SELECT pg_backend_pid(), backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
    ).fetchone()
    return (int(row[0]), row[1]) if row else (conn.info.backend_pid, None)


def end_backend(
    conn: psycopg.Connection[Any], *, pid: int, started: datetime | None, timeout_seconds: float
) -> bool:
    """Terminate the backend ``pid`` (started at ``started``) and wait until it is gone.

    Once it is gone, whatever it was running has committed or rolled back for good: a claim
    whose reply was lost can no longer commit behind our back. False if it outlived the wait.
    """
    params = {"pid": pid, "started": started}
    conn.execute(_TERMINATE_BACKEND, params)
    deadline = time.monotonic() + timeout_seconds
    while True:
        alive = conn.execute(_BACKEND_ALIVE, params).fetchone()
        if not (alive and alive[0]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def fail_unhandled(conn: psycopg.Connection[Any], *, row_id: int, error: str) -> bool:
    params = {"id": row_id, "error": sanitize.clean_text(error)}
    return conn.execute(_FAIL_UNHANDLED, params).fetchone() is not None
