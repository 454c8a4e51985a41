"""Job 7, ``held_destinations``: a destination held back (paused, or its breaker open) is alerted
once per episode, not once per row; the episode's mark is cleared when it ends, so that the next
one alerts again. Its waiting rows whose deadline passes meanwhile are failed
(``outbox.store.recovery.fail_past_deadline``): no claim comes to do it, and the failure is then
reported by the ``alerts`` job when it happens, not when the provider is back.

An episode is a pause (``outbox pause``, or a worker's Retry-After hold: ``outbox.pauses``) from
its ``paused_at``, or a breaker trip (``outbox.breaker``) from its ``breaker_opened_at``, both on
the destination's ``outbox_destination`` row; the mark is ``pause_alerted_at`` /
``breaker_alerted_at`` on the same row. The "no consumer" episodes have their own job
(``no_consumer``).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg
from psycopg.rows import namedtuple_row

from outbox import alerts, settings, store
from outbox.alerts import AlertHook, AlertRow, log_alert
from outbox.db import require_autocommit

from .common import nonzero

logger = logging.getLogger(__name__)

#: An episode shorter than this is not alerted: a Retry-After of a few seconds, a breaker that
#: closes at its first probe. Logged by the worker either way.
DEFAULT_HELD_ALERT_AFTER_SECONDS = 60.0
#: Rows past their deadline failed per run, at most.
DEADLINE_BATCH = 1000

# Each kind of episode: whether it is on, when it began, its mark, and what it says.
_HELD = """
SELECT destination,
       COALESCE(paused_until > now(), false) AS paused, paused_at, pause_alerted_at,
       NULLIF(paused_until, 'infinity') AS paused_until, paused_by, pause_reason,
       breaker_opened_at IS NOT NULL AS tripped, COALESCE(breaker_since, breaker_opened_at) AS breaker_since,
       breaker_opened_at, breaker_alerted_at,
       breaker_open_until, breaker_probes, breaker_reason,
       now() AS now
FROM outbox_destination
WHERE paused_until > now() OR breaker_opened_at IS NOT NULL
   OR pause_alerted_at IS NOT NULL OR breaker_alerted_at IS NOT NULL
ORDER BY destination
"""

# The oldest row waiting for the destination (what the alert names) and how many wait.
_WAITING = """
SELECT (SELECT count(*) FROM outbox_message WHERE destination = %(d)s AND state IN ('pending', 'dispatched')),
       w.id, w.key, w.step, EXTRACT(EPOCH FROM now() - w.created_at)
