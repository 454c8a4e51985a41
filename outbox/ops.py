"""Commands for the person on call: look (status, show, failed, unknown, audit, doctor) and act
(replay, resolve).

Every action is one guarded statement per row (``UPDATE … WHERE id = :id AND state = …``), so a
row that moved since the operator looked is refused, never overwritten; who did it and why is
appended to the row's ``history``. Looking never writes: those commands run in read-only
transactions. Payloads may hold personal data, so they are only printed on request.

The functions below take a SQLAlchemy ``Connection`` and never commit: the caller owns the
transaction (and a NOTIFY sent by an action is delivered when it commits).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import hashlib
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, text

from . import heartbeat, outcomes, sanitize, settings, states
from .audit import AuditReport, audit, format_table, parse_since
from .exceptions import ConfigError, InvalidTransition, NotFound, OutboxError
from .heartbeat import NoConsumer
from .schema import NOTIFY_CHANNEL

__all__ = [
    "COMMANDS",
    "ActionResult",
    "AuditReport",
    "CancelPlan",
    "ListedRow",
    "ReplayCandidate",
    "ReplayPlan",
    "RowDetail",
    "RowList",
    "StatusReport",
    "audit",
    "cancel_rows",
    "execute_replay",
    "list_rows",
    "plan_replay",
    "replay",
    "replay_destination",
    "resolve",
    "show",
    "status",
]

DEFAULT_LIST_LIMIT = 50

# -- status ------------------------------------------------------------------------------------------

# "Oldest pending age" is measured from when the row became due, not from when it was written:
# a row waiting out its retry backoff is not late, a due row nobody publishes is (stalled relay).
_STATUS = text(
    """
SELECT destination, state, count(*) AS n,
       EXTRACT(EPOCH FROM now() - min(available_at)
               FILTER (WHERE state = 'pending' AND available_at <= now())) AS oldest_pending_age
FROM outbox_message
GROUP BY destination, state
ORDER BY destination, state
"""
)


@dataclass
class StatusReport:
    generated_at: datetime
    #: destination → state → count (every state present, zeros included).
    counts: dict[str, dict[str, int]]
    #: destination → seconds the oldest due `pending` row has waited (None: none due).
    oldest_pending_age: dict[str, float | None]
    #: Destinations with rows waiting and no live worker heartbeat serving their queue.
    no_consumer: list[NoConsumer] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        return {s: sum(c[s] for c in self.counts.values()) for s in states.ALL}

    @property
    def total(self) -> int:
        return sum(self.totals().values())

    @property
    def oldest_pending_age_seconds(self) -> float | None:
        ages = [a for a in self.oldest_pending_age.values() if a is not None]
        return max(ages) if ages else None

    def to_dict(self) -> dict[str, Any]:
        totals = self.totals()
        return {
            "generated_at": self.generated_at.isoformat(),
            "destinations": {
                d: {**c, "total": sum(c.values()), "oldest_pending_age_seconds": self.oldest_pending_age[d]}
                for d, c in self.counts.items()
            },
            "by_state": totals,
            "unknown": totals[states.UNKNOWN],
            "failed": totals[states.FAILED],
            "total": self.total,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "no_consumer": [n.to_dict() for n in self.no_consumer],
        }

    def render(self) -> str:
        if not self.counts:
            return "no outbox rows"
        totals = self.totals()
        rows: list[list[Any]] = [
            [d, *(c[s] for s in states.ALL), sum(c.values()), _age(self.oldest_pending_age[d])]
            for d, c in self.counts.items()
        ]
        rows.append(
            ["TOTAL", *(totals[s] for s in states.ALL), self.total, _age(self.oldest_pending_age_seconds)]
        )
        table = format_table(["destination", *states.ALL, "total", "oldest pending"], rows)
        summary = (
            f"unknown: {totals[states.UNKNOWN]}   failed: {totals[states.FAILED]}   total: {self.total}   "
            f"oldest due pending row: {_age(self.oldest_pending_age_seconds) or 'none'}"
        )
        gaps = "".join(f"\n{n.describe()}" for n in self.no_consumer)
        return f"{table}\n\n{summary}{gaps}"


def status(connection: Connection) -> StatusReport:
    """Counts by destination and state, the age of the oldest due pending row, and the
    destinations no live worker consumes (from the heartbeats in the database)."""
    generated_at = connection.execute(text("SELECT now()")).scalar_one()
    counts: dict[str, dict[str, int]] = {}
    ages: dict[str, float | None] = {}
    for row in connection.execute(_STATUS):
        counts.setdefault(row.destination, dict.fromkeys(states.ALL, 0))[row.state] = int(row.n)
        if row.state == states.PENDING:
            ages[row.destination] = _seconds(row.oldest_pending_age)
    for d in counts:
        ages.setdefault(d, None)
    gaps = heartbeat.no_consumer(connection.execute(text(heartbeat.NO_CONSUMER_SQL)))
    return StatusReport(generated_at, counts, ages, gaps)


# -- show --------------------------------------------------------------------------------------------

# Every column but the payload, whose size and top-level keys stand in for it: what is in it may
# be personal data, and an operator rarely needs more than its shape.
_ROW_COLUMNS = """
    id, key, step, destination, state, attempts, available_at, deadline, created_at,
    dispatched_at, claimed_at, lease_expires_at, completed_at, unknown_since, alerted_at,
    claim_token, provider_ref, response, last_error, history, releases,
    octet_length(payload::text) AS payload_bytes,
    CASE WHEN jsonb_typeof(payload) = 'object'
         THEN ARRAY(SELECT jsonb_object_keys(payload) ORDER BY 1) END AS payload_keys
"""
_SHOW_BY_ID = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE id = :id")
_SHOW_BY_KEY = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE key = :key AND step = :step")
_PAYLOAD = text("SELECT payload FROM outbox_message WHERE id = :id")
_ATTEMPTS = text(
    """
SELECT attempt, claim_token, started_at, finished_at, outcome, http_status, error
FROM outbox_attempt WHERE message_id = :id ORDER BY started_at, id
"""
)


@dataclass
class RowDetail:
    row: dict[str, Any]
    attempts: list[dict[str, Any]]
    history: list[dict[str, Any]]
    #: Only when asked for (`--payload`).
    payload: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        row = dict(self.row)
        if self.payload is not None:
            row["payload"] = self.payload
        return {"row": row, "attempts": self.attempts, "history": self.history}

    def render(self) -> str:
        width = max(len(k) for k in self.row)
        lines = [
            f"{k.ljust(width)}  {_cell(v, long=True) if v is not None else '-'}" for k, v in self.row.items()
        ]
        if self.payload is not None:
            lines.append(f"{'payload'.ljust(width)}  {json.dumps(self.payload, ensure_ascii=False)}")
        lines += ["", f"attempts ({len(self.attempts)} fence rows):"]
        if self.attempts:
            headers = [
                "attempt",
                "claim_token",
                "started_at",
                "finished_at",
                "outcome",
                "http_status",
                "error",
            ]
            lines.append(
                _indent(format_table(headers, [[_cell(a[h]) for h in headers] for a in self.attempts]))
            )
        else:
            lines.append("  none: never claimed")
        lines += ["", f"history ({len(self.history)} operator actions):"]
        if self.history:
            keys = ["at", "by", "action", "from", "to", "reason"]
            extra = sorted({k for h in self.history for k in h} - set(keys))
            lines.append(
                _indent(
                    format_table(
                        keys + extra, [[_cell(h.get(k)) for k in keys + extra] for h in self.history]
                    )
                )
            )
        else:
            lines.append("  none")
        return "\n".join(lines)


# A purged row's key: what the key ledger keeps of it (never the payload, only its hash).
_SHOW_LEDGER = text(
    """
