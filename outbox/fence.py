"""The claim and the record: the two guarded statements that make a second run harmless.

Where is the claim? Here. Each function is one statement, one round trip, committed on return
(the connections are in autocommit mode). The claim is durable before the call; the record may
use an asynchronous commit, since a lost record only leaves the row `in_flight` until its lease
expires and the reconciler's lookup resolves it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from . import sanitize

_CLAIM = """
WITH claimed AS (
    UPDATE outbox_message
    SET state = 'in_flight',
        claim_token = %(token)s,
        attempts = attempts + 1,
        claimed_at = now(),
        lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
    WHERE id = %(id)s
      AND destination = %(destination)s
      AND (state = 'dispatched' OR (state = 'pending' AND available_at <= now()))
    RETURNING id, key, step, destination, payload, attempts, deadline, claim_token
), fence AS (
    INSERT INTO outbox_attempt (message_id, attempt, claim_token)
    SELECT id, attempts, claim_token FROM claimed
)
SELECT id, key, step, destination, payload, attempts, deadline, claim_token FROM claimed
"""

# The message row moves only if this claim still owns it: a late recording after the lease was
# taken over updates the attempt row alone, marked superseded. An `unknown` row with the same
# token is this claim's own call, expired by the reconciler: the worker's answer is better
# evidence than a lookup, so it may still settle it.
_RECORD = """
WITH moved AS (
    UPDATE outbox_message
    SET state = %(state)s,
        provider_ref = COALESCE(%(ref)s, provider_ref),
        response = COALESCE(CAST(%(response)s AS jsonb), response),
        last_error = %(error)s,
        available_at = COALESCE(%(available_at)s, available_at),
        completed_at = CASE WHEN %(state)s IN ('sent', 'failed') THEN now() END,
        unknown_since = CASE WHEN %(state)s = 'unknown' THEN COALESCE(unknown_since, now()) END,
        dispatched_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE dispatched_at END,
        -- A row alerted while unknown and then settled must be able to alert again (failed).
        alerted_at = NULL,
        lease_expires_at = NULL
    WHERE id = %(id)s AND claim_token = %(token)s AND state IN ('in_flight', 'unknown')
    RETURNING id
)
UPDATE outbox_attempt
SET finished_at = now(),
    outcome = CASE WHEN EXISTS (SELECT 1 FROM moved) THEN %(outcome)s
                   ELSE 'superseded:' || %(outcome)s END,
    http_status = %(http_status)s,
    error = %(error)s,
    -- An ambiguous call retried on an idempotent destination (outbox.outcomes): covered by the
    -- provider's deduplication, which is not a settlement for a later replay.
    -- A late record keeps what a lookup or an operator settled meanwhile.
    settled = CASE WHEN %(outcome)s = 'unknown' AND %(state)s = 'pending'
                        AND EXISTS (SELECT 1 FROM moved) AND settled IS NULL
                   THEN 'idempotent_retry' ELSE settled END,
    settled_at = CASE WHEN %(outcome)s = 'unknown' AND %(state)s = 'pending'
                           AND EXISTS (SELECT 1 FROM moved) AND settled IS NULL
                      THEN now() ELSE settled_at END
WHERE claim_token = %(token)s
RETURNING EXISTS (SELECT 1 FROM moved)
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


def claim(
    conn: psycopg.Connection[Any], *, row_id: int, destination: str, lease_seconds: float
) -> Claimed | None:
    """Move the row to `in_flight` under a new claim token and insert its fence row.

    None when the row is not claimable (already claimed, settled, cancelled, not yet due, or
    not for this destination): the run is then empty.
    """
    row = conn.execute(
        _CLAIM,
        {
            "token": uuid.uuid4(),
            "lease_seconds": float(lease_seconds),
            "id": row_id,
            "destination": destination,
        },
    ).fetchone()
    if row is None:
        return None
    return Claimed(*row)


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
    available_at: datetime | None = None,
) -> bool:
    """Record a claim's outcome; True when the row moved, False when a newer claim owns it.

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
        "available_at": available_at,
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
        params["error"] = sanitize.clean_optional_text(
            error.encode("ascii", "replace").decode() if error else None
        )
        row = conn.execute(_RECORD, params).fetchone()
    return bool(row and row[0])


def fail_unhandled(conn: psycopg.Connection[Any], *, row_id: int, error: str) -> bool:
    params = {"id": row_id, "error": sanitize.clean_text(error)}
    return conn.execute(_FAIL_UNHANDLED, params).fetchone() is not None
