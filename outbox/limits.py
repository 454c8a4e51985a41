"""In-flight limits: how many calls of a destination may be under way at once, over every worker
process on every machine (``outbox limit D --in-flight N``), stored in ``outbox_destination``.

The database enforces the limit at the claim (migration 0023's trigger): a claim of a limited
destination's row locks the destination's row, counts its rows ``in_flight`` and moves nothing
when they have reached the limit. So it holds for processes added or killed while it runs, and
for workers of an older release (which ack a refused message; its row waits ``dispatched`` for the
reconciler's re-dispatch). A worker of this release holds a refused delivery instead: it tries
the claim again after a pause (outbox.consumer.HOLD_RETRY_SECONDS), its message not acked, no
attempt and no fence row spent, and gives the message up to the re-dispatch only after
HOLD_MAX_SECONDS.

A call counts from its claim until its row leaves ``in_flight`` (recorded, or released), and an
``unknown`` one (timed out, or its lease expired) until its first lookup is due
(``landing_until``): the call may still land at the provider until then.

Who moves a limit: ``outbox limit`` (set, ``--clear``); nothing else. Destinations without a limit
pay one primary-key read of their row per claim, no lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from . import sanitize, store
from .exceptions import ConfigError

#: A limit's reason is kept whole up to this length.
REASON_CHARS = 2000
#: The largest limit accepted: far above any worker deployment's calls in flight.
MAX_IN_FLIGHT = 1_000_000


@dataclass(frozen=True)
class Limit:
    destination: str
    #: The operator's limit (``outbox limit``), or None.
    in_flight: int | None
    #: The lowest ``max_in_flight`` that live processes' handlers declare, or None.
    declared_in_flight: int | None
    #: The limit that holds: the operator's, else the declared one.
    holds: int
    reason: str | None
    set_by: str | None
    set_at: datetime | None
    #: Calls of the destination in flight now, and its rows waiting `dispatched`.
    calls_in_flight: int
    waiting: int

    def describe(self) -> str:
        source = (
            f"set by {self.set_by or '?'} at {self.set_at:%Y-%m-%d %H:%M:%S %Z}: "
            f"{self.reason or 'no reason given'}"
            if self.in_flight is not None and self.set_at is not None
            else "declared by its handler"
        )
        return (
            f"{self.destination}: at most {self.holds} calls in flight ({self.calls_in_flight} now, "
            f"{self.waiting} rows waiting), {source}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "in_flight": self.in_flight,
            "declared_in_flight": self.declared_in_flight,
            "holds": self.holds,
            "reason": self.reason,
            "set_by": self.set_by,
            "set_at": self.set_at.isoformat() if self.set_at else None,
            "calls_in_flight": self.calls_in_flight,
            "waiting": self.waiting,
        }


def _limit(row: Any) -> Limit:
    return Limit(
        row.destination,
        row.limit_in_flight,
        row.declared_in_flight,
        int(row.holds),
        row.limit_reason,
        row.limit_set_by,
        row.limit_set_at,
        int(row.in_flight),
        int(row.waiting),
    )


def limits(connection: Connection, destination: str | None = None) -> list[Limit]:
    """The destinations with a limit that holds, by name (or ``destination``'s only)."""
    return [_limit(r) for r in store.operator.limits(connection, destination)]


def check_in_flight(value: int) -> int:
    if not 1 <= value <= MAX_IN_FLIGHT:
        raise ConfigError(f"an in-flight limit must be between 1 and {MAX_IN_FLIGHT}, not {value}")
    return value


def set_limit(connection: Connection, destination: str, *, in_flight: int, by: str, reason: str) -> Limit:
    """Limit ``destination`` to ``in_flight`` calls at once, from the next claim on (over any
    limit its handlers declare). The caller commits."""
    params = {
        "destination": destination,
        "in_flight": check_in_flight(in_flight),
        "by": by,
        "reason": sanitize.clean_optional_text(reason, max_chars=REASON_CHARS),
    }
    store.operator.set_limit(connection, params)
    return limits(connection, destination)[0]


def clear_limit(connection: Connection, destination: str, *, by: str) -> bool:
    """End the operator's limit of ``destination`` (a limit its handlers declare holds again);
    False when it had none. The caller commits."""
    return store.operator.clear_limit(connection, destination, by=by)