SELECT message_id AS id, key, step, destination, state, provider_ref, attempts,
       confirmed AS confirmed_attempts, ambiguous, completed_at,
       encode(payload_hash, 'hex') AS payload_sha256
FROM outbox_key_ledger WHERE key = :key AND step = :step
"""
)


@dataclass
class LedgerDetail:
    """``show KEY STEP`` of a key whose row was purged: its key-ledger entry."""

    entry: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"purged": True, "ledger": dict(self.entry)}

    def render(self) -> str:
        width = max(len(k) for k in self.entry)
        lines = [
            f"row {self.entry['id']} was purged; the key ledger keeps its key until the horizon "
            "(OUTBOX_LEDGER_HORIZON), so writing it again answers as before the purge.",
            "Its attempts, history and payload are gone; the payload's SHA-256 is kept.",
            "",
        ]
        lines += [
            f"{k.ljust(width)}  {'-' if v is None else _cell(v, long=True)}" for k, v in self.entry.items()
        ]
        return "\n".join(lines)


def show(
    connection: Connection,
    row_id: int | None = None,
    *,
    key: str | None = None,
    step: str | None = None,
    payload: bool = False,
) -> RowDetail | LedgerDetail:
    """One row by id (or by ``key`` and ``step``) with its fence rows and history; by key, a
    purged row's key-ledger entry (:class:`LedgerDetail`).

    Raises :class:`NotFound` when there is no such row.
    """
    if row_id is not None:
        found = connection.execute(_SHOW_BY_ID, {"id": row_id}).mappings().first()
        missing = f"no outbox row with id {row_id}"
    elif key is not None and step is not None:
        found = connection.execute(_SHOW_BY_KEY, {"key": key, "step": step}).mappings().first()
        if found is None:
            entry = connection.execute(_SHOW_LEDGER, {"key": key, "step": step}).mappings().first()
            if entry is not None:
                return LedgerDetail(dict(entry))
        missing = f"no outbox row with key {key!r} and step {step!r}"
    else:
        raise ConfigError("show needs an id, or a key and a step")
    if found is None:
        raise NotFound(missing)
    row = dict(found)
    history = list(row.pop("history") or [])
    attempts = [dict(a) for a in connection.execute(_ATTEMPTS, {"id": row["id"]}).mappings()]
    body = connection.execute(_PAYLOAD, {"id": row["id"]}).scalar_one() if payload else None
    return RowDetail(row, attempts, history, body)


# -- failed / unknown lists --------------------------------------------------------------------------

# Age is the time spent in the state, the number an on-call compares with alert thresholds:
# `unknown_since` for unknown rows, `completed_at` (when it failed) for failed rows.
_LIST = text(
    """
SELECT id, key, step, destination, attempts, created_at, last_error,
       EXTRACT(EPOCH FROM now() - COALESCE(
           CASE WHEN state = 'unknown' THEN unknown_since ELSE completed_at END, created_at)) AS age,
       count(*) OVER () AS matching
FROM outbox_message
WHERE state = :state AND (CAST(:destination AS text) IS NULL OR destination = CAST(:destination AS text))
ORDER BY COALESCE(CASE WHEN state = 'unknown' THEN unknown_since ELSE completed_at END, created_at), id
LIMIT :limit
"""
)
_DESTINATION_EXISTS = text("SELECT EXISTS (SELECT 1 FROM outbox_message WHERE destination = :d)")
_DESTINATIONS = text("SELECT DISTINCT destination FROM outbox_message ORDER BY 1")


@dataclass(frozen=True)
class ListedRow:
    id: int
    key: str
    step: str
    destination: str
    attempts: int
    created_at: datetime
    age_seconds: float | None
    last_error: str | None


@dataclass
class RowList:
    state: str
    destination: str | None
    rows: list[ListedRow]
    #: How many rows match, beyond the limit.
    matching: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "destination": self.destination,
            "matching": self.matching,
            "rows": [vars(r) for r in self.rows],
        }

    def render(self) -> str:
        where = f" for destination {self.destination}" if self.destination else ""
        if not self.rows:
            return f"no {self.state} rows{where}"
        table = format_table(
            ["id", "key", "step", "destination", "attempts", "age", "last_error"],
            [
                [r.id, r.key, r.step, r.destination, r.attempts, _age(r.age_seconds), _short(r.last_error)]
                for r in self.rows
            ],
        )
        more = (
            f"\nshowing {len(self.rows)} of {self.matching}; use --limit"
            if self.matching > len(self.rows)
            else ""
        )
        return f"{table}{more}"


def _require_destination(connection: Connection, destination: str) -> None:
    """A destination no row names is a typo, not an empty result; say which ones exist."""
    if connection.execute(_DESTINATION_EXISTS, {"d": destination}).scalar_one():
        return
    known = [r[0] for r in connection.execute(_DESTINATIONS)]
    raise NotFound(
        f"no outbox rows for destination {destination!r} (known: {', '.join(known) if known else 'none'})"
    )


def list_rows(
    connection: Connection, state: str, *, destination: str | None = None, limit: int = DEFAULT_LIST_LIMIT
) -> RowList:
    """Rows in ``state``, longest in that state first. Raises :class:`NotFound` for a destination
    no row names."""
    if state not in states.ALL:
        raise ConfigError(f"unknown state {state!r}; states are {', '.join(states.ALL)}")
    if limit < 1:
        raise ConfigError("--limit must be at least 1")
    if destination is not None:
        _require_destination(connection, destination)
    result = connection.execute(_LIST, {"state": state, "destination": destination, "limit": limit})
    rows, matching = [], 0
    for r in result:
        matching = int(r.matching)
        rows.append(
            ListedRow(
                int(r.id),
                r.key,
                r.step,
                r.destination,
                int(r.attempts),
                r.created_at,
                _seconds(r.age),
                r.last_error,
            )
        )
    return RowList(state, destination, rows, matching)


# -- replay and resolve ------------------------------------------------------------------------------

# `from` is the state the row had (SET expressions read the old row), `at` the database clock.
_HISTORY_ENTRY = """
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
"""
    + _HISTORY_ENTRY
)

# The replay rules (outbox.outcomes): a fence row that may have taken effect, or an operator's
# `resolve --failed` out of unknown, refuses the replay unless the row is forced by name.
_BLOCKING_ATTEMPT = (
    f"SELECT 1 FROM outbox_attempt a WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql('a')}"
)
_REPLAYABLE = f"NOT EXISTS ({_BLOCKING_ATTEMPT}) AND NOT {outcomes.operator_failed_unknown_sql('m')}"
_FAILED_OUT_OF_UNKNOWN = (
    "an operator failed it out of unknown (resolve --failed): nobody knows whether its call took effect"
)

# What a replay would do to each row, and why it refuses: read to preview, never to act (the
# acting statements re-check every rule themselves).
_PLAN_COLUMNS = f"""
SELECT m.id, m.key, m.step, m.destination, m.state, m.completed_at, m.last_error,
       m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline,
       ARRAY(
           SELECT CASE
               WHEN {outcomes.is_confirmed_sql("a")} THEN
                   format('attempt %s was confirmed by the provider (outcome %s)', a.attempt, a.outcome)
               WHEN a.outcome IS NULL THEN
                   format('attempt %s never recorded an outcome: its call may have taken effect', a.attempt)
               ELSE format('attempt %s ended %s: its call may have taken effect, and neither a lookup '
                           'nor an operator (resolve --not-sent) settled it', a.attempt, a.outcome)
           END
           FROM outbox_attempt a WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql("a")}
           ORDER BY a.started_at, a.id
       ) || CASE WHEN {outcomes.operator_failed_unknown_sql("m")}
                 THEN ARRAY[CAST(:failed_out_of_unknown AS text)] ELSE ARRAY[]::text[] END AS refusals,
       ARRAY(SELECT a.id FROM outbox_attempt a
             WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql("a")} ORDER BY a.id) AS blockers
