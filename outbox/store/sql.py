"""What the store's statements share: the next steps a settling statement writes
(outbox.chains), the state and stored answer of a settled call, one SQLAlchemy construct per
statement."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from .. import chains, outcomes, sanitize
from ..settings import DESTINATION_EPISODE_GAP_SECONDS

#: How long a worker's delivery statement waits for a row lock (PostgreSQL's ``lock_timeout``,
#: ms) before the server refuses it and the worker gives the connection back and tries again
#: after a pause: a few rows locked by the application (``outbox.cancel`` in a slow transaction,
#: a ``SELECT ... FOR UPDATE``) hold the deliveries that want them, never the pool every other
#: delivery shares. The relay's own locks last milliseconds.
LOCK_WAIT_MS = 200

#: Set inside the statement, for its transaction only, so that it holds through a pooler in
#: transaction mode (no startup options, no SET there: the next transaction may be another
#: client's on the same backend). Put in the WHERE of the first scan that takes a row lock: an
#: uncorrelated subquery is a one-time filter, evaluated before that scan.
LOCK_WAIT_SQL = f"(SELECT set_config('lock_timeout', '{LOCK_WAIT_MS}', true)) IS NOT NULL"

#: A record's commit does not wait for the WAL flush: a record lost in a crash of PostgreSQL
#: leaves the row in_flight, and the lease and the lookup settle it (docs/production.md).
ASYNC_COMMIT_SQL = "(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"


@functools.cache
def cached_text(sql: str) -> Any:
    # One construct per statement, made once: `outbox.write` runs in the application's hot path.
    return text(sql)


#: The next steps of the plan, as rows (an empty set when the parameter is NULL).
PLANNED = (
    "jsonb_to_recordset(CAST(%(follow)s AS jsonb)) "
    "AS n(step text, destination text, payload jsonb, via text, payload_version integer)"
)


def follow_sql(moved: str, *, certain: str = "false") -> str:
    """The CTE (``, followed AS (…)``) that writes the plan's rows after the row of CTE ``moved``
    (which returns ``id, key, state, trace_context, priority, fairness_key``: the steps
    inherit the last two): the ``then`` steps when it moved to
    ``sent``, the ``on_failure`` steps when it moved to ``failed`` and ``certain`` (an SQL
    expression over ``moved``) holds. ``ON CONFLICT DO NOTHING`` and the key ledger's guard make
    a step that exists already a no-op; :func:`conflict_sql` tells whether it differs."""
    return f"""
, followed AS (
    INSERT INTO outbox_message (key, step, destination, payload, parent_id, via, trace_context,
                                payload_version, priority, fairness_key)
    SELECT {moved}.key, n.step, n.destination, n.payload, {moved}.id, n.via, {moved}.trace_context,
           COALESCE(n.payload_version, 1), {moved}.priority, {moved}.fairness_key
    FROM {moved}, {PLANNED}
    WHERE (n.via = '{chains.THEN}' AND {moved}.state = 'sent')
       OR (n.via = '{chains.ON_FAILURE}' AND {moved}.state = 'failed' AND {certain})
    ON CONFLICT (key, step) DO NOTHING
    RETURNING id
)"""


def conflict_sql(row: str, new_state: str) -> str:
    """An expression, in the SET of the statement that moves ``row`` to ``new_state`` (SQL
    expressions), that says which planned steps exist already with another destination or
    payload (a live row, or a purged one in the key ledger); NULL when none does. Read on the
    statement's snapshot: a conflicting row committed while it runs is not seen."""
    return f"""(SELECT string_agg('step ' || n.step || ' exists already with another '
                  || CASE WHEN COALESCE(e.destination, l.destination) <> n.destination
                          THEN 'destination' ELSE 'payload' END, '; ')
    FROM {PLANNED}
    LEFT JOIN outbox_message e ON e.key = {row}.key AND e.step = n.step
    LEFT JOIN outbox_key_ledger l ON l.key = {row}.key AND l.step = n.step
    WHERE n.via = CASE {new_state} WHEN 'sent' THEN '{chains.THEN}'
                                   WHEN 'failed' THEN '{chains.ON_FAILURE}' END
      AND (e.destination <> n.destination OR e.payload <> n.payload
           OR l.destination <> n.destination OR l.payload_hash <> outbox_payload_digest(n.payload)))"""


def problem_sql(row: str, new_state: str) -> str:
    """``chain_problem`` after the move: the plan's own problem (``%(chain_problem)s``, from
    Python) and the conflicts, when the row moves to a state that writes steps; else unchanged."""
    return f"""CASE WHEN CAST(%(follow)s AS jsonb) IS NULL AND CAST(%(chain_problem)s AS text) IS NULL
         THEN {row}.chain_problem
         WHEN {new_state} IN ('sent', 'failed')
         THEN NULLIF(concat_ws('; ', CAST(%(chain_problem)s AS text), {conflict_sql(row, new_state)}), '')
         ELSE {row}.chain_problem END"""


