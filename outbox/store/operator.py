"""The operator's statements, in the caller's transaction: replay, resolve, skip, cancel, and
``outbox repair``'s moves; each appends to the row's history."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import text

from .. import chains, ordering, outcomes
from ..schema import FLOOR_TABLE
from .sql import (
    BREAKER_CLOSE_SET,
    EPISODE_START_SQL,
    LIVE_DECLARATIONS_SQL,
    cached_text,
    follow_sql,
    for_sqlalchemy,
    problem_sql,
    stored,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection


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
        chain_problem = {problem_sql("m", "'sent'")},
        history = history || jsonb_build_array(jsonb_build_object(
            'at', now(), 'by', CAST(%(by)s AS text), 'action', 'repair', 'reason', CAST(%(reason)s AS text),
            'from', 'failed', 'to', 'sent', 'result', 'found', 'provider_ref', CAST(%(ref)s AS text))
            || CAST(%(extra)s AS jsonb))
    WHERE m.id = %(id)s AND m.state = 'failed' AND m.completed_at IS NOT DISTINCT FROM %(version)s
      AND NOT {chains.COMPENSATED_SQL}
      AND (CAST(%(overrule)s AS boolean) OR NOT {outcomes.operator_failed_unknown_sql("m")})
    RETURNING m.id, m.key, m.state, m.trace_context, m.priority, m.fairness_key
){follow_sql("moved")}
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
        **stored(ref=ref, response=response, error=None, deadline_error=None),
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
    -- handler, or an operator, says otherwise.
    order_skipped_at = NULL, skip_when_failed = false,
"""
    + HISTORY_ENTRY
)


# The replay rules (outbox.outcomes): an attempt row that may have taken effect, or an operator's
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


# One row, named by the operator with a reason: the attempt rows the preview showed are marked as
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


# The row's then steps (outbox.chains) are written by the same statement.
_RESOLVE_SENT = f"""
WITH moved AS (
    UPDATE outbox_message
    SET state = 'sent', provider_ref = :ref, completed_at = now(), last_error = NULL,
        response = CAST(:response AS jsonb), chains_known_at = clock_timestamp(),
        unknown_since = NULL, lease_expires_at = NULL, alerted_at = NULL,
        chain_problem = {for_sqlalchemy(problem_sql("outbox_message", "'sent'"))},
    {HISTORY_ENTRY}
    WHERE id = :id AND state = 'unknown'
    RETURNING id, key, state, trace_context, priority, fairness_key
){for_sqlalchemy(follow_sql("moved"))}
SELECT id, (SELECT count(*) FROM followed) FROM moved
"""


# attempts stay: the earlier call is known not to have taken effect, but it counted. The row's
# ambiguous attempt rows are marked settled in the same statement (what lets a later replay through);
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
    return list(connection.execute(cached_text(_REPLAY_PLANNED), params))


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
    blocking attempt row other than ``seen`` (the ones the operator was shown) exists; those are
    marked ``operator_forced``. ``overrule``: also over an operator's ``resolve --failed``.
    ``(id, past_deadline)``, or None when it did not move."""
    params = {**history, "id": row_id, "version": version, "seen": list(seen), "overrule": overrule}
    return connection.execute(cached_text(_REPLAY_FORCED), params).first()


def resolve_sent(
    connection: Connection,
    *,
    row_id: int,
    ref: str,
    history: Mapping[str, Any],
    follow: chains.Plan = chains.NO_NEXT_STEPS,
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
    row = connection.execute(cached_text(_RESOLVE_SENT), params).first()
    return int(row[1]) if row is not None else None


def resolve_not_sent(connection: Connection, *, row_id: int, history: Mapping[str, Any]) -> bool:
    """``unknown`` -> ``pending``, its ambiguous attempt rows settled; refused (False) when an
    attempt row holds a call the provider confirmed."""
    params = {**history, "id": row_id}
    return connection.execute(cached_text(_RESOLVE_NOT_SENT), params).first() is not None


def resolve_failed(connection: Connection, *, row_id: int, error: str, history: Mapping[str, Any]) -> bool:
    """``unknown`` -> ``failed`` with the operator's reason (a later replay needs ``--force``)."""
    params = {**history, "id": row_id, "error": error}
    return connection.execute(cached_text(_RESOLVE_FAILED), params).first() is not None


def skip_head(connection: Connection, *, row_id: int, history: Mapping[str, Any]) -> bool:
    """A ``failed`` row of an ordering key stops holding the rows behind it (outbox.ordering); it
    stays failed. False when it did not move (not failed, no ordering key, or skipped already)."""
    params = {**history, "id": row_id}
    return connection.execute(cached_text(_SKIP_HEAD), params).first() is not None


