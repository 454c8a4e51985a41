"""A destination's limits, over every worker process on every machine, stored in
``outbox_destination``: how many of its calls may be under way at once (``outbox limit D
--in-flight N``, ``max_in_flight``) and how many may start a second (``--per-second R``,
``max_calls_per_second``).

The database enforces both at the claim (the trigger of migrations 0023 and 0024), so they hold
for processes added or killed while they run, and for workers of an older release (which ack a
refused message; its row waits ``dispatched`` for the reconciler's re-dispatch). A worker of this
release holds a refused delivery instead: it tries the claim again after a pause
(outbox.consumer.HOLD_RETRY_SECONDS, and never before a paced destination's next start can be
booked), its message not acked, no attempt and no fence row spent, and gives the message up to
the re-dispatch only after HOLD_MAX_SECONDS.

In flight: a call counts from its claim until its row leaves ``in_flight`` (recorded, or
released), and an ``unknown`` one (timed out, or its lease expired) until its first lookup is due
(``landing_until``): the call may still land at the provider until then.

Per second: each claim books its call's start in the destination's row, 1/rate after the last
one booked (``last_call_at``: a GCRA scheduler with no burst; a new rate spaces the very next
start), at most a second ahead, or less where the handler's start bound needs it (else the
claim is refused), and the worker starts the call no earlier than that (``call_at``, returned by
the claim). Starts are spaced 1/rate apart over every
process, a group claim's rows included, so no one-second window holds more than rate + 1 booked
starts, and nothing is held on anyone's behalf: a killed process's booked start passes unused.
Dramatiq's rate limiters count fixed wall-clock buckets per worker (a burst of twice the rate at
a bucket's edge) and hold a slot per holder that a killed holder leaks until its TTL; neither
happens here.

Who moves a limit: ``outbox limit`` (set, ``--clear``); the heartbeats of processes whose
handlers declare one; nothing else. Destinations without a limit pay one primary-key read of
their row per claim, no lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from . import sanitize, store
from .exceptions import ConfigError
from .settings import MAX_CALLS_PER_SECOND, MIN_CALLS_PER_SECOND

#: A limit's reason is kept whole up to this length.
REASON_CHARS = 2000
#: The largest limit accepted: far above any worker deployment's calls in flight.
MAX_IN_FLIGHT = 1_000_000


@dataclass(frozen=True)
class Limit:
    destination: str
    #: The operator's in-flight limit (``outbox limit``), or None.
    in_flight: int | None
    #: The lowest ``max_in_flight`` that live processes' handlers declare, or None.
    declared_in_flight: int | None
    #: The in-flight limit that holds: the operator's, else the declared one; None: none holds.
    holds: int | None
    #: The operator's calls a second, the lowest live declaration, and the one that holds.
    per_second: float | None
    declared_per_second: float | None
    holds_per_second: float | None
    reason: str | None
    set_by: str | None
    set_at: datetime | None
    #: Calls of the destination in flight now, and its rows waiting `dispatched` (published, not
    #: claimed yet) and since when the oldest of them was published.
    calls_in_flight: int
    waiting: int
    waiting_since: datetime | None = None
    #: Its due rows the relay keeps back until its dispatch window has room (outbox.windows), and
    #: since when the oldest of them is due.
    kept_back: int = 0
    kept_back_since: datetime | None = None

    def describe(self) -> str:
        by_operator = self.in_flight is not None or self.per_second is not None
        source = (
            f"set by {self.set_by or '?'} at {self.set_at:%Y-%m-%d %H:%M:%S %Z}: "
            f"{self.reason or 'no reason given'}"
            if by_operator and self.set_at is not None
            else "declared by its handler"
        )
        if (
            by_operator
            and self.set_at is not None
            and (
                (self.in_flight is None and self.holds is not None)
                or (self.per_second is None and self.holds_per_second is not None)
            )
        ):
            source += "; the other declared by its handler"
        parts = []
        if self.holds is not None:
            parts.append(f"at most {self.holds} calls in flight ({self.calls_in_flight} now)")
        if self.holds_per_second is not None:
            parts.append(f"at most {self.holds_per_second:g} calls/s")
        since = f" since {self.waiting_since:%H:%M:%S %Z}" if self.waiting and self.waiting_since else ""
        kept = (
            f", {self.kept_back} more kept back by the relay's window"
            f" since {self.kept_back_since:%H:%M:%S %Z}"
            if self.kept_back and self.kept_back_since
            else ""
        )
        return f"{self.destination}: {', '.join(parts)}, {self.waiting} rows waiting{since}{kept}, {source}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "in_flight": self.in_flight,
            "declared_in_flight": self.declared_in_flight,
            "holds": self.holds,
            "per_second": self.per_second,
            "declared_per_second": self.declared_per_second,
            "holds_per_second": self.holds_per_second,
            "reason": self.reason,
            "set_by": self.set_by,
            "set_at": self.set_at.isoformat() if self.set_at else None,
            "calls_in_flight": self.calls_in_flight,
            "waiting": self.waiting,
            "waiting_since": self.waiting_since.isoformat() if self.waiting_since else None,
            "kept_back": self.kept_back,
            "kept_back_since": self.kept_back_since.isoformat() if self.kept_back_since else None,
        }


def _limit(row: Any) -> Limit:
    return Limit(
        row.destination,
        row.limit_in_flight,
        row.declared_in_flight,
        int(row.holds) if row.holds is not None else None,
        row.limit_per_second,
        row.declared_per_second,
        float(row.holds_per_second) if row.holds_per_second is not None else None,
        row.limit_reason,
        row.limit_set_by,
        row.limit_set_at,
        int(row.in_flight),
        int(row.waiting),
        row.waiting_since,
        int(row.kept_back),
        row.kept_back_since,
    )


def limits(connection: Connection, destination: str | None = None) -> list[Limit]:
    """The destinations with a limit that holds, by name (or ``destination``'s only)."""
    return [_limit(r) for r in store.operator.limits(connection, destination)]


def check_in_flight(value: int) -> int:
    if not 1 <= value <= MAX_IN_FLIGHT:
        raise ConfigError(f"an in-flight limit must be between 1 and {MAX_IN_FLIGHT}, not {value}")
    return value


def check_per_second(value: float) -> float:
    # Written so that NaN fails too.
    if not MIN_CALLS_PER_SECOND <= value <= MAX_CALLS_PER_SECOND:
        raise ConfigError(
            f"a rate must be from {MIN_CALLS_PER_SECOND} to {MAX_CALLS_PER_SECOND} calls/s, not {value:g}"
        )
    return float(value)


def rebook_seconds(booked_ahead_seconds: float | None, pace_ahead_seconds: float) -> float:
    """After a paced destination refused a claim, with its starts booked ``booked_ahead_seconds``
    ahead: how long until a claim that books at most ``pace_ahead_seconds`` ahead could book one
    (0: not paced, or already)."""
    if booked_ahead_seconds is None:
        return 0.0
    return max(0.0, booked_ahead_seconds - pace_ahead_seconds)


def set_limit(
    connection: Connection,
    destination: str,
    *,
    in_flight: int | None = None,
    per_second: float | None = None,
    by: str,
    reason: str,
) -> Limit:
    """Limit ``destination`` to ``in_flight`` calls at once and/or ``per_second`` calls a second,
    from the next claim on (over any limit its handlers declare); a kind not given keeps the
    operator's value it had. The caller commits."""
    if in_flight is None and per_second is None:
        raise ConfigError("a limit needs --in-flight N, --per-second R or both")
    params = {
        "destination": destination,
        "in_flight": check_in_flight(in_flight) if in_flight is not None else None,
        "per_second": check_per_second(per_second) if per_second is not None else None,
        "by": by,
        "reason": sanitize.clean_optional_text(reason, max_chars=REASON_CHARS),
    }
    store.operator.set_limit(connection, params)
    return limits(connection, destination)[0]


def clear_limit(connection: Connection, destination: str, *, by: str) -> bool:
    """End the operator's limits of ``destination`` (both kinds: the limits its handlers declare
    hold again); False when it had none. The caller commits."""
    return store.operator.clear_limit(connection, destination, by=by)
