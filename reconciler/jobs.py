"""The reconciler's jobs. Each one is a function of a connection that returns a dict of counts.

Every transition is one guarded statement: the row moves only if it is still in the state (and
under the claim token, or dispatch time) the job read, so a consumer, an operator or another
reconciler acting at the same moment wins cleanly and the job just counts the row as ``raced``.

Connections are psycopg connections in autocommit mode: every statement is its own short
transaction, and nothing is held open while a lookup talks to a provider. Only
:func:`expire_leases` also works inside a caller's transaction (the caller commits).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import httpx
import psycopg
import redis

from outbox import heartbeat, logs, outcomes, policy, sanitize, transport
from outbox.fence import DUE_SQL, NEW_STATE_SQL, PAST_DEADLINE_SQL
from outbox.handlers import Confirmed, Deliveries, Handler, idempotency_key
from outbox.schema import NOTIFY_CHANNEL
from outbox.settings import DEFAULT_TIME_LIMIT_SECONDS
from outbox.validation import header_safe

from .alerts import AlertHook, AlertRow, log_alert

logger = logging.getLogger(__name__)

LEASE_EXPIRED_ERROR = "lease expired: the worker died or overran its time limit"

#: Rows looked up per run, oldest due first; the rest wait for the next run.
DEFAULT_RESOLVE_BATCH = 100
#: A run stops starting lookups after this long, so one slow provider cannot hold the job.
DEFAULT_RESOLVE_BUDGET_SECONDS = 60.0
#: Lookups of one destination that may fail in a row before the others of that destination
#: are deferred for this run: a provider that is down answers every lookup the same way.
LOOKUP_FAILURES_BEFORE_DEFERRING = 3
#: An unknown row nobody can resolve automatically is looked at again after this long.
HUMAN_RECHECK_SECONDS = 3600.0

#: A `dispatched` row younger than this is not examined: its publication may not be visible
#: everywhere yet, and it costs nothing to look again next run.
DEFAULT_REDISPATCH_GRACE_SECONDS = 5.0
DEFAULT_REDISPATCH_BATCH = 1000
DEFAULT_REDISPATCH_MAX_BATCHES = 50

#: `DELETE … LIMIT` batches: each one is a short transaction that holds few row locks.
PURGE_BATCH = 1000
DEFAULT_PURGE_MAX_BATCHES = 20

DEFAULT_ALERT_BATCH = 100

_MAX_ERROR_CHARS = 500


def _short(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 1] + "…"


def _nonzero(counts: Counter[str]) -> dict[str, int]:
    # Only what happened: an idle run reports {} rather than a row of zeros.
    return {k: v for k, v in counts.items() if v}


def _describe(exc: Exception) -> str:
    # Never the full URL: query strings carry idempotency keys, and sometimes credentials.
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.host}"
    if isinstance(exc, httpx.RequestError):
        try:
            return f"{type(exc).__name__} talking to {exc.request.url.host}"
        except RuntimeError:  # raised by .request when the error carries no request
            return type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _require_autocommit(conn: psycopg.Connection[Any], job: str) -> None:
    # Inside a transaction, a lookup would hold row locks (and a snapshot) for the length of an
    # HTTP call, and one failing statement would undo the batch's earlier transitions.
    if not conn.autocommit:
        raise ValueError(f"{job} needs a psycopg connection in autocommit mode")


# -- 1. expire_leases -------------------------------------------------------------------------------

# The claim token is kept: a late recording by the same claim is better evidence than a lookup
# and may still settle the row (see outbox.fence). The fence row is closed in the same statement,
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


def expire_leases(conn: psycopg.Connection[Any], handlers: Mapping[str, Handler] | None = None) -> int:
    """Move every `in_flight` row whose lease has expired to `unknown`; returns how many moved.

    Its first lookup is due one ``time_limit`` of its destination later (from ``handlers``); a
    destination they do not name waits the longest of them, and at least the default 30 s.
    One statement, so it is safe against a consumer recording at the same moment: whichever
    commits first wins, and the other's guard no longer matches. Works on a plain autocommit
    psycopg connection; on a connection inside a transaction the caller commits.
    """
    known = dict(handlers or {})
    params = {
        "error": LEASE_EXPIRED_ERROR,
        "destinations": list(known),
        "waits": [h.time_limit for h in known.values()],
        "default_wait": max([DEFAULT_TIME_LIMIT_SECONDS, *(h.time_limit for h in known.values())]),
    }
    row = conn.execute(_EXPIRE_LEASES, params).fetchone()
    return int(row[0]) if row else 0


# -- 2. resolve_unknown -----------------------------------------------------------------------------

_DUE_UNKNOWN = """
SELECT id, key, step, destination, payload, attempts, deadline, claim_token
FROM outbox_message
WHERE state = 'unknown' AND available_at <= now()
ORDER BY available_at, id
LIMIT %(limit)s
"""

# A call of this row that the provider may hold and may have forgotten by now.
_CALL_OLDER_THAN_KEY_TTL = f"""
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
  AND EXISTS ({_CALL_OLDER_THAN_KEY_TTL})