def cancel_rows(
    connection: Connection, *, ids: Sequence[int], error: str | None, history: Mapping[str, Any]
) -> set[int]:
    """``pending``/``dispatched`` -> ``cancelled`` for each of ``ids`` none of whose calls may have
    taken effect (:data:`CANCELLABLE_SQL`); the ids that moved."""
    params = {**history, "error": error, "ids": list(ids)}
    return {int(r[0]) for r in connection.execute(cached_text(_CANCEL_ROWS), params)}


# == destinations (outbox_destination): pause and resume ===========================================

_PAUSE = text(
    f"""
    INSERT INTO outbox_destination AS d (destination, paused_until, paused_at, paused_by, pause_reason)
    VALUES (:destination,
            COALESCE(CAST(:until AS timestamptz),
                     now() + CAST(:seconds AS float8) * interval '1 second',
                     'infinity'),
            now(), :by, :reason)
    ON CONFLICT (destination) DO UPDATE
    SET paused_until = EXCLUDED.paused_until,
        -- A pause of a paused destination changes its end and reason, not when it began.
        paused_at = {EPISODE_START_SQL},
        paused_by = EXCLUDED.paused_by,
        pause_reason = EXCLUDED.pause_reason
    RETURNING destination, NULLIF(paused_until, 'infinity') AS paused_until, paused_at, paused_by,
              pause_reason
    """
)

_RESUME = text(
    """
    UPDATE outbox_destination
    SET paused_until = now(), resumed_at = now(), resumed_by = :by
    WHERE destination = :destination AND paused_until > now()
    RETURNING destination, paused_at, paused_by, pause_reason
    """
)


# `outbox resume` closes the breaker too.
_CLOSE_BREAKER = text(
    f"UPDATE outbox_destination {BREAKER_CLOSE_SET} WHERE destination = :destination "
    "AND breaker_opened_at IS NOT NULL RETURNING breaker_opened_at"
)


def pause_destination(connection: Connection, params: Mapping[str, Any]) -> Any:
    """``outbox pause`` (outbox.pauses.pause): the destination's row as paused."""
    return connection.execute(_PAUSE, params).one()


def resume_destination(connection: Connection, destination: str, *, by: str) -> tuple[Any, bool]:
    """``outbox resume`` (outbox.pauses.resume): the pause it ended (None: not paused), and
    whether it closed an open breaker."""
    row = connection.execute(_RESUME, {"destination": destination, "by": by}).first()
    closed = connection.execute(_CLOSE_BREAKER, {"destination": destination}).first() is not None
    return row, closed


# == destinations (outbox_destination): limits, `outbox limit` ====================================

# The limits that hold are the operator's, else the lowest that live processes declare (what the
# claim's trigger, migrations 0023/0024, reads under its lock), each kind apart. In flight: as
# the trigger counts (rows ``in_flight``, and unknown rows until their ``landing_until``).
# Waiting: rows published and not claimed yet, and since when the oldest of them waits; kept
# back: due rows not published yet (the relay's window is full), and since when.
_LIMITS = f"""
    WITH declared AS ({LIVE_DECLARATIONS_SQL})
    SELECT COALESCE(o.destination, declared.destination) AS destination,
           o.limit_in_flight, declared.n AS declared_in_flight,
           COALESCE(o.limit_in_flight, declared.n) AS holds,
           o.limit_per_second, declared.rate AS declared_per_second,
           COALESCE(o.limit_per_second, declared.rate) AS holds_per_second,
           o.limit_reason, o.limit_set_by, o.limit_set_at,
           (SELECT count(*) FROM outbox_message m
            WHERE m.destination = COALESCE(o.destination, declared.destination)
              AND (m.state = 'in_flight'
                   OR (m.state = 'unknown' AND m.available_at > now()
                       AND m.landing_until > now()))) AS in_flight,
           w.waiting, w.waiting_since, k.kept_back, k.kept_back_since
    FROM (SELECT * FROM outbox_destination
          WHERE limit_in_flight IS NOT NULL OR limit_per_second IS NOT NULL) AS o
    FULL JOIN declared ON declared.destination = o.destination
    CROSS JOIN LATERAL (
        SELECT count(*) AS waiting, min(m.dispatched_at) AS waiting_since FROM outbox_message m
        WHERE m.destination = COALESCE(o.destination, declared.destination)
          AND m.state = 'dispatched'
    ) AS w
    -- Due rows the relay keeps back until the destination's window has room (outbox.windows).
    CROSS JOIN LATERAL (
        SELECT count(*) AS kept_back, min(m.available_at) AS kept_back_since FROM outbox_message m
        WHERE m.destination = COALESCE(o.destination, declared.destination)
          AND m.state = 'pending' AND m.available_at <= now()
    ) AS k
    WHERE CAST(:destination AS text) IS NULL OR COALESCE(o.destination, declared.destination) = :destination
    ORDER BY 1
"""

