"""Looking at the outbox: ``status``, ``show`` (a row, or a purged key's ledger entry) and the
lists of failed and unknown rows. Read-only queries returning data; the caller owns the
(read-only) transaction, and ``outbox.ops.tables`` or the CLI turns the data into text or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from .. import heartbeat, states
from ..exceptions import ConfigError, NotFound
from ..heartbeat import NoConsumer
from . import tables
from .tables import seconds

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
        return tables.render_status(self)


def status(connection: Connection) -> StatusReport:
    """Counts by destination and state, the age of the oldest due pending row, and the
    destinations no live worker consumes (from the heartbeats in the database)."""
    generated_at = connection.execute(text("SELECT now()")).scalar_one()
    counts: dict[str, dict[str, int]] = {}
    ages: dict[str, float | None] = {}
    for row in connection.execute(_STATUS):
        counts.setdefault(row.destination, dict.fromkeys(states.ALL, 0))[row.state] = int(row.n)
        if row.state == states.PENDING:
            ages[row.destination] = seconds(row.oldest_pending_age)
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
        return tables.render_row(self)


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
        return tables.render_ledger(self)


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
        return tables.render_rows(self)


def require_destination(connection: Connection, destination: str) -> None:
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
        require_destination(connection, destination)
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
                seconds(r.age),
                r.last_error,
            )
        )
    return RowList(state, destination, rows, matching)