FROM outbox_message m
"""
_PLAN_IDS = text(f"{_PLAN_COLUMNS} WHERE m.id = ANY(CAST(:ids AS bigint[])) ORDER BY m.id")
_PLAN_DESTINATION = text(
    f"{_PLAN_COLUMNS} WHERE m.destination = :destination AND m.state = 'failed' ORDER BY m.id"
)

# Acts on exactly the previewed rows: each one only if it is still failed with the failure the
# preview saw (completed_at is set anew at every failure), and only if the rules still allow it.
_REPLAY_PLANNED = text(
    f"""
UPDATE outbox_message m {_REPLAY_SET}
FROM unnest(CAST(:ids AS bigint[]), CAST(:versions AS timestamptz[])) AS p(id, failed_at)
WHERE m.id = p.id AND m.state = 'failed' AND m.completed_at IS NOT DISTINCT FROM p.failed_at
  AND {_REPLAYABLE}
RETURNING m.id, m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline
"""
)

# One row, named by the operator with a reason: the fence rows the preview showed are marked as
# forced over in the same statement. A blocker the operator did not see refuses the whole thing.
_REPLAY_FORCED = text(
    f"""
WITH moved AS (
    UPDATE outbox_message m {_REPLAY_SET}
    WHERE m.id = :id AND m.state = 'failed'
      AND m.completed_at IS NOT DISTINCT FROM CAST(:version AS timestamptz)
      AND NOT EXISTS ({_BLOCKING_ATTEMPT} AND a.id <> ALL(CAST(:seen AS bigint[])))
    RETURNING m.id, m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline
), forced AS (
    UPDATE outbox_attempt a SET settled = '{outcomes.OPERATOR_FORCED}', settled_at = now()
    FROM moved WHERE a.message_id = moved.id AND a.id = ANY(CAST(:seen AS bigint[]))
)
SELECT id, past_deadline FROM moved
"""
)

_RESOLVE_SENT = text(
    """
UPDATE outbox_message
SET state = 'sent', provider_ref = :ref, completed_at = now(), last_error = NULL,
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
)
# attempts stay: the earlier call is known not to have taken effect, but it counted. The row's
# ambiguous fence rows are marked settled in the same statement (what lets a later replay through);
# a call the provider confirmed is not "not sent", whatever anyone says, so it refuses.
_RESOLVE_NOT_SENT = text(
    f"""
WITH moved AS (
    UPDATE outbox_message m
    SET state = 'pending', available_at = now(), dispatched_at = NULL, completed_at = NULL,
        unknown_since = NULL, lease_expires_at = NULL,
    {_HISTORY_ENTRY}
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
)
_CONFIRMED_ATTEMPT = text(
    f"""
SELECT a.attempt, a.outcome FROM outbox_attempt a
WHERE a.message_id = :id AND {outcomes.is_confirmed_sql("a")}
  AND a.settled IS DISTINCT FROM '{outcomes.OPERATOR_FORCED}'
ORDER BY a.id LIMIT 1
"""
)
_RESOLVE_FAILED = text(
    """
UPDATE outbox_message
SET state = 'failed', last_error = :error, completed_at = now(),
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
)

_STATE_OF = text("SELECT state FROM outbox_message WHERE id = :id")
_NOTIFY = text("SELECT pg_notify(:channel, '')")


@dataclass(frozen=True)
class ActionResult:
    id: int
    done: bool
    message: str
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "done": self.done, "message": self.message, "warnings": self.warnings}


#: An operator's reason is kept whole up to this length (a typed sentence, a pasted ticket).
OPERATOR_TEXT_CHARS = 2000


def default_actor() -> str:
    """Who is acting: $USER, else the login name."""
    with contextlib.suppress(Exception):
        return os.environ.get("USER") or getpass.getuser()
    return "unknown"


def _history_params(action: str, to_state: str, by: str, reason: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "action": action,
        "to_state": to_state,
        "by": by,
        # Operators paste what the customer or the provider said: stored like any error text.
        "reason": operator_text(reason),
        "extra": json.dumps(extra),
    }


def operator_text(reason: str | None) -> str | None:
    """An operator's --reason as stored (history, last_error): no card number, bounded."""
    return sanitize.clean_optional_text(reason, max_chars=OPERATOR_TEXT_CHARS)


def _refusal(connection: Connection, row_id: int, wanted: str, verb: str) -> OutboxError:
    # Read only to explain a refusal: the guarded UPDATE already decided.
    current = connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()
    if current is None:
        return NotFound(f"no outbox row with id {row_id}")
    return InvalidTransition(f"row {row_id} is {current}, only {wanted} rows can be {verb}")


def _state(connection: Connection, row_id: int) -> str | None:
    return connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()


def _notify(connection: Connection) -> None:
    """Wake the relays; delivered when the caller commits (the insert trigger does the same)."""
    connection.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL})


def _replayed(row: Any) -> ActionResult:
    warnings = []
    if row.past_deadline:
        warnings.append(
            "its deadline has passed: the consumer will fail it again without calling the provider"
        )
    return ActionResult(int(row.id), True, f"row {row.id} replayed: failed -> pending", warnings)


@dataclass(frozen=True)
class ReplayCandidate:
    """One row a replay was asked about, as the preview saw it."""

    id: int
    key: str
    step: str
    destination: str
    state: str
    #: When it failed: the version the acting statement requires (a row that failed again since
    #: the preview is a different failure, not the one the operator looked at).
    failed_at: datetime | None
    last_error: str | None
    past_deadline: bool
    #: Why the replay rules refuse it (empty: replayable).
    refusals: list[str]
    #: Ids of the fence rows behind the refusals: what a --force replay marks as forced over.
    blockers: list[int]

    @property
    def replayable(self) -> bool:
        return self.state == states.FAILED and not self.refusals

    def refusal(self) -> str:
        if self.state != states.FAILED:
            return f"row {self.id} is {self.state}, only failed rows can be replayed"
        return (
            f"row {self.id} refused: {'; '.join(self.refusals)}. Replaying it could charge twice; "
            f"if the provider confirms it cannot: outbox replay {self.id} --force --reason WHY"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "key": self.key,
            "step": self.step,
            "destination": self.destination,
            "state": self.state,
            "failed_at": self.failed_at,
            "last_error": self.last_error,
            "replayable": self.replayable,
            "refusals": self.refusals,
        }


