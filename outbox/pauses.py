"""Paused destinations: ``outbox pause D`` and ``outbox resume D``, stored in ``outbox_destination``.

While a destination is paused, no claim of its rows succeeds (the claim statement itself reads
the pause, so every worker obeys at its next claim, on the database's clock): a message of it
that a worker takes is acknowledged without a claim and its row waits ``dispatched``, its
attempts untouched; rows already ``in_flight`` finish. The reconciler does not re-queue a paused
destination's rows; once the pause ends (``resume``, or ``--until`` passed) its next run re-queues
them and the relay publishes them again. Nothing is failed, nothing is lost, no attempt is spent.

The reconciler's lookups of ``unknown`` rows go on while paused: they settle outcomes, and a
provider that is down only makes them wait for their next try.

``outbox resume`` also closes the destination's breaker if it is open (outbox.breaker): an
operator who says "go" means every guard; a provider still down trips it again.

Statements only: ``outbox pause``/``resume`` (``outbox.cli.pauses``), ``outbox status`` and
``doctor``, the worker (why its claim was empty; the Retry-After hold) call these. The claim's
guard reads the same row (``outbox.store.delivery``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Connection, text

from . import sanitize, store
from .exceptions import ConfigError

#: A pause's reason is kept whole up to this length.
REASON_CHARS = 2000

# Why a claim of the destination's rows was refused, if it was held back at all.
_HELD_REASON = """
SELECT CASE
    WHEN paused_until > now() THEN 'is paused'
    WHEN breaker_opened_at IS NOT NULL AND breaker_open_until > now()
        THEN 'has its breaker open (next probe in '
             || ceil(date_part('epoch', breaker_open_until - now()))::bigint || ' s)'
    WHEN breaker_opened_at IS NOT NULL THEN 'has its breaker half-open: another claim is the probe'
END
FROM outbox_destination WHERE destination = %(destination)s
"""

_PAUSED = text(
    """
    SELECT destination, NULLIF(paused_until, 'infinity') AS paused_until, paused_at, paused_by, pause_reason
    FROM outbox_destination
    WHERE paused_until > now()
    ORDER BY destination
    """
)


@dataclass(frozen=True)
class Pause:
    destination: str
    #: None: until resumed.
    until: datetime | None
    since: datetime
    by: str | None
    reason: str | None

    def describe(self) -> str:
        ends = f"until {self.until:%Y-%m-%d %H:%M:%S %Z}" if self.until else "until resumed"
        return (
            f"paused: {self.destination} since {self.since:%Y-%m-%d %H:%M:%S %Z} by {self.by or '?'}, "
            f"{ends}: {self.reason or 'no reason given'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "until": self.until.isoformat() if self.until else None,
            "since": self.since.isoformat(),
            "by": self.by,
            "reason": self.reason,
        }


def _pause(row: Any) -> Pause:
    # paused_until comes back NULL for an indefinite pause (infinity has no Python datetime).
    return Pause(
        row.destination,
        row.paused_until,
        row.paused_at,
        row.paused_by,
        row.pause_reason,
    )


def pause(
    connection: Connection,
    destination: str,
    *,
    by: str,
    reason: str,
    until: datetime | None = None,
    for_seconds: float | None = None,
) -> Pause:
    """Pause ``destination`` until ``until``, for ``for_seconds`` from the database's now, or
    (neither) until resumed; pausing a paused destination replaces its end and reason, not its
    start. The caller commits."""
    if until is not None:
        now = connection.execute(text("SELECT now()")).scalar_one()
        if until <= now:
            # A typo in a year would end an indefinite pause at once, silently.
            raise ConfigError(
                f"--until {until.isoformat()} is not in the future (database time {now.isoformat()})"
            )
    reason_text = sanitize.clean_optional_text(reason, max_chars=REASON_CHARS)
    params = {
        "destination": destination,
        "until": until,
        "seconds": for_seconds,
        "by": by,
        "reason": reason_text,
    }
    return _pause(store.operator.pause_destination(connection, params))


@dataclass(frozen=True)
class Resumed:
    #: The pause it ended (None: the destination was not paused).
    pause: Pause | None
    #: Whether it closed an open breaker.
    breaker_closed: bool


def resume(connection: Connection, destination: str, *, by: str) -> Resumed:
    """End the pause of ``destination`` and close its breaker (outbox.breaker), whichever holds
    it back. The caller commits."""
    row, closed = store.operator.resume_destination(connection, destination, by=by)
    ended = None
    if row is not None:
        ended = Pause(row.destination, None, row.paused_at, row.paused_by, row.pause_reason)
    return Resumed(ended, closed)


def paused(connection: Connection) -> list[Pause]:
    """The destinations paused now, by name."""
    return [_pause(r) for r in connection.execute(_PAUSED).all()]


def held_reason(conn: psycopg.Connection[Any], *, destination: str) -> str | None:
    """Why ``destination``'s rows are held back now (paused, or its breaker open: outbox.breaker),
    or None (a worker's psycopg connection): asked after an empty claim, to say why it was empty."""
    row = conn.execute(_HELD_REASON, {"destination": destination}).fetchone()
    return row[0] if row else None


# Queues the workers seen in the last day served, and the destinations of rows waiting now: what
# a pause is expected to name (a typo is paused happily, and the real destination keeps going).
_KNOWN = text(
    """
    SELECT DISTINCT unnest(queues) FROM outbox_process WHERE last_seen_at > now() - interval '1 day'
    UNION
    SELECT DISTINCT destination FROM outbox_message WHERE state IN ('pending', 'dispatched')
    """
)


def known_destinations(connection: Connection) -> set[str]:
    return {r[0] for r in connection.execute(_KNOWN).all()}


def hold(conn: psycopg.Connection[Any], destination: str, *, seconds: float, by: str, reason: str) -> bool:
    """Pause ``destination`` for ``seconds`` from the database's now, unless it is paused longer
    already: a provider's ``Retry-After`` for every request (``retry_after_scope="destination"``).
    True when this call set or lengthened the pause."""
    params = {
        "destination": destination,
        "seconds": float(seconds),
        "by": by,
        "reason": sanitize.clean_text(reason, max_chars=REASON_CHARS),
    }
    return store.delivery.hold_destination(conn, params)