RETURNING id
"""

# Resolution of an unknown row by a lookup: sent, pending (retry) or failed. The history entry
# names what the reconciler saw, never the payload. A retry is due %(delay)s seconds from the
# database's now, and fails the row instead when that falls on or after its deadline. A "not
# found" (or an idempotent retry) marks the row's ambiguous fence rows in the same statement
# (outbox.outcomes), and only while every call that may have taken effect is younger than the
# destination's key_ttl (database clock): past it, the provider may have forgotten the call, and
# the row does not move.
_SETTLE_UNKNOWN = f"""
WITH moved AS (
UPDATE outbox_message
SET state = {NEW_STATE_SQL},
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
        'provider_ref', CAST(%(ref)s AS text)))
WHERE id = %(id)s AND state = 'unknown'
  AND claim_token IS NOT DISTINCT FROM CAST(%(token)s AS uuid)
  AND (CAST(%(key_ttl)s AS float8) IS NULL OR NOT EXISTS ({_CALL_OLDER_THAN_KEY_TTL}))
RETURNING id, state
), settled AS (
    UPDATE outbox_attempt a SET settled = %(settled)s, settled_at = now()
    FROM moved
    WHERE a.message_id = moved.id AND CAST(%(settled)s AS text) IS NOT NULL
      AND {outcomes.unsettled_ambiguous_sql("a")}
)
SELECT state FROM moved
"""

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


class LookupClients(Deliveries):
    """The lookups' deliveries: one HTTP client per destination, kept across runs and closed by
    ``close``. The reconciler may share a process with a worker (tests, the demo), so it owns
    clients of its own and closes exactly those. A lookup runs outside any worker call, so its
    clients have no send bound."""

    def __init__(self) -> None:
        super().__init__(send_bound=False)


def _settle(
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
) -> str | None:
    """The state the row moved to, or None when it had moved meanwhile (or, with ``key_ttl``,
    when a call that may have taken effect is older than it)."""
    moved = conn.execute(
        _SETTLE_UNKNOWN,
        {
            "settled": settled,
            "key_ttl": key_ttl,
            "id": row_id,
            "token": token,
            "state": state,
            "result": result,
            "error": sanitize.clean_optional_text(error),
            "ref": sanitize.clean_ref(ref) if ref is not None else None,
            "response": sanitize.encode_response(response),
            "delay": delay_seconds,
            "deadline_error": sanitize.clean_optional_text(deadline_error or error),
        },
    ).fetchone()
    return str(moved[0]) if moved is not None else None


def _settle_not_found(
    conn: psycopg.Connection[Any],
    handler: Handler,
    *,
    row_id: int,
    token: uuid.UUID | None,
    attempts: int,
    deadline: datetime | None,
    result: str,
    error: str,
    settled: str,
) -> str | None:
    """The call certainly did not take effect (or repeating it is harmless): retry or give up,
    marking the row's ambiguous fence rows ``settled`` in the same statement.

    Only while every call that may have taken effect is younger than ``handler.key_ttl``
    (database clock): past it, "not found" may mean the provider forgot the call, and a retry
    may charge twice, so the row stays ``unknown``, parked for a human with the reason (and
    alerted once). Returns the new state, ``past_key_ttl`` when parked, or None when the row had
    moved meanwhile."""
    nxt = policy.retry_or_fail(handler, attempt=attempts, error=error)
    moved = _settle(
        conn,
        row_id=row_id,
        token=token,
        state=nxt.state,
        result=result,
        error=nxt.error,
        delay_seconds=nxt.delay_seconds,
        deadline_error=policy.deadline_error(deadline, nxt.error),
        settled=settled,
        key_ttl=handler.key_ttl,
    )
    if moved is not None:
        return moved
    reason = (
        f"needs a human: a call is older than key_ttl ({handler.key_ttl:g} s), so the provider may "
        f"have forgotten it and 'not found' proves nothing; a retry could charge twice. Check the "
        f"provider's records, then run outbox resolve {row_id} --sent REF or --not-sent"
    )
    params = {
        "id": row_id,
        "token": token,
        "seconds": HUMAN_RECHECK_SECONDS,
        "error": reason,
        "key_ttl": handler.key_ttl,
    }
    if conn.execute(_PARK_PAST_KEY_TTL, params).fetchone() is None:
        return None
    logger.warning(
        "outbox row %s on %s needs a human: %s after key_ttl, not retried",
        row_id,
        handler.destination,
        result,
        extra={"outbox_id": row_id, "destination": handler.destination},
    )
    return "past_key_ttl"


def _park(conn: psycopg.Connection[Any], row_id: int, token: uuid.UUID | None, error: str) -> bool:
    params = {
        "id": row_id,
        "token": token,
        "seconds": HUMAN_RECHECK_SECONDS,
        "error": sanitize.clean_text(error),
    }
    return conn.execute(_PARK_UNKNOWN, params).fetchone() is not None


def _unsettleable(
    conn: psycopg.Connection[Any],
    alert: AlertHook | None,
    row_id: int,
    key: str,
    step: str,
    destination: str,
    token: uuid.UUID | None,
    exc: Exception,
) -> None:
    reason = sanitize.clean_text(
        f"lookup answer could not be recorded ({type(exc).__name__}: {logs.first_line(exc)}); "
        f"looked up again later; if it persists, check the provider and run outbox resolve {row_id}"
    )
    age = 0.0
    try:
        _defer(conn, row_id, token, reason)
        found = conn.execute(
            "SELECT EXTRACT(EPOCH FROM now() - created_at) FROM outbox_message WHERE id = %s", (row_id,)
        ).fetchone()
        age = float(found[0]) if found else 0.0
    except (psycopg.OperationalError, psycopg.InterfaceError):
        raise
    except psycopg.Error as again:
        # Even the deferral was refused: the row stays due; the alert below still goes out.
        logger.error(
            "outbox row %s could not be deferred either: %s",
            row_id,
            type(again).__name__,
            extra={"outbox_id": row_id, "destination": destination},
        )
    row = AlertRow(
        id=row_id, key=key, step=step, destination=destination, state="unknown", reason=reason, age=age
    )
    try:
        (alert or log_alert)(row)
    except Exception:
        logger.exception("alert hook failed for outbox row %s", row_id, extra={"outbox_id": row_id})


def _defer(conn: psycopg.Connection[Any], row_id: int, token: uuid.UUID | None, error: str | None) -> bool:
    params = {"id": row_id, "token": token, "error": sanitize.clean_optional_text(error)}
    return conn.execute(_DEFER_UNKNOWN, params).fetchone() is not None


def resolve_unknown(
    conn: psycopg.Connection[Any],
    handlers: Mapping[str, Handler],
    *,
    module: str = "the handler module",
    clients: LookupClients | None = None,
    batch_size: int = DEFAULT_RESOLVE_BATCH,
    time_budget_seconds: float = DEFAULT_RESOLVE_BUDGET_SECONDS,
    stop: threading.Event | None = None,
    alert: AlertHook | None = None,
) -> dict[str, int]:
    """Ask each due `unknown` row's provider, through the handler's lookup, whether the call
    took effect, and settle the row accordingly.

    Counts: ``sent`` (found), ``pending`` / ``failed`` (not found: retried, or out of attempts
    or deadline), ``lookup_failed`` (the lookup raised; looked up again later), ``deferred``
    (not looked up: its destination's lookups keep failing, or the time budget ran out),
    ``interrupted`` (left due because ``stop`` was set: the process is shutting down),
    ``needs_human`` (no lookup and not idempotent, or a key no Idempotency-Key header can
    carry), ``past_key_ttl`` (not found, or idempotent without a lookup, but a call is older
    than the destination's ``key_ttl``: parked for a human, never retried automatically),
    ``no_handler`` (destination unknown to ``module``), ``raced`` (the row moved while we
    looked; someone else settled it), ``unsettleable`` (the database refused the row's statement,
    or its path raised: deferred with the reason and reported through ``alert``, default
    :func:`~reconciler.alerts.log_alert`; the other rows proceed).
    """
    _require_autocommit(conn, "resolve_unknown")
    own_clients = clients is None
    lookup_clients = LookupClients() if clients is None else clients
    counts: Counter[str] = Counter()
    consecutive_failures: Counter[str] = Counter()
    started = time.monotonic()
    try:
        rows = conn.execute(_DUE_UNKNOWN, {"limit": batch_size}).fetchall()
        for row_id, key, step, destination, payload, attempts, deadline, token in rows:
            try:
                if stop is not None and stop.is_set():
                    counts["interrupted"] += 1
                    continue
                handler = handlers.get(destination)
                if handler is None:
                    # Stays unknown: only this destination's own lookup (or a human) may conclude.
                    error = (
                        f"no handler for destination {destination} in {module}: its outcome cannot be "
                        f"looked up; deploy its handler, or check the provider and run "
                        f"outbox resolve {row_id} --sent REF / --not-sent"
                    )
                    counts["no_handler" if _park(conn, row_id, token, error) else "raced"] += 1
                    continue
                if handler.lookup_fn is None:
                    if handler.idempotent:
                        # The provider deduplicates on our Idempotency-Key: calling again is safe.
                        state = _settle_not_found(
                            conn,
                            handler,
                            row_id=row_id,
                            token=token,
                            attempts=attempts,
                            deadline=deadline,
                            result="no_lookup_idempotent",
                            error="outcome unknown; retried, the destination is idempotent",
                            settled=outcomes.IDEMPOTENT_RETRY,
                        )
                        counts[state or "raced"] += 1
                        continue
                    error = (
                        f"needs a human: {destination} has no lookup and is not idempotent; check the "
                        f"provider, then run outbox resolve {row_id} --sent REF or --not-sent"
                    )
                    if _park(conn, row_id, token, error):
                        counts["needs_human"] += 1
                        logger.warning(
                            "outbox %s:%s on %s needs a human: no lookup, not idempotent",
                            key,
                            step,
                            destination,
                            extra={"outbox_id": row_id, "key": key, "step": step, "destination": destination},
                        )
                    else:
                        counts["raced"] += 1
                    continue
                out_of_time = time.monotonic() - started > time_budget_seconds
                if out_of_time or consecutive_failures[destination] >= LOOKUP_FAILURES_BEFORE_DEFERRING:
                    # Pushed back rather than left due, or they would fill every next batch and starve
                    # the rows of healthy destinations behind them.
                    counts["deferred" if _defer(conn, row_id, token, None) else "raced"] += 1
                    continue

                if not header_safe(idempotency_key(key, step)):
                    # Written before keys were checked at write: no lookup can name it to the
                    # provider, and asking again every few seconds would never succeed.
                    error = (
                        f"needs a human: key {key!r} cannot be sent as an Idempotency-Key header "
                        "(not printable ASCII); check the provider, then run "
                        f"outbox resolve {row_id} --sent REF or --not-sent"
                    )
                    counts["needs_human" if _park(conn, row_id, token, error) else "raced"] += 1
                    continue

                delivery = lookup_clients.delivery(
                    handler,
                    id=row_id,
                    key=key,
                    step=step,
                    payload=payload,
                    attempt=attempts,
                    deadline=deadline,
                )
                # No transaction is open here: the connection is in autocommit mode.
                try:
                    found = handler.lookup_fn(delivery)
                    if found is not None and not isinstance(found, Confirmed):
                        raise TypeError(f"lookup returned {type(found).__name__}, expected Confirmed or None")
                except Exception as exc:
                    consecutive_failures[destination] += 1
                    error = _short(f"lookup failed: {_describe(exc)}")
                    counts["lookup_failed" if _defer(conn, row_id, token, error) else "raced"] += 1
                    logger.warning(
                        "outbox %s:%s on %s: %s",
                        key,
                        step,
                        destination,
                        error,
                        extra={"outbox_id": row_id, "destination": destination},
                    )
                    continue
                consecutive_failures[destination] = 0
                if found is not None:
                    moved = _settle(
                        conn,
                        row_id=row_id,
                        token=token,
                        state="sent",
                        result="found",
                        ref=found.ref,
                        response=found.response,
                    )
                    counts["sent" if moved else "raced"] += 1
                else:
                    state = _settle_not_found(
                        conn,
                        handler,
                        row_id=row_id,
                        token=token,
                        attempts=attempts,
                        deadline=deadline,
                        result="not_found",
                        # Why the call was ambiguous stays on its attempt row.
                        error="lookup: the provider has no record of the call",
                        settled=outcomes.LOOKUP_NOT_FOUND,
                    )
                    counts[state or "raced"] += 1
            except (psycopg.OperationalError, psycopg.InterfaceError):
                # A lost connection is not this row's fault: the job ends, the next run retries.
                raise
            except Exception as exc:
                # One row the database will not take (or a bug on its path) must not hold back
                # the others, of any destination: it is pushed back, with the reason, and alerted.
                counts["unsettleable"] += 1
                _unsettleable(conn, alert, row_id, key, step, destination, token, exc)
    finally:
        if own_clients:
            lookup_clients.close()
    return _nonzero(counts)


# -- 3. redispatch ----------------------------------------------------------------------------------

# Keyset pagination, so that rows left alone (a healthy backlog) are not read again and again.
_DISPATCHED = """
SELECT id, destination, dispatched_at,
       dispatched_at < now() - %(stale)s * interval '1 second' AS stale
FROM outbox_message
WHERE state = 'dispatched'
  AND dispatched_at < now() - %(grace)s * interval '1 second'
  AND (CAST(%(after_at)s AS timestamptz) IS NULL
       OR (dispatched_at, id) > (CAST(%(after_at)s AS timestamptz), CAST(%(after_id)s AS bigint)))
ORDER BY dispatched_at, id
LIMIT %(limit)s
"""

# One statement for the batch, each row guarded by its own state and dispatch time: a row that a
# consumer claimed, or that was already re-queued and published again, does not match.
_REQUEUE = """
UPDATE outbox_message m
SET state = 'pending', available_at = now(), dispatched_at = NULL
FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(dispatched)s AS timestamptz[])) AS r(id, dispatched_at)
WHERE m.id = r.id AND m.state = 'dispatched' AND m.dispatched_at = r.dispatched_at
RETURNING m.id
"""


def _requeue(conn: psycopg.Connection[Any], rows: list[tuple[int, datetime]]) -> int:
    if not rows:
        return 0
    params = {"ids": [r[0] for r in rows], "dispatched": [r[1] for r in rows]}
    return len(conn.execute(_REQUEUE, params).fetchall())


def redispatch(
    conn: psycopg.Connection[Any],
    redis_client: redis.Redis,
    handlers: Mapping[str, Handler],
    *,
    namespace: str,
    redispatch_after_seconds: float,
    module: str = "the handler module",
    grace_seconds: float = DEFAULT_REDISPATCH_GRACE_SECONDS,
    batch_size: int = DEFAULT_REDISPATCH_BATCH,
    max_batches: int = DEFAULT_REDISPATCH_MAX_BATCHES,
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Send `dispatched` rows whose message is gone, or whose message's fate cannot be known,
    back to `pending`, so the relay publishes them again; a re-publication replaces the old
    message, it never adds a copy.

    Where a row's message is, from Dramatiq's Redis layout (its id is deterministic):

    - no body in ``Q.msgs`` → gone (Redis flushed or restarted, dead-lettered): re-queued now
      (``missing``);
    - its id in the queue list ``Q`` → waiting: left alone whatever its age (``waiting``); a
      long queue, or a queue no worker consumes, is not a lost message, and the "no consumer"
      alert (:func:`no_consumer`) is what tells a human about the latter;
    - its body there but its id not in the list: a worker fetched it (it is in that worker's
      ack set) and has not acked it, or only the body survived. Fetched by a live worker
      (Dramatiq heartbeat within 60 s), or younger than ``redispatch_after_seconds`` → left
      alone (``waiting``). Older, and fetched by a dead worker or by none → unknowable: the
      message is removed from Redis (body, list, ack sets) and then the row is re-queued
      (``unacked``).

    A row whose destination has no handler in ``module`` is treated the same and only reported
    (``no_handler``): during a rolling deploy it may belong to a newer (or older) version's
    workers, and re-publishing calls no provider, while failing it would need a replay.
    Counts: ``missing``, ``unacked``, ``waiting``, ``raced``, ``no_handler``.
    A Redis error raises: an unreachable Redis never means "the message is gone".
    """
    _require_autocommit(conn, "redispatch")
    counts: Counter[str] = Counter()
    orphans: Counter[str] = Counter()
    after_at: datetime | None = None
    after_id = 0
    workers: dict[str, bool] | None = None
    for _ in range(max_batches):
        if stop is not None and stop.is_set():
            break
        rows = conn.execute(
            _DISPATCHED,
            {
                "stale": float(redispatch_after_seconds),
                "grace": float(grace_seconds),
                "after_at": after_at,
                "after_id": after_id,
                "limit": batch_size,
            },
        ).fetchall()
        if not rows:
            break
        after_at, after_id = rows[-1][2], rows[-1][0]

        orphans.update(destination for _, destination, _, _ in rows if destination not in handlers)
        mids = [transport.message_id(row_id, at) for row_id, _, at, _ in rows]
        present = transport.messages_present(
            redis_client, namespace, ((r[1], mid) for r, mid in zip(rows, mids, strict=True))
        )
        missing = [(r[0], r[2]) for r, p in zip(rows, present, strict=True) if not p]
        # Old enough to ask where its message is: is it still in its queue list?
        old: dict[str, list[tuple[int, datetime, str]]] = {}
        for r, mid, p in zip(rows, mids, present, strict=True):
            if p and r[3]:
                old.setdefault(r[1], []).append((r[0], r[2], mid))
        unacked: list[tuple[int, datetime]] = []
        if old:
            if workers is None:
                workers = transport.broker_workers(redis_client, namespace)
            fetched = transport.fetched_ids(redis_client, namespace, old, workers)
            for destination, candidates in old.items():
                held = fetched[destination]
                # Fetched by a live worker: it will run it (its claim fences a duplicate anyway).
                not_fetched = {mid for _, _, mid in candidates if mid not in held}
                absent = (
                    transport.queued_ids(redis_client, namespace, destination, not_fetched)[1]
                    if not_fetched
                    else set()
                )
                gone = [
                    c
                    for c in candidates
                    if (c[2] in held and not workers.get(held[c[2]], False)) or c[2] in absent
                ]
                transport.remove_messages(
                    redis_client, namespace, destination, [mid for _, _, mid in gone], workers
                )
                unacked += [(row_id, at) for row_id, at, _ in gone]
        moved_missing = _requeue(conn, missing)
        moved_unacked = _requeue(conn, unacked)
        counts["missing"] += moved_missing
        counts["unacked"] += moved_unacked
        counts["waiting"] += len(rows) - len(missing) - len(unacked)
        counts["raced"] += len(missing) - moved_missing + len(unacked) - moved_unacked
        if len(rows) < batch_size:
            break
    for destination, count in sorted(orphans.items()):
        counts["no_handler"] += count
        logger.warning(
            "%s dispatched outbox rows of destination %s: no handler in %s; deploy one (or a worker "
            "for it) — they wait in their queue, never failed by this reconciler",
            count,
            destination,
            module,
            extra={"destination": destination, "rows": count},
        )
    if counts["missing"] or counts["unacked"]:
        # The relay sleeps until NOTIFY or its poll interval; wake it for the re-queued rows.
        conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))
    return _nonzero(counts)