@dataclass
class ReplayPlan:
    """What ``outbox replay`` will do: the rows it will replay, the rows it refuses and why.

    :func:`execute_replay` acts on exactly ``to_replay`` (by id and failure), never on a fresh
    query; ``fingerprint`` names that set so that a later run can check it acts on what was read.
    """

    destination: str | None
    force: bool
    rows: list[ReplayCandidate]
    #: Requested ids with no row.
    missing: list[int] = field(default_factory=list)

    @property
    def to_replay(self) -> list[ReplayCandidate]:
        if self.force:
            return [r for r in self.rows if r.state == states.FAILED]
        return [r for r in self.rows if r.replayable]

    @property
    def refused(self) -> list[ReplayCandidate]:
        chosen = {r.id for r in self.to_replay}
        return [r for r in self.rows if r.id not in chosen]

    @property
    def fingerprint(self) -> str:
        chosen = sorted(f"{r.id}@{r.failed_at.isoformat() if r.failed_at else '-'}" for r in self.to_replay)
        return hashlib.sha256(" ".join(chosen).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "force": self.force,
            "plan": self.fingerprint,
            "to_replay": [r.to_dict() for r in self.to_replay],
            "refused": [{**r.to_dict(), "reason": r.refusal()} for r in self.refused],
            "missing": self.missing,
        }

    def render(self) -> str:
        scope = f"destination {self.destination}" if self.destination else "the rows named"
        lines = [
            f"replay preview for {scope}: {len(self.to_replay)} row(s) to replay, "
            f"{len(self.refused) + len(self.missing)} refused"
        ]
        if self.to_replay:
            lines += ["", "will replay (failed -> pending, attempts reset):"]
            lines.append(
                _indent(
                    format_table(
                        ["id", "key", "step", "destination", "failed at", "last_error"],
                        [
                            [r.id, r.key, r.step, r.destination, _cell(r.failed_at), _short(r.last_error)]
                            for r in self.to_replay
                        ],
                    )
                )
            )
        if self.refused or self.missing:
            lines += ["", "refused (left untouched):"]
            lines += [f"  #{r.id} {r.key} {r.step}: {r.refusal()}" for r in self.refused]
            lines += [f"  #{i}: no outbox row with id {i}" for i in self.missing]
        lines += ["", f"plan {self.fingerprint}"]
        return "\n".join(lines)


def _candidate(row: Any) -> ReplayCandidate:
    return ReplayCandidate(
        id=int(row.id),
        key=row.key,
        step=row.step,
        destination=row.destination,
        state=row.state,
        failed_at=row.completed_at,
        last_error=row.last_error,
        past_deadline=bool(row.past_deadline),
        refusals=list(row.refusals),
        blockers=[int(b) for b in row.blockers],
    )


def plan_replay(
    connection: Connection,
    ids: Sequence[int] = (),
    *,
    destination: str | None = None,
    force: bool = False,
) -> ReplayPlan:
    """Preview a replay of ``ids``, or of every ``failed`` row of ``destination``; changes nothing.

    The replay rules (:mod:`outbox.outcomes`): a row whose fence rows hold a confirmed call, or an
    ambiguous one that no lookup's "not found" and no ``resolve --not-sent`` settled, or that an
    operator failed out of ``unknown``, is refused, unless ``force``, which names exactly one row.
    Raises :class:`NotFound` for a destination no row names (a typo must not read as "nothing to
    replay") and :class:`ConfigError` for a force that is not about one row by id.
    """
    if bool(ids) == bool(destination):
        raise ConfigError("replay takes row ids or --destination D, not both and not neither")
    if force and (destination or len(set(ids)) != 1):
        raise ConfigError(
            "--force replays one row named by its id, never in bulk (not with --destination, not "
            "with several ids): look at each such row with outbox show ID first"
        )
    params = {"failed_out_of_unknown": _FAILED_OUT_OF_UNKNOWN}
    if destination:
        _require_destination(connection, destination)
        found = connection.execute(_PLAN_DESTINATION, {**params, "destination": destination}).all()
        return ReplayPlan(destination, force, [_candidate(r) for r in found])
    wanted = list(dict.fromkeys(ids))  # a repeated id is one request
    found = connection.execute(_PLAN_IDS, {**params, "ids": wanted}).all()
    by_id = {int(r.id): _candidate(r) for r in found}
    return ReplayPlan(
        None, force, [by_id[i] for i in wanted if i in by_id], [i for i in wanted if i not in by_id]
    )


