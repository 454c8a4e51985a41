"""The circuit breaker of each destination, on its ``outbox_destination`` row.

When a provider is down, every call to it answers "not processed" (a connect error, 429, 503):
without a breaker, every waiting row spends its attempts on those answers and ends ``failed``.
With one, the destination holds itself back instead, and its rows wait without spending any.

======================  ==================================================  =====================
state                   what it means                                       who moves it out
======================  ==================================================  =====================
closed                  claims go through; the worker counts consecutive    the worker that
(``breaker_opened_at``  "not processed" outcomes (``breaker_failures``,     records the
IS NULL)                counted from ``breaker_window_at``); any processed  ``failures``-th
                        outcome (sent, refused) sets the count back to 0    within ``window``
open                    no claim of its rows before ``breaker_open_until``  time (then half-open)
                        (their messages are acknowledged, the rows wait,    or ``outbox resume``
                        attempts untouched, as for a pause)
half-open (open, its    the first claim of one of its rows reserves the     the probe's worker
``open_until`` passed)  probe (``breaker_probe_token`` = its claim token,   (its record), the
                        until ``breaker_probe_until``: its lease); every    lease's end (a probe
                        other claim is refused                              that never recorded),
                                                                            ``outbox resume``
======================  ==================================================  =====================

The probe's outcome decides: processed (the provider answered: sent, or a refusal with an HTTP
status) closes the breaker; "not processed" opens it again for twice as long (at most
``max_open_seconds``), and that attempt is not counted against its row (the row is only the
messenger), up to ``max_attempts`` such probes per row, after which its probes count like any
attempt, so that a provider that never comes back still fails the row; anything else
(ambiguous: a timeout, a 500; a handler's own retry or refusal without an answer) opens it again
for as long as before: it proves nothing either way. Ambiguous outcomes never count as "not
processed", in any state. Outcomes of calls that were already under way when the breaker tripped
do not move it: after a trip, only the probe speaks.

The reconciler's ``redispatch`` leaves an open breaker's rows alone, re-queues one row of a
half-open destination without a probe under way (the probe; rows written meanwhile serve as well),
and once the breaker closes re-queues them all, as after a pause.

"Consecutive" is per destination across all workers, on the database: a worker sets the count
back to 0 only when its claim saw it above 0 (no extra statement per healthy delivery), so the
failures recorded while a success was under way (claimed when the count was 0) stay counted
after it; ``window_seconds`` bounds how long.

The thresholds are declared with the handler (``outbox.handlers.Breaker``) and what one call
says about the provider is a rule (``outbox.policy.health``); this module holds the statements
only: the worker calls :func:`count_not_processed`, :func:`reset`, :func:`settle_probe`
and :func:`close` after its record; the claim (``outbox.store.delivery``) reads and reserves;
``outbox resume`` closes (``outbox.pauses``); ``status``, ``doctor`` and the metrics read
:func:`open_breakers`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Connection, text

from . import sanitize, store
from .handlers import Breaker
from .policy import Health

# Claims of the row that made a call (or may have): its attempts plus the probes refunded.
_CALLS = """
SELECT count(*) FROM outbox_attempt WHERE message_id = %(id)s AND outcome IS DISTINCT FROM 'released'
"""


def refunds_so_far(conn: psycopg.Connection[Any], *, row_id: int, attempts: int) -> int:
    """How many of the row's probes were not counted as attempts (its claims, less its attempts,
    this claim included in both): a row carries at most ``max_attempts`` uncounted probes, so that
    a provider that never comes back still fails it in the end."""
    row = conn.execute(_CALLS, {"id": row_id}).fetchone()
    return max(0, int(row[0]) - attempts) if row else 0


def _reason(text_: str) -> str:
    return sanitize.clean_text(text_, max_chars=500)


def count_not_processed(
    conn: psycopg.Connection[Any], destination: str, breaker: Breaker, *, reason: str
) -> bool:
    """Count a "not processed" outcome of a closed breaker; True when it tripped the breaker."""
    row = store.delivery.count_breaker_failure(
        conn,
        {
            "destination": destination,
            "threshold": breaker.failures,
            "window": float(breaker.window_seconds),
            "open": float(breaker.open_seconds),
            "reason": _reason(reason),
        },
    )
    return bool(row and row[0])


def reset(conn: psycopg.Connection[Any], destination: str) -> None:
    """A processed outcome: the consecutive count starts again."""
    store.delivery.reset_breaker(conn, destination)


@dataclass(frozen=True)
class ProbeResult:
    closed: bool
    #: How long the breaker is open again (None: closed).
    open_seconds: float | None


def settle_probe(
    conn: psycopg.Connection[Any],
    destination: str,
    breaker: Breaker,
    *,
    token: uuid.UUID,
    health: Health,
    reason: str,
) -> ProbeResult | None:
    """Settle the probe by what its call said of the provider's ``health``; None when this claim
    no longer holds the probe (its lease ended and another claim took it, or an operator closed
    the breaker)."""
    row = store.delivery.settle_breaker_probe(
        conn,
        {
            "destination": destination,
            "token": token,
            "close": health is Health.PROCESSED,
            "factor": 2.0 if health is Health.NOT_PROCESSED else 1.0,
            "max": float(breaker.max_open_seconds),
            "reason": _reason(reason),
        },
    )
    return ProbeResult(bool(row[0]), row[1]) if row else None


def free_probe(conn: psycopg.Connection[Any], destination: str, *, token: uuid.UUID) -> None:
    """The probe made no call (its row failed before it: deadline passed): the next claim probes."""
    store.delivery.free_breaker_probe(conn, destination, token=token)


def close(conn: psycopg.Connection[Any], destination: str) -> bool:
    """Close an open breaker: its handler no longer declares one (a deploy turned it off)."""
    return store.delivery.close_breaker(conn, destination)


@dataclass(frozen=True)
class OpenBreaker:
    destination: str
    opened_at: datetime
    open_until: datetime
    #: Whether the probe may go now (open_until passed) and whether one is under way.
    half_open: bool
    probing: bool
    probes: int
    reason: str | None

    def describe(self) -> str:
        if self.probing:
            now = "a probe delivery is under way"
        elif self.half_open:
            now = "half-open: the next claim is the probe"
        else:
            now = f"next probe after {self.open_until:%Y-%m-%d %H:%M:%S %Z}"
        return (
            f"breaker open: {self.destination} since {self.opened_at:%Y-%m-%d %H:%M:%S %Z}, {now} "
            f"({self.probes} probe(s) so far): {self.reason or 'no reason recorded'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "opened_at": self.opened_at.isoformat(),
            "open_until": self.open_until.isoformat(),
            "half_open": self.half_open,
            "probing": self.probing,
            "probes": self.probes,
            "reason": self.reason,
        }


_OPEN = text(
    """
    SELECT destination, breaker_opened_at, breaker_open_until, breaker_open_until <= now() AS half_open,
           COALESCE(breaker_probe_until > now(), false) AS probing, breaker_probes, breaker_reason
    FROM outbox_destination
    WHERE breaker_opened_at IS NOT NULL
    ORDER BY destination
    """
)


def open_breakers(connection: Connection) -> list[OpenBreaker]:
    """The destinations whose breaker is open (or half-open) now, by name."""
    return [OpenBreaker(*row) for row in connection.execute(_OPEN).all()]