# -- 4. purge ---------------------------------------------------------------------------------------

# The row moves into the key ledger in the statement that deletes it: no moment exists where the
# key is in neither table (the insert guard would let a new row for it through). Its fence rows
# are read here, in the statement's snapshot, before the cascade removes them.
#
# A transaction whose snapshot predates a row's insertion sees neither the row nor its ledger
# entry, so the guard cannot stop it from inserting the key again; such a snapshot is older than
# the row's completed_at. Rows completed after the oldest open client transaction began wait for
# it to end. Sessions of other roles show no xact_start without pg_read_all_stats: the hold-back
# would be blind to them, so without that privilege the purge does not run (_CAN_SEE_ALL_XACTS).
_PURGE = """
WITH gone AS (
    DELETE FROM outbox_message
    WHERE id IN (
        SELECT id FROM outbox_message
        WHERE state IN ('sent', 'cancelled')
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
    RETURNING id, key, step, destination, payload, state, provider_ref, completed_at, history
),
ledgered AS (
    INSERT INTO outbox_key_ledger AS l (
        message_id, completed_at, attempts, confirmed, ambiguous,
        key, step, destination, payload_hash, state, provider_ref)
    SELECT g.id, g.completed_at, f.claims, f.confirmed,
           f.ambiguous OR g.history @> '[{"action": "resolve", "from": "unknown"}]'::jsonb,
           g.key, g.step, g.destination, outbox_payload_digest(g.payload),
           g.state, g.provider_ref
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

# Superusers and members of pg_read_all_stats (pg_monitor is one) see every session's
# xact_start; USAGE, not MEMBER: a NOINHERIT membership does not lend the privilege.
CAN_SEE_ALL_XACTS = """
SELECT r.rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
FROM pg_roles r WHERE r.rolname = current_user
"""

#: The purge's count when it refused to run for want of the privilege above.
PURGE_SKIPPED_NO_PRIVILEGE = "skipped_no_stats_privilege"


def can_see_all_transactions(conn: psycopg.Connection[Any]) -> bool:
    """True when this role sees the ``xact_start`` of every role's sessions, as the purge needs."""
    row = conn.execute(CAN_SEE_ALL_XACTS).fetchone()
    return bool(row and row[0])