def execute_replay(
    connection: Connection, plan: ReplayPlan, *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """Replay exactly the rows of ``plan.to_replay``: each is one guarded move that re-checks the
    rules and the failure the preview saw, so a row that changed since is left alone and said so.
    A forced replay needs a ``reason`` and is recorded as such (``forced``, what it overrode) in
    the row's history, and its fence rows are marked ``operator_forced``."""
    actor = by or default_actor()
    results: dict[int, ActionResult] = {r.id: ActionResult(r.id, False, r.refusal()) for r in plan.refused}
    results.update({i: ActionResult(i, False, f"no outbox row with id {i}") for i in plan.missing})
    chosen = plan.to_replay
    moved: dict[int, Any] = {}
    if plan.force and chosen:
        if not (reason and reason.strip()):
            raise ConfigError("--force needs --reason: why replaying this row cannot charge twice")
        [row] = chosen
        params = _history_params("replay", states.PENDING, actor, reason, forced=True, overrode=row.refusals)
        seen = connection.execute(
            _REPLAY_FORCED, {**params, "id": row.id, "version": row.failed_at, "seen": row.blockers}
        ).first()
        if seen is not None:
            moved[int(seen.id)] = seen
    elif chosen:
        params = _history_params("replay", states.PENDING, actor, reason)
        for done in connection.execute(
            _REPLAY_PLANNED,
            {**params, "ids": [c.id for c in chosen], "versions": [c.failed_at for c in chosen]},
        ):
            moved[int(done.id)] = done
    for c in chosen:
        results[c.id] = _replayed(moved[c.id]) if c.id in moved else _changed(connection, c, plan.force)
    if moved:
        _notify(connection)
    order = [r.id for r in plan.rows] + plan.missing
    return [results[i] for i in order]


def _changed(connection: Connection, planned: ReplayCandidate, force: bool) -> ActionResult:
    """Why a previewed row did not move: read only to explain, the guarded UPDATE decided."""
    params = {"failed_out_of_unknown": _FAILED_OUT_OF_UNKNOWN, "ids": [planned.id]}
    now = connection.execute(_PLAN_IDS, params).first()
    if now is None:
        return ActionResult(planned.id, False, f"no outbox row with id {planned.id}")
    current = _candidate(now)
    if current.state != states.FAILED:
        message = f"row {planned.id} is now {current.state}: it changed since the preview, left alone"
    elif current.failed_at != planned.failed_at:
        message = f"row {planned.id} failed again since the preview: left alone, preview it again"
    elif force:
        message = (
            f"row {planned.id} gained a reason to refuse since the preview "
            f"({'; '.join(current.refusals)}): left alone, look at it again"
        )
    else:
        message = current.refusal()
    return ActionResult(planned.id, False, message)


def replay(
    connection: Connection,
    ids: Sequence[int],
    *,
    by: str | None = None,
    reason: str | None = None,
    force: bool = False,
) -> list[ActionResult]:
    """``failed`` → ``pending`` for each id, attempts reset; other rows, and rows the replay
    rules refuse, are left untouched (see :func:`plan_replay`). ``force`` (one id, with a
    ``reason``) replays a row the rules refuse."""
    return execute_replay(connection, plan_replay(connection, ids, force=force), by=by, reason=reason)


def replay_destination(
    connection: Connection, destination: str, *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """Replay every ``failed`` row of ``destination`` the replay rules allow; the others are
    returned refused. Raises :class:`NotFound` for a destination no row names."""
    plan = plan_replay(connection, destination=destination)
    return execute_replay(connection, plan, by=by, reason=reason)


def resolve(
    connection: Connection,
    row_id: int,
    *,
    sent_ref: str | None = None,
    not_sent: bool = False,
    failed_reason: str | None = None,
    by: str | None = None,
    reason: str | None = None,
) -> ActionResult:
    """Settle an ``unknown`` row by hand, exactly one of: the provider has it (``sent_ref``), it
    certainly has not (``not_sent``: back to pending, attempts kept, its ambiguous fence rows
    marked settled, which is what lets a later replay through; refused when a fence row holds a
    call the provider confirmed), or give up (``failed_reason``: a later replay is refused unless
    forced). Raises :class:`InvalidTransition` (or :class:`NotFound`) and changes
    nothing when the row is not ``unknown``."""
    chosen = [sent_ref is not None, not_sent, failed_reason is not None]
    if sum(chosen) != 1:
        raise ConfigError("resolve needs exactly one of --sent REF, --not-sent, --failed REASON")
    actor = by or default_actor()
    if sent_ref is not None:
        if not sent_ref.strip():
            raise ConfigError("--sent needs the provider's reference, e.g. --sent ch_123")
        # Stored by the same rules as a reference the worker records (outbox.sanitize).
        sent_ref = sanitize.clean_ref(sent_ref)
        statement, to_state = _RESOLVE_SENT, states.SENT
        params = {
            **_history_params("resolve", to_state, actor, reason, provider_ref=sent_ref),
            "ref": sent_ref,
        }
    elif not_sent:
        statement, to_state = _RESOLVE_NOT_SENT, states.PENDING
        params = _history_params("resolve", to_state, actor, reason)
    else:
        assert failed_reason is not None
        if not failed_reason.strip():
            raise ConfigError("--failed needs a reason the next reader can act on")
        # Stored as last_error: the same rules as every stored error text (no card number).
        failed_reason = sanitize.clean_text(failed_reason, max_chars=2000)
        statement, to_state = _RESOLVE_FAILED, states.FAILED
        params = {
            **_history_params("resolve", to_state, actor, reason, error=failed_reason),
            "error": failed_reason,
        }
    if connection.execute(statement, {**params, "id": row_id}).first() is None:
        confirmed = (
            connection.execute(_CONFIRMED_ATTEMPT, {"id": row_id}).first()
            if statement is _RESOLVE_NOT_SENT and _state(connection, row_id) == states.UNKNOWN
            else None
        )
        if confirmed is not None:
            raise InvalidTransition(
                f"row {row_id}: attempt {confirmed.attempt} was confirmed by the provider (outcome "
                f"{confirmed.outcome}), so it is not 'not sent'; find its reference and use --sent REF"
            )
        raise _refusal(connection, row_id, "unknown", "resolved")
    if to_state == states.PENDING:
        _notify(connection)
    return ActionResult(row_id, True, f"row {row_id} resolved: unknown -> {to_state}")


# -- cancel ------------------------------------------------------------------------------------------

# The operator's guard is wider than outbox.cancel's (outbox/write.py: only a row no consumer
# ever claimed): a pending or dispatched row whose every call is known not to have taken effect
# (a safe outcome, or an ambiguous call settled). Without it a row re-pending after a failover,
# or one of a retired destination with an earlier 503, could be stopped by nothing and would be
# called again. A call that may have taken effect still refuses: cancelling would hide a charge.
_CANCELLABLE = f"""state IN ('pending', 'dispatched')
    AND NOT EXISTS (SELECT 1 FROM outbox_attempt a WHERE a.message_id = outbox_message.id
                    AND NOT {outcomes.known_not_taken_effect_sql("a")})"""

_CANCEL_CANDIDATES = text(
    f"""
SELECT id, key, step, state, ({_CANCELLABLE}) AS cancellable
FROM outbox_message
WHERE destination = :destination AND state IN ('pending', 'dispatched', 'in_flight', 'unknown')
  AND (CAST(:max_id AS bigint) IS NULL OR id <= CAST(:max_id AS bigint))
ORDER BY id
"""
)

_CANCEL_ROWS = text(
    """
UPDATE outbox_message
SET state = 'cancelled', completed_at = now(), claim_token = NULL, last_error = :error,
"""
    + _HISTORY_ENTRY
    + f" WHERE id = ANY(:ids) AND {_CANCELLABLE} RETURNING id"
)


@dataclass
class CancelPlan:
    """What ``outbox cancel`` did, or would do: rows cancelled (or to cancel) and rows refused."""

    destination: str | None
    applied: bool
    #: (id, key, step, state before) of each row cancelled, or to be cancelled when not applied.
    rows: list[tuple[int, str, str, str]]
    #: (id, why) of each row that cannot be cancelled.
    refused: list[tuple[int, str]]
    #: The highest id previewed: ``--yes --max-id`` acts on no row written after the preview.
    max_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "applied": self.applied,
            "cancelled" if self.applied else "to_cancel": [
                {"id": i, "key": k, "step": st, "state": state} for i, k, st, state in self.rows
            ],
            "refused": [{"id": i, "why": why} for i, why in self.refused],
            "max_id": self.max_id,
        }


def _why_not_cancellable(state: str | None, row_id: int) -> str:
    if state is None:
        return f"no outbox row with id {row_id}"
    if state in ("pending", "dispatched"):
        return (
            f"row {row_id} is {state} but a call for it may have taken effect (a fence row is "
            "confirmed, or ambiguous and not settled): see outbox show "
            f"{row_id}, and ask the provider"
        )
    return f"row {row_id} is {state}: only pending or dispatched rows can be cancelled"


def cancel_rows(
    connection: Connection,
    ids: Sequence[int] = (),
    *,
    destination: str | None = None,
    reason: str,
    by: str | None = None,
    apply: bool = True,
    max_id: int | None = None,
) -> CancelPlan:
    """Cancel ``pending`` or ``dispatched`` rows none of whose calls may have taken effect (never
    claimed, or every fence row safe or settled; wider than :func:`outbox.cancel`, which only
    takes never-claimed rows), by id or every such row of ``destination`` (with ids no higher
    than ``max_id`` when given). With
    ``apply=False`` nothing changes: the plan says what would be cancelled and what is refused.
    Each row moves in one guarded UPDATE; a row whose call may have taken effect since the
    preview is refused."""
    if not reason or not reason.strip():
        raise ConfigError("cancel needs --reason: why these rows will never be sent")
    if bool(ids) == (destination is not None):
        raise ConfigError("cancel takes row ids or --destination D, not both and not neither")
    rows: list[tuple[int, str, str, str]] = []
    refused: list[tuple[int, str]] = []
    if destination is not None:
        _require_destination(connection, destination)
        for r in connection.execute(_CANCEL_CANDIDATES, {"destination": destination, "max_id": max_id}):
            if r.cancellable:
                rows.append((int(r.id), r.key, r.step, r.state))
            else:
                refused.append((int(r.id), _why_not_cancellable(r.state, int(r.id))))
        wanted = [r[0] for r in rows]
    else:
        wanted = list(dict.fromkeys(ids))
        if not apply:
            raise ConfigError("a preview is for --destination; rows named by id are cancelled directly")
        # Read only to report what each row was; the guarded UPDATE below decides.
        found = connection.execute(
            text("SELECT id, key, step, state FROM outbox_message WHERE id = ANY(:ids)"), {"ids": wanted}
        )
        rows = [(int(r.id), r.key, r.step, r.state) for r in found]
    top = max([r[0] for r in rows] + [i for i, _ in refused], default=max_id) if destination else None
    if not apply:
        return CancelPlan(destination, False, rows, refused, top)
    params = {
        **_history_params("cancel", states.CANCELLED, by or default_actor(), reason),
        "error": operator_text(f"cancelled by an operator: {reason}"),
        "ids": wanted,
    }
    done = {int(r[0]) for r in connection.execute(_CANCEL_ROWS, params)}
    details = {r[0]: r for r in rows}
    cancelled: list[tuple[int, str, str, str]] = []
    for row_id in wanted:
        if row_id in done:
            cancelled.append(details[row_id])
        else:
            state = connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()
            refused.append((row_id, _why_not_cancellable(state, row_id)))
    return CancelPlan(destination, True, cancelled, sorted(refused), top)


# -- formatting helpers ------------------------------------------------------------------------------


def _seconds(value: Decimal | float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _short(value: str | None, width: int = 80) -> str | None:
    if value is None:
        return None
    flat = " ".join(value.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _cell(value: Any, *, long: bool = False) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=_json_default)
    if isinstance(value, str) and not long:
        return _short(value)
    return value


def _indent(block: str) -> str:
    return textwrap.indent(block, "  ")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _out(text: str) -> None:
    """Print to stdout; a reader that went away (``outbox failed | head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _print_json(data: Any) -> None:
    _out(json.dumps(data, indent=2, ensure_ascii=False, default=_json_default))


# -- the commands ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _connection(cfg: settings.Settings, *, write: bool = False) -> Iterator[Connection]:
    """A connection in one transaction: read-only with one snapshot for looking, committed on
    success for acting."""
    from .db import make_engine

    engine = make_engine(cfg.require_database_url(), connect_args={"application_name": "outbox ops"})
    try:
        if write:
            with engine.begin() as conn:
                yield conn
        else:
            options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            with engine.connect().execution_options(**options) as conn, conn.begin():
                yield conn
    finally:
        engine.dispose()


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url", help="PostgreSQL URL, postgresql://… (default: $OUTBOX_DATABASE_URL)"
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _describe(parser: argparse.ArgumentParser, description: str) -> None:
    # cli.build_parser uses the one-line help as the description; the long one replaces it here.
    parser.description = textwrap.dedent(description).strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _by_and_reason(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", help="why, recorded in the row's history (card numbers masked)")
    parser.add_argument("--by", help="who, recorded in the row's history (default: $USER or the login name)")


def _err(message: str) -> None:
    print(f"outbox: {message}", file=sys.stderr)


# status


def _status_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Counts of outbox rows by destination and state, the unknown and failed counts, the total,
        and the oldest pending age: how long the longest-waiting *due* pending row has been due
        (rows waiting out a retry backoff are not late). A growing oldest pending age means no
        relay is publishing. Then one line per destination with rows waiting (pending or
        dispatched) and no live worker serving its queue, from the workers' heartbeats:
        "no consumer for D since T, K rows waiting" (JSON: no_consumer). Read-only.
        """,
    )
    _add_database_url(p)
    _add_json(p)


def _status_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    with _connection(cfg) as conn:
        report = status(conn)
    if args.json:
        _print_json(report.to_dict())
    else:
        _out(report.render())
    return 0


# show


def _show_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        One outbox row, by id (outbox show 42) or by business key and step
        (outbox show order:42 charge): every column, every attempt (the fence rows: attempt,
        claim token, started/finished, outcome, HTTP status, error) and the operator history.
        The payload is replaced by its size and top-level keys, since it may hold personal data;
        pass --payload to print it. A key whose row was purged shows its key-ledger entry
        (final state, provider ref, attempts, ambiguous history, payload hash) until the ledger
        horizon. Exit 1 when there is no such row.
        """,
    )
    p.add_argument("target", metavar="ID|KEY", help="the row id, or its business key (then give STEP)")
    p.add_argument("step", nargs="?", metavar="STEP", help="the step, with KEY: outbox show order:42 charge")
    p.add_argument(
        "--payload", action="store_true", help="also print the payload (may contain personal data)"
    )
    _add_database_url(p)
    _add_json(p)


def _show_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.step is None:
        lookup: dict[str, Any] = {
            "row_id": _parse_id(args.target, "to look a row up by key, give its step too")
        }
    else:
        lookup = {"key": args.target, "step": args.step}
    with _connection(cfg) as conn:
        detail = show(conn, **lookup, payload=args.payload)
    if args.json:
        _print_json(detail.to_dict())
    else:
        _out(detail.render())
    return 0


def _parse_id(raw: str, hint: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{raw!r} is not a row id; {hint}") from None
    if not 1 <= value < 2**63:
        raise ConfigError(f"{raw!r} is not a row id; ids are positive 64-bit integers")
    return value


# failed / unknown


def _list_arguments(state: str, description: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        _describe(p, description)
        p.add_argument("--destination", help="only rows of this destination (exit 1 if no row names it)")
        p.add_argument(
            "--limit",
            type=int,
            default=DEFAULT_LIST_LIMIT,
            help=f"at most N rows (default {DEFAULT_LIST_LIMIT})",
        )
        _add_database_url(p)
        _add_json(p)
        p.set_defaults(list_state=state)

    return add


def _list_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    with _connection(cfg) as conn:
        listed = list_rows(conn, args.list_state, destination=args.destination, limit=args.limit)
    if args.json:
        _print_json(listed.to_dict())
    else:
        _out(listed.render())
    return 0


# replay


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Give failed rows another chance: failed -> pending, attempts reset to 0, due now. Only
        failed rows move (each row is one guarded UPDATE … WHERE state = 'failed'); any other row
        is refused untouched, so a sent row can never be replayed. The replayed row goes through
        the normal claim, like a new one. The claim token and provider reference of the earlier
        attempts are kept, and who/when/why is appended to the row's history. The relay is woken
        with NOTIFY.

        Replay rules: a failed row is also refused, with the reason, when a call for it may have
        taken effect, i.e. one of its attempts (fence rows) ended
          - confirmed by the provider (sent, superseded:sent), or
          - ambiguous (unknown, lease_expired, superseded:unknown, no outcome recorded, any
            outcome other than retry/failed/released) and was not settled since, by the
            reconciler's lookup finding no record (within the destination's key_ttl) or by
            `outbox resolve ID --not-sent`;
        or when an operator failed it out of unknown (`outbox resolve ID --failed`). Such a row
        is replayed only by naming it alone with --force and --reason (never in bulk), after you
        checked with the provider that a new call cannot charge twice; the force and what it
        overrode are recorded in the row's history.

        Bulk replays (--destination, or several ids) print a preview first: what will be
        replayed, what is refused and why, a plan fingerprint, and the exact command to act.
        Nothing changes without --yes, and --yes needs --plan PLAN, the fingerprint of the
        preview you reviewed: it acts only if a fresh preview still matches it (otherwise
        nothing changes, exit 1), then on those rows and only them, each only if it is still
        the same failure and the rules still allow it.

        outbox replay 42 --reason "card updated"                  replay one row
        outbox replay 41 42 43                                    preview these rows
        outbox replay --destination payments.charge               preview a destination
        outbox replay --destination payments.charge --yes --plan 3f2a9c0d1e4b
        outbox replay 42 --force --reason "provider: no charge for order:42 (ticket 981)"

        Exit 0 after a preview without --yes (nothing changed) and when everything asked for was
        replayed; 1 if any row was refused, changed since the preview, or does not exist (the
        others are replayed), or if --plan no longer matches (nothing changed); 2 for a bulk
        --yes without --plan (nothing changed).
        """,
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="row ids to replay")
    p.add_argument("--destination", help="replay every failed row of this destination instead (previewed)")
    p.add_argument(
        "--yes", action="store_true", help="act on the previewed rows (bulk replays; needs --plan)"
    )
    p.add_argument(
        "--plan",
        metavar="PLAN",
        help="with --yes, required in bulk: act only if the preview's plan fingerprint is still PLAN",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replay one row the replay rules refuse (one ID, with --reason; never in bulk)",
    )
    _by_and_reason(p)
    _add_database_url(p)
    _add_json(p)


