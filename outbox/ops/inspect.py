"""Looking at the outbox: ``status``, ``show`` (a row, or a purged key's ledger entry) and the
lists of rows by state, destination and key prefix (``failed`` and ``unknown`` among them).
Read-only queries returning data; the caller owns the (read-only) transaction, and
``outbox.cli.render`` turns the data into text or JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from .. import breaker, chains, heartbeat, limits, pauses, settings, states
from ..breaker import OpenBreaker
from ..exceptions import ConfigError, NotFound
from ..heartbeat import NoConsumer
from ..limits import Limit
from ..ordering import HOLDING_SQL
from ..pauses import Pause
from ..store import counts as store_counts
from ..store.sql import LIMITED_SQL
from .values import seconds

DEFAULT_LIST_LIMIT = settings.DEFAULT_LIST_LIMIT

# -- status ------------------------------------------------------------------------------------------


@dataclass
class StatusReport:
    generated_at: datetime
    #: destination → state → count (every state present, zeros included).
    counts: dict[str, dict[str, int]]
    #: destination → seconds the oldest due `pending` row has waited (None: none due).
    oldest_pending_age: dict[str, float | None]
    #: Destinations with rows waiting and no live worker heartbeat serving their queue.
    no_consumer: list[NoConsumer] = field(default_factory=list)
    #: Destinations an operator paused (outbox pause), paused now.
    paused: list[Pause] = field(default_factory=list)
    #: Destinations whose circuit breaker is open or half-open now (outbox.breaker).
    breakers: list[OpenBreaker] = field(default_factory=list)
    #: Ordering keys held back by their head (outbox.ops.ordering), and for how long the longest.
    blocked_keys: int = 0
    oldest_block_seconds: float | None = None
    #: Destinations with an in-flight limit that holds (outbox limit, or declared by handlers).
    limits: list[Limit] = field(default_factory=list)

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
            "paused": [p.to_dict() for p in self.paused],
            "breakers": [b.to_dict() for b in self.breakers],
            "blocked_ordering_keys": self.blocked_keys,
            "oldest_block_seconds": self.oldest_block_seconds,
            "limits": [lim.to_dict() for lim in self.limits],
        }


def status(connection: Connection) -> StatusReport:
    """Counts by destination and state, the age of the oldest due pending row, and the
    destinations no live worker consumes (from the heartbeats in the database)."""
    generated_at = connection.execute(text("SELECT now()")).scalar_one()
    # Exact: `outbox status` is what an operator trusts to the row. The oldest pending age is
    # measured from when the row became due, not from when it was written: a row waiting out its
    # retry backoff is not late, a due row nobody publishes is (stalled relay).
    rows = store_counts.rows_by_destination(connection, ages=(states.PENDING,))
    counts = rows.by_destination
    ages = {d: seconds(rows.age(d, states.PENDING)) for d in counts}
    gaps = heartbeat.no_consumer(connection.execute(text(heartbeat.NO_CONSUMER_SQL)))
    from .ordering import blocked_summary

    blocked, oldest_block = blocked_summary(connection)
    return StatusReport(
        generated_at,
        counts,
        ages,
        gaps,
        pauses.paused(connection),
        breaker.open_breakers(connection),
        blocked,
        oldest_block,
        limits.limits(connection),
    )


# -- show --------------------------------------------------------------------------------------------

# Every column but the payload, whose size and top-level keys stand in for it: what is in it may
# be personal data, and an operator rarely needs more than its shape.
# With an ordering key: the earlier row of that key that holds this one back (outbox.ordering).
# A row waiting for its claim: its destination's limits, should it have any (outbox.limits; the
# declared ones as the heartbeats' hints have them).
_ROW_COLUMNS = f"""
    id, key, step, destination, state, attempts, available_at, deadline, created_at,
    dispatched_at, claimed_at, lease_expires_at, completed_at, unknown_since, alerted_at,
    claim_token, provider_ref, response, last_error, history, releases, payload_version,
    ordering_key,
    CASE priority WHEN 1 THEN 'high' WHEN -1 THEN 'low' ELSE 'normal' END AS priority,
    fairness_key,
    (SELECT format('row %s (%s:%s, %s)', e.id, e.key, e.step, e.state) FROM outbox_message e
     WHERE e.ordering_key = outbox_message.ordering_key AND e.id < outbox_message.id
       AND e.state NOT IN ('sent', 'cancelled') AND {HOLDING_SQL}
     ORDER BY e.id LIMIT 1) AS held_back_by,
    order_skipped_at,
    (SELECT concat_ws(', ',
                'at most ' || COALESCE(d.limit_in_flight, d.declared_in_flight) || ' calls in flight',
                'at most ' || COALESCE(d.limit_per_second, d.declared_per_second) || ' calls/s')
     FROM outbox_destination d
     WHERE d.destination = outbox_message.destination AND outbox_message.state IN ('pending', 'dispatched')
       AND {LIMITED_SQL}) AS limited_by,
    octet_length(payload::text) AS payload_bytes,
    CASE WHEN jsonb_typeof(payload) = 'object'
         THEN ARRAY(SELECT jsonb_object_keys(payload) ORDER BY 1) END AS payload_keys