def certain_failure_sql(row_id: str, token: str) -> str:
    """No call of row ``row_id`` other than the one under ``token`` may have taken effect."""
    return f"""NOT EXISTS (SELECT 1 FROM outbox_attempt a
                    WHERE a.message_id = {row_id} AND a.claim_token IS DISTINCT FROM {token}
                      AND {outcomes.may_have_taken_effect_sql("a")})"""


#: SQL fragments shared by the record and the reconciler's settlement of a lookup: when a
#: row is due again (``%(delay)s`` seconds from the database's now, or NULL to keep
#: ``available_at``), and whether a retry would fall on or after the row's deadline, in which
#: case the row is failed instead (with ``%(deadline_error)s`` as its reason).
DUE_SQL = "now() + CAST(%(delay)s AS float8) * interval '1 second'"


PAST_DEADLINE_SQL = f"(%(state)s = 'pending' AND deadline IS NOT NULL AND {DUE_SQL} >= deadline)"


NEW_STATE_SQL = f"(CASE WHEN {PAST_DEADLINE_SQL} THEN 'failed' ELSE %(state)s END)"


@dataclass(frozen=True)
class Recorded:
    #: The state the row moved to, or None when a newer claim owns it.
    state: str | None
    #: Next steps (outbox.chains) this record wrote.
    followed: int = 0
    #: Why declared next steps were not all written (outbox.chains), or None.
    chain_problem: str | None = None


def stored(
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


def for_sqlalchemy(sql: str) -> str:
    """psycopg's ``%(name)s`` placeholders as SQLAlchemy's ``:name``: the chain fragments
    (outbox.chains) serve both drivers."""
    return re.sub(r"%\((\w+)\)s", r":\1", sql)


# == destinations (outbox_destination): pauses and the breaker ===================================

# The episode's start: kept while paused, or after a pause that ran out by itself less than
# DESTINATION_EPISODE_GAP_SECONDS ago, so that a chain of short Retry-After holds is one episode,
# alerted once; resume sets resumed_at to the end it gives, which ends
# the episode.
EPISODE_START_SQL = (
    f"CASE WHEN d.paused_until > now() OR (d.paused_until > now() - interval "
    f"'{DESTINATION_EPISODE_GAP_SECONDS} seconds' AND d.resumed_at IS DISTINCT FROM d.paused_until) "
    "THEN d.paused_at ELSE now() END"
)


# Closed by hand (`outbox resume`, or a deploy without a breaker): that also ends the episode
# (breaker_since), so a trip right after it is a new one, alerted again.
BREAKER_CLOSE_SET = """
SET breaker_opened_at = NULL, breaker_open_until = NULL, breaker_open_seconds = NULL,
    breaker_probe_token = NULL, breaker_probe_until = NULL, breaker_failures = 0,
    breaker_window_at = NULL, breaker_closed_at = now(), breaker_since = NULL
"""


#: A process is live while it was heard from within ``LIVE_INTERVALS`` of its own interval plus
#: ``LIVE_SLACK_SECONDS``: one late beat (a GC pause, a slow commit) does not make it dead.
LIVE_INTERVALS = 3
LIVE_SLACK_SECONDS = 5

#: SQL condition on ``outbox_process``: the process is running and was heard from recently
#: (its own interval is stored on the row, so every reader judges it alike).
LIVE = (
    "stopped_at IS NULL AND last_seen_at > now() - "
    f"(interval_seconds * {LIVE_INTERVALS} + {LIVE_SLACK_SECONDS}) * interval '1 second'"
)

#: SQL condition on ``outbox_destination d``: the destination has a limit of either kind, the
#: operator's or the hint that a live process declares one (outbox.limits).
LIMITED_SQL = (
    "COALESCE(d.limit_in_flight, d.declared_in_flight, d.limit_per_second, d.declared_per_second) IS NOT NULL"
)

#: The limits that live processes' handlers declare (outbox.limits): the lowest of each kind for
#: each destination, as ``(destination, n, rate)`` rows (``n``: calls in flight, ``rate``: calls a
#: second; None where no live process declares that kind). Migrations 0023/0024's claim trigger
#: reads the same, for its one destination.
LIVE_DECLARATIONS_SQL = f"""
SELECT destination, min(n) AS n, min(rate) AS rate
FROM (
    SELECT d.key AS destination, CAST(d.value AS integer) AS n, CAST(NULL AS float8) AS rate
    FROM outbox_process p, jsonb_each_text(p.declared_in_flight) AS d
    WHERE {LIVE}
    UNION ALL
    SELECT d.key, NULL, CAST(d.value AS float8)
    FROM outbox_process p, jsonb_each_text(p.declared_per_second) AS d
    WHERE {LIVE}
) AS declared
GROUP BY destination
"""