def _replay_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if bool(args.ids) == bool(args.destination):
        raise ConfigError("replay takes row ids or --destination D, not both and not neither")
    ids = [_parse_id(raw, "replay takes row ids") for raw in args.ids]
    if args.force and (args.destination or len(set(ids)) != 1):
        raise ConfigError("--force replays one row named by its id, never in bulk (not with --destination)")
    if args.force and not (args.reason and args.reason.strip()):
        raise ConfigError("--force needs --reason: why replaying this row cannot charge twice")
    if args.plan and not args.yes:
        raise ConfigError("--plan checks the preview before acting: give it with --yes")
    bulk = bool(args.destination) or len(set(ids)) > 1
    # A bulk --yes acts on what the operator reviewed, never on a fresh query nobody saw: the
    # preview's fingerprint names that set (like cancel --destination's --max-id).
    if bulk and args.yes and not args.plan:
        raise ConfigError(
            "--yes needs the preview's --plan PLAN: run the command without --yes first, review "
            "what it will replay, then run the command it prints"
        )
    act = args.yes or not bulk
    with _connection(cfg, write=act) as conn:
        plan = plan_replay(conn, ids, destination=args.destination, force=args.force)
        stale = bool(args.plan) and args.plan != plan.fingerprint
        results = [] if not act or stale else execute_replay(conn, plan, by=args.by, reason=args.reason)
    refused = [r for r in results if not r.done]
    replayed = len(results) - len(refused)
    named = ["--destination", args.destination] if args.destination else [str(i) for i in ids]
    again = " ".join(["outbox replay", *named])
    if args.json:
        _print_json(
            {
                "destination": args.destination,
                "preview": plan.to_dict() if bulk else None,
                "acted": act and not stale,
                "replayed": replayed,
                "refused": len(refused),
                "results": [r.to_dict() for r in results],
            }
        )
    else:
        if bulk:
            _out(plan.render())
        if not act:
            _out(
                f"\nnothing changed: this is a preview. To replay exactly these "
                f"{len(plan.to_replay)} row(s): {again} --yes --plan {plan.fingerprint}"
            )
        elif stale:
            _err(
                f"nothing changed: the rows changed since your preview (plan {args.plan}, now "
                f"{plan.fingerprint}); review the preview above and run again"
            )
        else:
            if bulk:
                _out("")
            for r in results:
                if r.done:
                    _out(r.message + "".join(f" (warning: {w})" for w in r.warnings))
                else:
                    _err(r.message)
            if args.destination:
                _out(f"replayed {replayed} failed row(s) of {args.destination}")
    return 1 if refused or stale else 0