"""
_SHOW_BY_ID = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE id = :id")
_SHOW_BY_KEY = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE key = :key AND step = :step")
# As text, decoded here: json.loads refuses an integer of more than 4,300 digits, which jsonb
# holds (a row written by plain SQL), and such a row must still be shown.
_PAYLOAD = text("SELECT payload::text FROM outbox_message WHERE id = :id")
#: Digits of an integer decoded as a number; longer ones are shown as a placeholder.
_MAX_INT_DIGITS = 4000


def _int_or_placeholder(digits: str) -> int | str:
    return int(digits) if len(digits) <= _MAX_INT_DIGITS else f"<integer of {len(digits)} digits>"


def _load_payload(raw: str) -> Any:
    return json.loads(raw, parse_int=_int_or_placeholder)


# Claim order: a replay resets `attempts`, so the attempt rows of two runs both say "attempt 1";
# `number` counts every claim of the row, the way an operator tells them apart.
_ATTEMPTS = text(
    """
SELECT row_number() OVER (ORDER BY started_at, id) AS number, attempt, claim_token, started_at,
       finished_at, outcome, http_status, error
FROM outbox_attempt WHERE message_id = :id ORDER BY started_at, id
"""
)


def _at(entry: dict[str, Any]) -> datetime | None:
    try:
        return datetime.fromisoformat(str(entry["at"]))
    except (KeyError, TypeError, ValueError):
        return None


def _place_history(attempts: list[dict[str, Any]], history: list[dict[str, Any]]) -> None:
    """Give each attempt row its run (1 + the replays before it) and each history entry
    ``after_attempt``: the number of the last attempt row claimed before it (0: before any)."""
    for entry in history:
        at = _at(entry)
        # An entry at the very instant of a claim came first: the replay is what made it due.
        entry["after_attempt"] = sum(1 for a in attempts if at is not None and a["started_at"] < at)
    for a in attempts:
        a["run"] = 1 + sum(
            1 for h in history if h.get("action") == "replay" and h["after_attempt"] < a["number"]
        )


@dataclass
class RowDetail:
    row: dict[str, Any]
    #: The attempt rows in claim order: ``number`` counts every claim of the row (#1, #2, ...),
    #: ``attempt`` restarts at 1 after each replay, ``run`` counts the replays (1: the first run).
    attempts: list[dict[str, Any]]
    #: The operator's (and the lookup's) actions, each with ``after_attempt``: the ``number`` of
    #: the last attempt row claimed before it (0: before any claim).
    history: list[dict[str, Any]]
    #: Only when asked for (`--payload`).
    payload: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        row = dict(self.row)
        if self.payload is not None:
            row["payload"] = self.payload
        return {"row": row, "attempts": self.attempts, "history": self.history}


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


def show(
    connection: Connection,
    row_id: int | None = None,
    *,
    key: str | None = None,
    step: str | None = None,
    payload: bool = False,
) -> RowDetail | LedgerDetail:
    """One row by id (or by ``key`` and ``step``) with its attempt rows and history; by key, a
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
    _place_history(attempts, history)
    body = _load_payload(connection.execute(_PAYLOAD, {"id": row["id"]}).scalar_one()) if payload else None
    return RowDetail(row, attempts, history, body)


