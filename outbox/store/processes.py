"""Every process's statements about itself: its heartbeat (``outbox_process``) and the
database identity it checks for a failover (``outbox_db_identity``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from .sql import LIVE, LIVE_INTERVALS, LIVE_SLACK_SECONDS

# The beat, and the hints that a destination has limits declared by live processes' handlers
# (outbox.limits; migrations 0023, 0024): the claim's trigger looks for declarations of a kind
# only where its hint is set, and reads the lowest live one itself. This beat's own declarations
# join the others' (its upsert is not visible to its own statement). Every beat writes each hint,
# right or not: the write waits for a clearing under way (below) and puts the hint back after it,
# so a clearing that could not see this process yet never leaves its declaration without a hint.
__all__ = ["LIVE", "LIVE_INTERVALS", "LIVE_SLACK_SECONDS"]


def _declared(column: str, param: str) -> str:
    """Each live process's declarations of one kind, this beat's own included."""
    return f"""(SELECT {column} FROM outbox_process WHERE {LIVE} AND id <> %(id)s
          UNION ALL SELECT CAST(%({param})s AS jsonb)) AS p(declared),
         jsonb_each_text(p.declared) AS d"""


_BEAT = f"""
WITH beat AS (
    INSERT INTO outbox_process AS p
        (id, kind, hostname, pid, queues, interval_seconds, started_at, last_seen_at, process_clock,
         schema_oldest, schema_newest, declared_in_flight, declared_per_second)
    VALUES (%(id)s, %(kind)s, %(hostname)s, %(pid)s, %(queues)s, %(interval)s,
            clock_timestamp(), clock_timestamp(), %(clock)s, %(schema_oldest)s, %(schema_newest)s,
            CAST(%(declared)s AS jsonb), CAST(%(declared_rates)s AS jsonb))
    ON CONFLICT (id) DO UPDATE
    SET last_seen_at = clock_timestamp(), process_clock = EXCLUDED.process_clock,
        queues = EXCLUDED.queues, interval_seconds = EXCLUDED.interval_seconds, stopped_at = NULL,
        declared_in_flight = EXCLUDED.declared_in_flight,
        declared_per_second = EXCLUDED.declared_per_second
), live AS (
    SELECT destination, min(n) AS n, min(rate) AS rate
    FROM (
        SELECT d.key AS destination, CAST(d.value AS integer) AS n, CAST(NULL AS float8) AS rate
        FROM {_declared("declared_in_flight", "declared")}
        UNION ALL
        SELECT d.key, NULL, CAST(d.value AS float8)
        FROM {_declared("declared_per_second", "declared_rates")}
    ) AS x
    GROUP BY destination
)
INSERT INTO outbox_destination AS o (destination, declared_in_flight, declared_per_second)
SELECT destination, n, rate FROM live l
ON CONFLICT (destination) DO UPDATE
SET declared_in_flight = EXCLUDED.declared_in_flight, declared_per_second = EXCLUDED.declared_per_second
"""

# Hints no live process backs any more (the declaring process stopped or went quiet, or a deploy
# dropped the declaration), cleared under the rows' lock and on a snapshot taken after it: a
# process whose first beat commits meanwhile writes its hint after this, never before it.
_STALE_IN_FLIGHT = f"""(e.declared_in_flight IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM outbox_process p WHERE p.declared_in_flight ? e.destination AND {LIVE}))"""
_STALE_RATE = f"""(e.declared_per_second IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM outbox_process p WHERE p.declared_per_second ? e.destination AND {LIVE}))"""
_STALE_HINT = f"({_STALE_IN_FLIGHT} OR {_STALE_RATE})"
_ANY_STALE_HINT = f"SELECT EXISTS (SELECT 1 FROM outbox_destination e WHERE {_STALE_HINT})"
_STALE_HINTS = """
SELECT destination FROM outbox_destination
WHERE declared_in_flight IS NOT NULL OR declared_per_second IS NOT NULL
ORDER BY destination FOR NO KEY UPDATE
"""
_CLEAR_STALE_HINTS = f"""
UPDATE outbox_destination e
SET declared_in_flight = CASE WHEN {_STALE_IN_FLIGHT} THEN NULL ELSE e.declared_in_flight END,
    declared_per_second = CASE WHEN {_STALE_RATE} THEN NULL ELSE e.declared_per_second END
WHERE {_STALE_HINT}
"""

_STOP = """
UPDATE outbox_process
SET stopped_at = clock_timestamp(), last_seen_at = clock_timestamp(), process_clock = %(clock)s
WHERE id = %(id)s
"""


def beat(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> None:
    """One heartbeat of a process (outbox.heartbeat): its row written, or refreshed, with the
    limits its handlers declare; and the hints of declarations no live process backs
    any more cleared (on an autocommit connection: the clearing is its own transaction)."""
    conn.execute(_BEAT, {"declared": None, "declared_rates": None, **params})
    stale = conn.execute(_ANY_STALE_HINT).fetchone()
    if stale is not None and stale[0]:
        with conn.transaction():
            conn.execute(_STALE_HINTS)
            conn.execute(_CLEAR_STALE_HINTS)


def stopped(conn: psycopg.Connection[Any], *, process_id: Any, clock: Any) -> None:
    """The process stopped cleanly: nobody waits for its heartbeat to go stale."""
    conn.execute(_STOP, {"id": process_id, "clock": clock})


# The first process records the identity; a value that was unreadable before and is readable now
# is filled in. The row is written only then, not at every check.
_RECORD = """
WITH ins AS (
    INSERT INTO outbox_db_identity AS i (id, system_identifier, timeline, recorded_by, note)
    VALUES (1, %(sysid)s, %(timeline)s, %(by)s, 'first recorded')
    ON CONFLICT (id) DO UPDATE
    SET system_identifier = COALESCE(i.system_identifier, EXCLUDED.system_identifier),
        timeline = COALESCE(i.timeline, EXCLUDED.timeline)
    WHERE (i.system_identifier IS NULL AND EXCLUDED.system_identifier IS NOT NULL)
       OR (i.timeline IS NULL AND EXCLUDED.timeline IS NOT NULL)
    RETURNING system_identifier, timeline
)
SELECT system_identifier, timeline FROM ins
UNION ALL
SELECT system_identifier, timeline FROM outbox_db_identity
WHERE id = 1 AND NOT EXISTS (SELECT 1 FROM ins)
"""

_MISMATCH_SEEN = """
UPDATE outbox_db_identity
SET mismatch_seen_at = COALESCE(mismatch_seen_at, now()), mismatch = %(mismatch)s
WHERE id = 1 AND mismatch IS DISTINCT FROM %(mismatch)s
"""


def record_identity(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> Any:
    """The identity on record ``(system_identifier, timeline)``, recorded first if there is none
    (outbox.failover.check); None when a concurrent first record is not visible yet."""
    return conn.execute(_RECORD, params).fetchone()


def note_identity_mismatch(conn: psycopg.Connection[Any], mismatch: str) -> None:
    """The server is not the one on record: when it was first seen, and how it differs."""
    conn.execute(_MISMATCH_SEEN, {"mismatch": mismatch})


_IN_FLIGHT_LIMITED = """
SELECT destination FROM outbox_destination
WHERE limit_in_flight IS NOT NULL OR declared_in_flight IS NOT NULL
"""


def in_flight_limited(conn: psycopg.Connection[Any]) -> frozenset[str]:
    """The destinations with an in-flight limit (the operator's, or a declaration's hint): a
    worker publishes the end of their calls (outbox.wakes)."""
    return frozenset(r[0] for r in conn.execute(_IN_FLIGHT_LIMITED).fetchall())