FROM (SELECT 1) one
LEFT JOIN LATERAL (
    SELECT id, key, step, created_at FROM outbox_message
    WHERE destination = %(d)s AND state IN ('pending', 'dispatched')
    ORDER BY created_at, id LIMIT 1
) w ON true
"""


@dataclass(frozen=True)
class _Episode:
    kind: str  # "paused" | "breaker_open"
    on: bool
    since: Any
    alerted_at: Any
    reason: str


# The status the outbox writes into a breaker's reason ("HTTP 503 from host", "… (HTTP 503)").
_HTTP_STATUS = re.compile(r"\bHTTP ([1-5][0-9]{2})\b")


def _not_processed(breaker_reason: str | None) -> str:
    """The breaker's reason as an alert says it: the status, not the provider's or the handler's
    text (outbox.alerts); ``outbox status`` shows the whole reason."""
    found = _HTTP_STATUS.search(breaker_reason or "")
    status = f" (HTTP {found.group(1)})" if found else ""
    return f"the latest calls were not processed{status}; {alerts.WITHHELD}: outbox status"


def _episodes(row: Any) -> list[_Episode]:
    fmt = "%Y-%m-%d %H:%M:%S %Z"
    until = f"until {row.paused_until:{fmt}}" if row.paused_until else "until resumed"
    pause = _Episode(
        "paused",
        row.paused,
        row.paused_at,
        row.pause_alerted_at,
        f"{row.destination} paused since {row.paused_at:{fmt}} by {row.paused_by or '?'}, {until}: "
        f"{row.pause_reason or 'no reason given'}"
        if row.paused
        else "",
    )
    breaker = _Episode(
        "breaker_open",
        row.tripped,
        row.breaker_since,
        row.breaker_alerted_at,
        f"{row.destination}'s circuit breaker open since {row.breaker_since:{fmt}} "
        f"({row.breaker_probes} probe(s) so far, next after {row.breaker_open_until:{fmt}}): "
        f"{_not_processed(row.breaker_reason)}"
        if row.tripped
        else "",
    )
    return [pause, breaker]


def held_destinations(
    conn: psycopg.Connection[Any],
    hook: AlertHook = log_alert,
    *,
    alert_after_seconds: float = DEFAULT_HELD_ALERT_AFTER_SECONDS,
    episode_gap_seconds: float = settings.DESTINATION_EPISODE_GAP_SECONDS,
    skip_when_failed: Collection[str] = (),
) -> dict[str, int]:
    """Alert each pause and each breaker episode once it has lasted ``alert_after_seconds``, as an
    :class:`AlertRow` with state ``paused`` or ``breaker_open`` naming the destination's oldest
    waiting row (id 0 and an empty key when none waits) and saying how many wait; clear the mark
    of an episode once it has ended for good: resumed, or over for ``episode_gap_seconds``
    (a pause or trip that follows sooner continues the episode, so a chain of short holds is
    alerted once). A hook that raises is tried again at the next run.

    Counts: ``held`` (episodes on), ``alerts``, ``hook_errors``, ``ended``, ``past_deadline``
    (rows failed; of a destination in ``skip_when_failed``, letting their ordering keys go on),
    ``past_deadline_unknown`` (rows whose earlier call may have taken effect: to
    ``unknown``, for the lookup).
    """
    require_autocommit(conn, "held_destinations")
    counts: Counter[str] = Counter()
    with conn.cursor(row_factory=namedtuple_row) as cur:
        rows: list[Any] = cur.execute(_HELD).fetchall()
    held = [r.destination for r in rows if r.paused or r.tripped]
    past = store.recovery.fail_past_deadline(
        conn, destinations=held, limit=DEADLINE_BATCH, skip_when_failed=sorted(skip_when_failed)
    )
    if past.failed or past.unknown:
        counts["past_deadline"] += past.failed
        counts["past_deadline_unknown"] += past.unknown
        logger.warning(
            "%s row(s) of held-back destinations failed, %s sent to unknown for the lookup (an "
            "earlier call may have taken effect): their deadline passed while they waited",
            past.failed,
            past.unknown,
            extra={"rows": past.failed + past.unknown, "failed": past.failed, "unknown": past.unknown},
        )
    for row in rows:
        for episode in _episodes(row):
            if not episode.on:
                if episode.alerted_at is not None and store.recovery.clear_destination_alert(
                    conn, episode.kind, row.destination, gap_seconds=float(episode_gap_seconds)
                ):
                    counts["ended"] += 1
                    logger.warning(
                        "destination %s: the %s episode alerted at %s is over",
                        row.destination,
                        episode.kind,
                        episode.alerted_at,
                        extra={
                            "destination": row.destination,
                            "episode": episode.kind,
                            "_shown": ("episode",),
                        },
                    )
                continue
            counts["held"] += 1
            if episode.alerted_at is not None and episode.alerted_at >= episode.since:
                continue  # alerted already
            if (row.now - episode.since).total_seconds() < alert_after_seconds:
                continue
            counts[_alert(conn, hook, row.destination, episode)] += 1
    return nonzero(counts)


def _alert(conn: psycopg.Connection[Any], hook: AlertHook, destination: str, episode: _Episode) -> str:
    waiting, first_id, key, step, age = conn.execute(_WAITING, {"d": destination}).fetchone() or (
        0,
        None,
        None,
        None,
        None,
    )
    alert = AlertRow(
        id=first_id or 0,
        key=key or "",
        step=step or "",
        destination=destination,
        state=episode.kind,
        reason=f"{episode.reason}; {waiting} row(s) wait without spending attempts",
        age=float(age or 0.0),
    )
    if not alerts.send(hook, alert, about=f"destination {destination}", extra={"destination": destination}):
        return "hook_errors"
    marked = store.recovery.mark_destination_alerted(conn, episode.kind, destination, since=episode.since)
    return "alerts" if marked else "raced"


@dataclass(frozen=True)
class HeldDestinationsConfig:
    #: A pause or breaker episode shorter than this is not alerted.
    alert_after_seconds: float = DEFAULT_HELD_ALERT_AFTER_SECONDS


@dataclass(frozen=True)
class HeldDestinations:
    name: ClassVar[str] = "held_destinations"
    config: HeldDestinationsConfig
    hook: AlertHook = log_alert
    #: Destinations whose handler says on_failed_head="skip" (outbox.ordering).
    skip_when_failed: frozenset[str] = frozenset()

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return held_destinations(
            conn,
            self.hook,
            alert_after_seconds=self.config.alert_after_seconds,
            skip_when_failed=self.skip_when_failed,
        )
