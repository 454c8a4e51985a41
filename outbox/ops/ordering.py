"""``outbox ordering``, and the blocked keys in ``outbox status`` and the metrics: the ordering
keys held back by their head (outbox.ordering), read-only.

A key is *blocked* when its head (the first row that holds it back) has rows waiting behind it
and is not simply next in line: it is ``in_flight`` or ``unknown`` (an effect that may have
happened), ``failed`` (not skipped), or waiting: for a retry (claimed before), for a newer worker
(released), for its due time, or for its destination (paused, breaker open). "Since" is when the
head got there: its failure, its going unknown, its claim, or else its last attempt's end (its
writing when never claimed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from ..ordering import BLOCKED_SQL, BLOCKED_SUMMARY_SQL
from .values import seconds

DEFAULT_BLOCKED_LIMIT = 50

_LIST = text(
    BLOCKED_SQL
    + """
SELECT *, EXTRACT(EPOCH FROM now() - since) AS age, count(*) OVER () AS matching
FROM blocked WHERE waiting > 0
ORDER BY since, ordering_key
LIMIT :limit
"""
)
_SUMMARY = text(BLOCKED_SUMMARY_SQL)


@dataclass(frozen=True)
class BlockedKey:
    ordering_key: str
    #: The head: the row holding the key back.
    id: int
    key: str
    step: str
    destination: str
    state: str
    since: datetime | None
    age_seconds: float | None
    #: Rows of the key waiting behind the head.
    waiting: int
    last_error: str | None
    #: A pending/dispatched head's wait: released claims, its due time, its destination held.
    releases: int = 0
    due_at: datetime | None = None
    destination_held: bool = False

    @property
    def reason(self) -> str:
        why = {
            "failed": "failed (outbox replay ID, or outbox skip ID --reason R)",
            "unknown": "unknown: its call may have taken effect (the lookup, or outbox resolve ID)",
            "in_flight": "in flight: a call under way, or a worker died (its lease expires)",
        }.get(self.state)
        if why is None:
            if self.destination_held:
                why = f"{self.state}: its destination {self.destination} is paused or its breaker open"
            elif self.releases:
                why = f"{self.state}: released {self.releases} time(s) without a call"
            elif self.due_at is not None:
                why = f"{self.state}: waiting until {self.due_at.isoformat(timespec='seconds')}"
            else:
                why = f"{self.state}: waiting for its retry"
        return why + (f"; {self.last_error}" if self.last_error and self.state != "in_flight" else "")

    def describe(self) -> str:
        since = self.since.isoformat(timespec="seconds") if self.since else "?"
        return f"blocked since {since} by row {self.id} ({self.key}:{self.step}): {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["since"] = self.since.isoformat() if self.since else None
        d["due_at"] = self.due_at.isoformat() if self.due_at else None
        d["reason"] = self.reason
        return d


@dataclass(frozen=True)
class BlockedReport:
    keys: list[BlockedKey]
    #: How many keys are blocked (more than listed when --limit cut the list).
    matching: int

    def to_dict(self) -> dict[str, Any]:
        return {"matching": self.matching, "keys": [k.to_dict() for k in self.keys]}


def blocked_keys(connection: Connection, *, limit: int = DEFAULT_BLOCKED_LIMIT) -> BlockedReport:
    """The blocked ordering keys, the longest blocked first."""
    keys: list[BlockedKey] = []
    matching = 0
    for r in connection.execute(_LIST, {"limit": limit}):
        matching = int(r.matching)
        keys.append(
            BlockedKey(
                r.ordering_key,
                int(r.id),
                r.key,
                r.step,
                r.destination,
                r.state,
                r.since,
                seconds(r.age),
                int(r.waiting),
                r.last_error,
                int(r.releases),
                r.available_at if r.not_due else None,
                bool(r.held),
            )
        )
    return BlockedReport(keys, matching)


def blocked_summary(connection: Connection) -> tuple[int, float | None]:
    """(blocked keys, seconds the longest has been blocked): for status and the metrics."""
    row = connection.execute(_SUMMARY).one()
    return int(row.keys), seconds(row.oldest)