# resolve


def _resolve_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Settle an unknown row by hand once you have asked the provider (the reconciler does this
        itself when the destination has a lookup). Exactly one of:

          --sent REF       the provider has it: sent, with its reference REF
          --not-sent       the provider certainly has no record of it: back to pending, retried
                           now (attempts kept); the relay is woken with NOTIFY
          --failed REASON  give up: failed, with REASON as last_error (outbox replay can retry it)

        Only an unknown row moves (one guarded UPDATE … WHERE state = 'unknown'); any other row
        is refused untouched with exit 1. Who/when/why is appended to the row's history.
        """,
    )
    p.add_argument("id", metavar="ID", help="the row id")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--sent", metavar="REF", help="the provider's reference of the effect")
    how.add_argument("--not-sent", action="store_true", help="the call did not take effect: retry it")
    how.add_argument("--failed", metavar="REASON", help="give up with this reason")
    _by_and_reason(p)
    _add_database_url(p)
    _add_json(p)


def _resolve_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    row_id = _parse_id(args.id, "resolve takes one row id")
    with _connection(cfg, write=True) as conn:
        result = resolve(
            conn,
            row_id,
            sent_ref=args.sent,
            not_sent=args.not_sent,
            failed_reason=args.failed,
            by=args.by,
            reason=args.reason,
        )
    if args.json:
        _print_json(result.to_dict())
    else:
        _out(result.message)
    return 0


# cancel


def _cancel_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Cancel rows that will never be sent, e.g. those of a destination no worker serves (a typo:
        `outbox status` and `outbox doctor` say "no consumer for D since T, K rows waiting"), or
        a row the provider already has after a failover lost its claim (see the runbook, "After
        a failover"). Only pending or dispatched rows move, and only when none of their calls
        may have taken effect: never claimed, or every attempt (fence row) ended safe (retry,
        failed, released) or was settled (a lookup's "not found", resolve --not-sent). A row
        with a call the provider confirmed, or an ambiguous call nobody settled (unknown,
        lease_expired, no outcome; one only forced over with replay --force) is refused: it may
        have been charged. This is wider than the application's outbox.cancel(), which only
        takes rows never claimed. Each row is one guarded UPDATE that re-checks this; the reason
        and who did it are appended to its history, and the reason is its last_error.

        outbox cancel 41 42 --reason "duplicate order"          cancel these rows now
        outbox cancel --destination paymnets.charge --reason "typo in the release of 2 May"
                                                                  preview: what would be
                                                                  cancelled, what is refused
        outbox cancel --destination paymnets.charge --reason "…" --yes --max-id 1234
                                                                  act on the previewed rows (no
                                                                  row written after the preview)

        The messages of cancelled rows stay in Redis until a worker of that queue runs them (an
        empty run); for a typo destination, delete its keys (namespace:D and namespace:D.msgs).
        Exit 1 if any requested row was refused or does not exist (the others are cancelled).
        """,
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="row ids to cancel")
    p.add_argument(
        "--destination", help="every cancellable row of this destination instead (preview, then --yes)"
    )
    p.add_argument("--yes", action="store_true", help="with --destination: cancel, not only preview")
    p.add_argument(
        "--max-id",
        type=int,
        metavar="N",
        help="with --destination: only rows with an id up to N (the preview prints it)",
    )
    _by_and_reason(p)
    _add_database_url(p)
    _add_json(p)