# -- show KEY: every step of a business key, with its milestones -----------------------------------

# Written, (last) published, first claimed, confirmed: from the rows' own timestamps and their
# attempt rows; a step whose row was purged comes from the key ledger (its final state and ref).
_KEY_STEPS = text(
    f"""
SELECT m.id, m.step, m.destination, m.state, m.attempts, m.created_at AS written,
       m.dispatched_at AS published,
       (SELECT min(a.started_at) FROM outbox_attempt a WHERE a.message_id = m.id) AS claimed,
       CASE WHEN m.state = 'sent' THEN m.completed_at END AS confirmed,
       m.provider_ref, m.last_error, false AS purged, m.via,
       COALESCE((SELECT p.step FROM outbox_message p WHERE p.id = m.parent_id),
                (SELECT p.step FROM outbox_key_ledger p WHERE p.message_id = m.parent_id)) AS after,
       m.chain_problem, {chains.caught_sql("m")} AS caught
FROM outbox_message m WHERE m.key = :key
UNION ALL
SELECT l.message_id, l.step, l.destination, l.state, l.attempts, NULL, NULL, NULL,
       CASE WHEN l.state = 'sent' THEN l.completed_at END, l.provider_ref, NULL, true, l.via,
       (SELECT p.step FROM outbox_key_ledger p WHERE p.message_id = l.parent_id), NULL,
       {chains.caught_sql("l")}
FROM outbox_key_ledger l
WHERE l.key = :key AND NOT EXISTS (SELECT 1 FROM outbox_message m WHERE m.key = l.key AND m.step = l.step)
ORDER BY 6 NULLS FIRST, 1
"""
)


@dataclass
class KeySteps:
    """``outbox show KEY``: every step of a business key in the order they were written (purged
    steps first, from the key ledger), with their milestones, and where the key's work stopped."""

    key: str
    steps: list[dict[str, Any]]

    @property
    def stopped_at(self) -> dict[str, Any] | None:
        """The step where the key's work stopped: the first not confirmed, or confirmed without
        its next steps (a ``sent`` step with a ``chain_problem``, outbox.chains); None: every
        step is `sent` or `cancelled` (or failed and compensated) and wrote what it declared."""
        # A failed step whose @on_failure compensation was written is handled: its chain goes on
        # with the compensation; so is a failed member of a batch that wrote its catch row (the
        # rule of `outbox chains --stalled`: chains.caught_sql).
        compensated = {s["after"] for s in self.steps if s.get("via") == chains.ON_FAILURE}
        for s in self.steps:
            if s["state"] == states.SENT and s.get("chain_problem"):
                return s
            if s["state"] == states.FAILED and (s["step"] in compensated or s.get("caught")):
                continue
            if s["state"] not in (states.SENT, states.CANCELLED):
                return s
        return None

    @property
    def stopped(self) -> dict[str, Any] | None:
        """Where and why the key's work stopped (:attr:`stopped_at`), as shown."""
        s = self.stopped_at
        if s is None:
            return None
        if s["state"] == states.SENT:
            return {
                "step": s["step"],
                "state": s["state"],
                "why": f"its next steps are not written: {s['chain_problem']}",
                "waiting": False,
            }
        waiting = s["state"] in states.WAITING
        return {
            "step": s["step"],
            "state": s["state"],
            "why": s["last_error"] or ("under way" if waiting else "no reason recorded"),
            "waiting": waiting,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "steps": self.steps, "stopped": self.stopped}


def key_steps(connection: Connection, key: str) -> KeySteps:
    """Every step of ``key`` with its milestones. Raises :class:`NotFound` when the key has none."""
    steps = [dict(r) for r in connection.execute(_KEY_STEPS, {"key": key}).mappings()]
    if not steps:
        raise NotFound(f"no outbox row with key {key!r} (nor in the key ledger)")
    return KeySteps(key, steps)


# -- lists: `list`, and its shortcuts `failed` and `unknown` --------------------------------------