# A kind not given keeps the operator's value it had; the reason, who and when are the latest.
_SET_LIMIT = text(
    """
    INSERT INTO outbox_destination AS d
        (destination, limit_in_flight, limit_per_second, limit_reason, limit_set_by, limit_set_at)
    VALUES (:destination, :in_flight, :per_second, :reason, :by, now())
    ON CONFLICT (destination) DO UPDATE
    SET limit_in_flight = COALESCE(EXCLUDED.limit_in_flight, d.limit_in_flight),
        limit_per_second = COALESCE(EXCLUDED.limit_per_second, d.limit_per_second),
        limit_reason = EXCLUDED.limit_reason,
        limit_set_by = EXCLUDED.limit_set_by, limit_set_at = EXCLUDED.limit_set_at
    """
)

_CLEAR_LIMIT = text(
    """
    UPDATE outbox_destination
    SET limit_in_flight = NULL, limit_per_second = NULL, limit_reason = NULL, limit_set_by = :by,
        limit_set_at = now()
    WHERE destination = :destination AND (limit_in_flight IS NOT NULL OR limit_per_second IS NOT NULL)
    RETURNING destination
    """
)


def limits(connection: Connection, destination: str | None = None) -> list[Any]:
    """Destinations with a limit (outbox.limits), or ``destination``'s only."""
    return list(connection.execute(text(_LIMITS), {"destination": destination}).all())


def set_limit(connection: Connection, params: Mapping[str, Any]) -> None:
    """``outbox limit D --in-flight N --per-second R``: the operator's limits, over any declared."""
    connection.execute(_SET_LIMIT, params)


def clear_limit(connection: Connection, destination: str, *, by: str) -> bool:
    """``outbox limit D --clear``: whether there was an operator's limit to clear (both kinds)."""
    return connection.execute(_CLEAR_LIMIT, {"destination": destination, "by": by}).first() is not None


# == the database identity (outbox_db_identity): `outbox failover --accept` ========================

_ACCEPT = """
INSERT INTO outbox_db_identity AS i (id, system_identifier, timeline, recorded_by, note)
VALUES (1, %(sysid)s, %(timeline)s, %(by)s, %(note)s)
ON CONFLICT (id) DO UPDATE
SET system_identifier = EXCLUDED.system_identifier, timeline = EXCLUDED.timeline,
    recorded_at = now(), recorded_by = EXCLUDED.recorded_by, note = EXCLUDED.note,
    mismatch_seen_at = NULL, mismatch = NULL
RETURNING recorded_at
"""


def accept_identity(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> None:
    """``outbox failover --accept``: the server's identity is the one to run on from now."""
    conn.execute(_ACCEPT, params)


# == features (outbox_feature) and the floor they raise: `outbox features enable` =================


def enable_feature(connection: Connection, *, name: str, needs_code: str, by: str, reason: str | None) -> Any:
    """The feature's row (outbox.features.enable, under its table lock): ``(enabled_at,
    enabled_by, reason)``."""
    return connection.execute(
        text(
            "INSERT INTO outbox_feature (name, needs_code, enabled_by, reason) "
            "VALUES (:n, :needs, :by, :reason) RETURNING enabled_at, enabled_by, reason"
        ),
        {"n": name, "needs": needs_code, "by": by, "reason": reason},
    ).one()


def set_floor(connection: Connection, migration: str, *, needs_code: str) -> None:
    """A floor (``outbox_schema_floor``): processes of code older than ``needs_code`` refuse to
    start (outbox.migrate)."""
    connection.execute(
        text(
            f"INSERT INTO {FLOOR_TABLE} (migration, needs_code) VALUES (:m, :c) "
            "ON CONFLICT (migration) DO UPDATE SET needs_code = excluded.needs_code"
        ),
        {"m": migration, "c": needs_code},
    )


def drop_floor(connection: Connection, migration: str) -> None:
    connection.execute(text(f"DELETE FROM {FLOOR_TABLE} WHERE migration = :m"), {"m": migration})


# == the dashboard's signed-out sessions (outbox_dashboard_session_end) ===========================

_END_DASHBOARD_SESSION = text(
    """
WITH gone AS (
    -- A day past its expiry on the database's clock: the cookie's expiry is read on the app
    -- host's, and a host clock behind must not bring a signed-out cookie back to life.
    DELETE FROM outbox_dashboard_session_end WHERE expires_at < now() - interval '1 day'
)
INSERT INTO outbox_dashboard_session_end (sid, expires_at)
VALUES (:sid, to_timestamp(:exp)) ON CONFLICT (sid) DO NOTHING
"""
)


def end_dashboard_session(connection: Any, *, sid: str, expires_at_epoch: float) -> None:
    """A dashboard session signed out: its cookie is refused until it would have expired."""
    connection.execute(_END_DASHBOARD_SESSION, {"sid": sid, "exp": expires_at_epoch})