def _cancel_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    ids = [_parse_id(raw, "cancel takes row ids") for raw in args.ids]
    if (args.yes or args.max_id is not None) and not args.destination:
        raise ConfigError("--yes and --max-id go with --destination; rows named by id are cancelled directly")
    preview = bool(args.destination) and not args.yes
    with _connection(cfg, write=not preview) as conn:
        plan = cancel_rows(
            conn,
            ids,
            destination=args.destination,
            reason=args.reason or "",
            by=args.by,
            apply=not preview,
            max_id=args.max_id,
        )
    if args.json:
        _print_json(plan.to_dict())
    else:
        verb = "cancelled" if plan.applied else "would cancel"
        _out(f"{verb} {len(plan.rows)} row(s){f' of {plan.destination}' if plan.destination else ''}")
        for row_id, key, step, state in plan.rows[:20]:
            _out(f"  {row_id}  {key} {step}  ({state})")
        if len(plan.rows) > 20:
            _out(f"  … and {len(plan.rows) - 20} more")
        for _row_id, why in plan.refused:
            (_out if preview else _err)(f"refused: {why}")
        if preview and plan.rows:
            _out(
                f"to cancel them: outbox cancel --destination {plan.destination} --reason "
                f"{shlex.quote(args.reason)} --yes --max-id {plan.max_id}"
            )
    return 1 if plan.applied and plan.refused else 0


# doctor


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Check every invariant of the contract against the live database and Redis, one line per
        check (ok / FAIL with what to do / skip when an earlier failure prevents it):

          database      reachable
          schema        at the migration head (else: run `outbox migrate`)
          redis         reachable
          eviction      maxmemory-policy is not allkeys-* when maxmemory is set
          namespace     set, and holding no cache or session keys
          handlers      MODULE imports and its declarations hold (time_limit < lease, backoff > 0,
                        total backoff < key_ttl)                                  [with MODULE]
          destinations  every destination with non-terminal or failed rows has a handler
                                                                                  [with MODULE]
          leases        no in_flight row past its lease by more than a minute (else the
                        reconciler is not running)
          dispatched    no dispatched row older than twice OUTBOX_REDISPATCH_AFTER
          relay         no pending row due for more than a minute (else the relay is not running)
          consumers     every destination with rows waiting (pending, dispatched) has a live worker
                        serving its queue, from the workers' heartbeats in the database; else
                        "no consumer for D since T, K rows waiting"
          clocks        each live process's clock against the database's (from its heartbeat);
                        WARN past OUTBOX_CLOCK_SKEW_WARN (default 2 s)
          purge         this role is superuser or a member of pg_read_all_stats (or pg_monitor);
                        a reconciler on a role without it skips the purge
          retention     no sent/cancelled row older than OUTBOX_RETENTION plus a day (else the
                        purge is not running, skipped for that privilege, or held back by a
                        transaction left open)

        Exit 0 only when every check is ok (or WARN), 1 otherwise.
        """,
    )
    p.add_argument(
        "module", nargs="?", metavar="MODULE", help="handler module to check too, e.g. myapp.handlers"
    )
    _add_database_url(p)
    p.add_argument("--redis-url", help="Redis URL, redis://… (default: $OUTBOX_REDIS_URL)")
    p.add_argument(
        "--namespace", help="prefix of the broker's Redis keys (default: $OUTBOX_NAMESPACE or outbox)"
    )
    _add_json(p)


def _doctor_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from .doctor import run_checks

    checks = run_checks(cfg, args.module)
    healthy = all(c.ok for c in checks)
    if args.json:
        _print_json({"ok": healthy, "checks": [c.to_dict() for c in checks]})
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            _out(f"{c.status:<4}  {c.name.ljust(width)}  {c.detail}")
        failed = sum(1 for c in checks if c.status == "FAIL")
        _out("all checks passed" if healthy else f"{failed} check(s) failed")
    return 0 if healthy else 1


# audit


def _audit_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Prove there was no double call. Per destination: messages by state, attempts (fence
        rows, one per claim) against confirmed calls and sent rows, keys claimed more than once
        (retries, with examples), rows not yet terminal. Violations:

          - a sent row without the provider's reference
          - more than one attempt confirmed by the provider for one message
          - an attempt confirmed by the provider on a row that is not sent

        --since T limits the audit to messages written, claimed or settled since T, an ISO-8601
        timestamp (naive means UTC) or a duration back from now (30m, 24h, 7d). Read-only, one
        snapshot. Exit 0 when there is no violation (an empty database included), 1 otherwise.
        """,
    )
    p.add_argument(
        "--since", metavar="T", help="ISO-8601 timestamp or duration such as 24h or 7d (default: everything)"
    )
    _add_database_url(p)
    _add_json(p)


def _audit_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    since = parse_since(args.since) if args.since else None
    with _connection(cfg) as conn:
        report = audit(conn, since)
    if args.json:
        _print_json(report.to_dict())
    else:
        _out(report.render())
    return 0 if report.ok else 1


COMMANDS: list[
    tuple[
        str,
        str,
        Callable[[argparse.ArgumentParser], None],
        Callable[[argparse.Namespace, settings.Settings], int],
    ]
] = [
    ("status", "counts by destination and state, oldest pending age", _status_arguments, _status_run),
    ("show", "one row with its attempts and history: show ID, or show KEY STEP", _show_arguments, _show_run),
    (
        "failed",
        "list failed rows (--destination, --limit)",
        _list_arguments(
            states.FAILED,
            """
            List failed rows, longest failed first: id, key, step, destination, attempts, age (time
            since it failed) and last error. Fix the cause, then `outbox replay`. Read-only.
            """,
        ),
        _list_run,
    ),
    (
        "unknown",
        "list unknown rows (--destination, --limit)",
        _list_arguments(
            states.UNKNOWN,
            """
            List unknown rows (the call may or may not have taken effect), longest unknown first:
            id, key, step, destination, attempts, age (time since it became unknown) and last
            error. Ask the provider, then `outbox resolve`. Read-only.
            """,
        ),
        _list_run,
    ),
    ("replay", "failed -> pending again: replay ID… or --destination D", _replay_arguments, _replay_run),
    (
        "resolve",
        "settle an unknown row: resolve ID --sent REF | --not-sent | --failed REASON",
        _resolve_arguments,
        _resolve_run,
    ),
    (
        "cancel",
        "cancel rows no call may have charged: cancel ID… or --destination D (preview, then --yes)",
        _cancel_arguments,
        _cancel_run,
    ),
    (
        "doctor",
        "check the contract's invariants against the database and Redis",
        _doctor_arguments,
        _doctor_run,
    ),
    (
        "audit",
        "attempts vs confirmed sends per destination; exit 1 on a violation",
        _audit_arguments,
        _audit_run,
    ),
]