# Age is the time spent in the state, the number an on-call compares with alert thresholds:
# since it became unknown, was claimed, dispatched, failed or was settled; a pending row's since
# it became due (negative: not yet due).
IN_STATE_SINCE = """
COALESCE(CASE state WHEN 'unknown' THEN unknown_since
                    WHEN 'in_flight' THEN claimed_at
                    WHEN 'dispatched' THEN dispatched_at
                    WHEN 'pending' THEN available_at
                    ELSE completed_at END, created_at)
"""
# The key prefix is a `LIKE 'p%'` with the prefix's own `%`, `_` and `\` escaped: a left-anchored
# pattern an index on key can serve (text_pattern_ops or the C collation).
_LIST = text(
    f"""
SELECT id, key, step, destination, state, attempts, created_at, last_error,
       EXTRACT(EPOCH FROM now() - {IN_STATE_SINCE}) AS age,
       count(*) OVER () AS matching
FROM outbox_message
WHERE state = ANY(CAST(:states AS text[]))
  AND (CAST(:destination AS text) IS NULL OR destination = CAST(:destination AS text))
  AND (CAST(:key_like AS text) IS NULL OR key LIKE CAST(:key_like AS text) ESCAPE '\\')
ORDER BY {IN_STATE_SINCE}, id
LIMIT :limit
"""
)
_DESTINATION_EXISTS = text("SELECT EXISTS (SELECT 1 FROM outbox_message WHERE destination = :d)")
_DESTINATIONS = text("SELECT DISTINCT destination FROM outbox_message ORDER BY 1")


def key_like(prefix: str) -> str:
    """The ``LIKE`` pattern matching keys that start with ``prefix``, taken literally."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@dataclass(frozen=True)
class ListedRow:
    id: int
    key: str
    step: str
    destination: str
    state: str
    attempts: int
    created_at: datetime
    #: Seconds in its state (see the list query); negative for a pending row not yet due.
    age_seconds: float | None
    last_error: str | None


@dataclass
class RowList:
    states: list[str]
    destination: str | None
    rows: list[ListedRow]
    #: How many rows match, beyond the limit.
    matching: int
    key_prefix: str | None = None

    @property
    def state(self) -> str | None:
        """The state listed, when there is one (``failed``, ``unknown``, ``list --state S``)."""
        return self.states[0] if len(self.states) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "states": self.states,
            "destination": self.destination,
            "key_prefix": self.key_prefix,
            "matching": self.matching,
            "rows": [vars(r) for r in self.rows],
        }


def require_destination(connection: Connection, destination: str) -> None:
    """A destination no row names is a typo, not an empty result; say which ones exist."""
    if connection.execute(_DESTINATION_EXISTS, {"d": destination}).scalar_one():
        return
    known = [r[0] for r in connection.execute(_DESTINATIONS)]
    raise NotFound(
        f"no outbox rows for destination {destination!r} (known: {', '.join(known) if known else 'none'})"
    )


def check_states(names: Iterable[str]) -> list[str]:
    """The states asked for, each once, in the order of the state table; a name that is not a
    state is a :class:`ConfigError` listing them."""
    wanted = list(names)
    unknown = [s for s in wanted if s not in states.ALL]
    if unknown:
        raise ConfigError(f"unknown state {unknown[0]!r}; states are {', '.join(states.ALL)}")
    return [s for s in states.ALL if s in wanted]


def list_rows(
    connection: Connection,
    state: str | Sequence[str] | None = None,
    *,
    destination: str | None = None,
    key_prefix: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
) -> RowList:
    """Rows in ``state`` (one state, several, or None: every state), of ``destination``, whose
    key starts with ``key_prefix``; longest in their state first. Raises :class:`ConfigError`
    for a name that is not a state, :class:`NotFound` for a destination no row names."""
    listed = check_states([state] if isinstance(state, str) else state or states.ALL)
    if limit < 1:
        raise ConfigError("--limit must be at least 1")
    if destination is not None:
        require_destination(connection, destination)
    params = {
        "states": listed,
        "destination": destination,
        "key_like": key_like(key_prefix) if key_prefix else None,
        "limit": limit,
    }
    rows, matching = [], 0
    for r in connection.execute(_LIST, params):
        matching = int(r.matching)
        rows.append(
            ListedRow(
                int(r.id),
                r.key,
                r.step,
                r.destination,
                r.state,
                int(r.attempts),
                r.created_at,
                seconds(r.age),
                r.last_error,
            )
        )
    return RowList(listed, destination, rows, matching, key_prefix or None)