# Batches along the completed_at index: each is a short transaction, and the drop keeps pace with
# the purge (the job runs both) without one long DELETE holding locks or bloating at once.
_DROP_LEDGER = """
DELETE FROM outbox_key_ledger
WHERE (key, step) IN (
    SELECT key, step FROM outbox_key_ledger
    WHERE completed_at < now() - %(horizon)s * interval '1 second'
    ORDER BY completed_at
    LIMIT %(limit)s
)
AND completed_at < now() - %(horizon)s * interval '1 second'
"""

#: Ledger entries dropped per statement (narrow rows: a larger batch than the purge's).
LEDGER_DROP_BATCH = 5000


def _batches(run: Callable[[], int], max_batches: int, batch: int) -> tuple[int, int]:
    total = batches = 0
    for _ in range(max_batches):
        done = run()
        if done <= 0:
            break
        batches += 1
        total += done
        if done < batch:
            break
    return total, batches


def purge(
    conn: psycopg.Connection[Any],
    *,
    retention_seconds: float,
    ledger_horizon_seconds: float | None = None,
    max_batches: int = DEFAULT_PURGE_MAX_BATCHES,
) -> dict[str, int]:
    """Move `sent` and `cancelled` rows completed more than ``retention_seconds`` ago into the key
    ledger (their attempt rows cascade), at most ``max_batches`` batches of 1000 per run; `failed`
    rows stay until a human replays them. Then drop ledger entries completed more than
    ``ledger_horizon_seconds`` ago (None: keep them). Counts: ``purged``, ``batches`` (statements
    that moved rows), ``ledger_dropped``.

    A role that is neither superuser nor a member of ``pg_read_all_stats`` (or ``pg_monitor``)
    cannot see other roles' open transactions, so it cannot hold rows back for them: the purge
    then moves nothing, logs an error and counts ``skipped_no_stats_privilege``."""
    _require_autocommit(conn, "purge")
    params = {"retention": float(retention_seconds), "limit": PURGE_BATCH}

    def move() -> int:
        row = conn.execute(_PURGE, params).fetchone()
        return int(row[0]) if row else 0

    counts: dict[str, int] = {}
    if can_see_all_transactions(conn):
        purged, batches = _batches(move, max_batches, PURGE_BATCH)
        if purged:
            counts = {"purged": purged, "batches": batches}
    else:
        role = conn.execute("SELECT current_user").fetchone()
        logger.error(
            "purge skipped: role %s can see neither other roles' open transactions nor whether an "
            "old REPEATABLE READ snapshot could write a purged key again; run "
            "GRANT pg_read_all_stats TO %s (or pg_monitor), or run the reconciler as a superuser",
            role[0] if role else "?",
            role[0] if role else "?",
            extra={"job": "purge", "error": PURGE_SKIPPED_NO_PRIVILEGE},
        )
        counts[PURGE_SKIPPED_NO_PRIVILEGE] = 1
    if ledger_horizon_seconds is not None:
        # Never shorter than the retention: an entry must outlive the row it stands for.
        horizon = max(float(ledger_horizon_seconds), float(retention_seconds))
        drop = {"horizon": horizon, "limit": LEDGER_DROP_BATCH}
        dropped, _ = _batches(
            lambda: conn.execute(_DROP_LEDGER, drop).rowcount, max_batches, LEDGER_DROP_BATCH
        )
        if dropped:
            counts["ledger_dropped"] = dropped
    return counts


# -- 5. alerts --------------------------------------------------------------------------------------

_ALERTABLE = """
SELECT id, key, step, destination, state, last_error,
       EXTRACT(EPOCH FROM now() - created_at) AS age,
       EXTRACT(EPOCH FROM now() - unknown_since) AS unknown_for
FROM outbox_message
WHERE alerted_at IS NULL
  AND (state = 'failed'
       OR (state = 'unknown' AND unknown_since < now() - %(after)s * interval '1 second'))
ORDER BY id
LIMIT %(limit)s
"""

_MARK_ALERTED = """
UPDATE outbox_message
SET alerted_at = now()
WHERE id = %(id)s AND state = %(state)s AND alerted_at IS NULL
RETURNING id
"""


def send_alerts(
    conn: psycopg.Connection[Any],
    hook: AlertHook = log_alert,
    *,
    unknown_alert_after_seconds: float,
    batch_size: int = DEFAULT_ALERT_BATCH,
) -> dict[str, int]:
    """Report each newly `failed` row, and each row `unknown` for longer than
    ``unknown_alert_after_seconds``, once, through ``hook``; then mark it ``alerted_at``.

    The hook runs before the mark: a crash in between repeats an alert rather than losing it.
    A hook that raises leaves the row unmarked, so it is reported again next run.
    Counts: ``alerts``, ``hook_errors``, ``raced``.
    """
    _require_autocommit(conn, "alerts")
    counts: Counter[str] = Counter()
    rows = conn.execute(
        _ALERTABLE, {"after": float(unknown_alert_after_seconds), "limit": batch_size}
    ).fetchall()
    for row_id, key, step, destination, state, last_error, age, unknown_for in rows:
        reason = last_error or "no reason recorded"
        if state == "unknown":
            reason = f"outcome unknown for {float(unknown_for):.0f} s: {reason}"
        alert = AlertRow(
            id=row_id,
            key=key,
            step=step,
            destination=destination,
            state=state,
            reason=reason,
            age=float(age),
        )
        try:
            hook(alert)
        except Exception:
            counts["hook_errors"] += 1
            logger.exception(
                "alert hook failed for outbox row %s; it will be reported again",
                row_id,
                extra={"outbox_id": row_id, "destination": destination},
            )
            continue
        marked = conn.execute(_MARK_ALERTED, {"id": row_id, "state": state}).fetchone()
        counts["alerts" if marked is not None else "raced"] += 1
    return _nonzero(counts)


# -- 6. no_consumer ---------------------------------------------------------------------------------

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

_FIRST_ROW = (
    "SELECT key, step, state, EXTRACT(EPOCH FROM now() - created_at) FROM outbox_message WHERE id = %s"
)

_PURGE_HEARTBEATS = """
DELETE FROM outbox_process WHERE last_seen_at < now() - %(retention)s * interval '1 second'
"""


def no_consumer(
    conn: psycopg.Connection[Any],
    hook: AlertHook = log_alert,
    *,
    cycles_before_alert: int = heartbeat.DEFAULT_NO_CONSUMER_CYCLES,
) -> dict[str, int]:
    """Find destinations with rows waiting (`pending` or `dispatched`) and no live worker
    heartbeat serving their queue; alert each once per episode, after ``cycles_before_alert``
    runs in a row (a worker restarting during a deploy is not an episode). The alert goes to
    ``hook`` as an :class:`AlertRow` with state ``no_consumer``, naming the oldest waiting row
    and saying "no consumer for D since T, K rows waiting". Also deletes the heartbeats of
    processes not heard from for a day.

    Counts: ``no_consumer`` (destinations), ``alerts``, ``hook_errors``, ``ended`` (episodes
    over: a consumer appeared or nothing waits), ``heartbeats_purged``.
    """
    _require_autocommit(conn, "no_consumer")
    counts: Counter[str] = Counter()
    counts["heartbeats_purged"] = conn.execute(
        _PURGE_HEARTBEATS, {"retention": heartbeat.HEARTBEAT_RETENTION_SECONDS}
    ).rowcount
    found = heartbeat.no_consumer(conn.execute(heartbeat.NO_CONSUMER_SQL).fetchall())
    for ended in conn.execute(_END_EPISODES, {"destinations": [f.destination for f in found]}).fetchall():
        counts["ended"] += 1
        logger.info(
            "destination %s has a consumer again, or nothing waits for one",
            ended[0],
            extra={"destination": ended[0]},
        )
    for gap in found:
        counts["no_consumer"] += 1
        row = conn.execute(
            _EPISODE, {"destination": gap.destination, "since": gap.since, "rows": gap.rows_waiting}
        ).fetchone()
        if row is None or row[0] < cycles_before_alert or row[1] is not None:
            continue
        first = conn.execute(_FIRST_ROW, (gap.first_id,)).fetchone()
        if first is None:
            continue  # gone since the count: the next cycle sees the destination afresh
        alert = AlertRow(
            id=gap.first_id,
            key=first[0],
            step=first[1],
            destination=gap.destination,
            state="no_consumer",
            reason=f"{gap.describe()}; start a worker serving it, or cancel the rows "
            f"(outbox cancel --destination {gap.destination} --reason …)",
            age=float(first[3]),
        )
        try:
            hook(alert)
        except Exception:
            counts["hook_errors"] += 1
            logger.exception(
                "alert hook failed for destination %s; it will be reported again",
                gap.destination,
                extra={"destination": gap.destination},
            )
            continue
        if conn.execute(_MARK_EPISODE_ALERTED, {"destination": gap.destination}).fetchone() is not None:
            counts["alerts"] += 1
    return _nonzero(counts)
