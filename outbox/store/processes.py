"""Every process's statements about itself: its heartbeat (``outbox_process``) and the
database identity it checks for a failover (``outbox_db_identity``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from .sql import LIVE, LIVE_INTERVALS, LIVE_SLACK_SECONDS

# The beat, and the hint that a destination has in-flight limits declared by live processes'
# handlers (outbox.limits; migration 0023): the claim's trigger looks for declarations only where
# the hint is set, and reads the lowest live one itself. This beat's own declaration joins the
# others' (its upsert is not visible to its own statement). Every beat writes each hint, right or
# not: the write waits for a clearing under way (below) and puts the hint back after it, so a
# clearing that could not see this process yet never leaves its declaration without a hint.
__all__ = ["LIVE", "LIVE_INTERVALS", "LIVE_SLACK_SECONDS"]

_BEAT = f"""
WITH beat AS (
    INSERT INTO outbox_process AS p
        (id, kind, hostname, pid, queues, interval_seconds, started_at, last_seen_at, process_clock,
         schema_oldest, schema_newest, declared_in_flight)
    VALUES (%(id)s, %(kind)s, %(hostname)s, %(pid)s, %(queues)s, %(interval)s,
            clock_timestamp(), clock_timestamp(), %(clock)s, %(schema_oldest)s, %(schema_newest)s,
            CAST(%(declared)s AS jsonb))
    ON CONFLICT (id) DO UPDATE
    SET last_seen_at = clock_timestamp(), process_clock = EXCLUDED.process_clock,
        queues = EXCLUDED.queues, interval_seconds = EXCLUDED.interval_seconds, stopped_at = NULL,
        declared_in_flight = EXCLUDED.declared_in_flight
), live AS (
    SELECT d.key AS destination, min(CAST(d.value AS integer)) AS n
    FROM (SELECT declared_in_flight FROM outbox_process WHERE {LIVE} AND id <> %(id)s
          UNION ALL SELECT CAST(%(declared)s AS jsonb)) AS p(declared_in_flight),
         jsonb_each_text(p.declared_in_flight) AS d
    GROUP BY d.key
)
INSERT INTO outbox_destination AS o (destination, declared_in_flight)
SELECT destination, n FROM live l
ON CONFLICT (destination) DO UPDATE SET declared_in_flight = EXCLUDED.declared_in_flight
"""

# Hints no live process backs any more (the declaring process stopped or went quiet, or a deploy
# dropped the declaration), cleared under the rows' lock and on a snapshot taken after it: a
# process whose first beat commits meanwhile writes its hint after this, never before it.
_STALE_HINT = f"""e.declared_in_flight IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM outbox_process p WHERE p.declared_in_flight ? e.destination AND {LIVE})"""
_ANY_STALE_HINT = f"SELECT EXISTS (SELECT 1 FROM outbox_destination e WHERE {_STALE_HINT})"
_STALE_HINTS = """
SELECT destination FROM outbox_destination
WHERE declared_in_flight IS NOT NULL ORDER BY destination FOR NO KEY UPDATE
"""
_CLEAR_STALE_HINTS = f"UPDATE outbox_destination e SET declared_in_flight = NULL WHERE {_STALE_HINT}"

_STOP = """
UPDATE outbox_process
SET stopped_at = clock_timestamp(), last_seen_at = clock_timestamp(), process_clock = %(clock)s
WHERE id = %(id)s
"""


def beat(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> None:
    """One heartbeat of a process (outbox.heartbeat): its row written, or refreshed, with the
    in-flight limits its handlers declare; and the hints of declarations no live process backs
    any more cleared (on an autocommit connection: the clearing is its own transaction)."""
    conn.execute(_BEAT, {"declared": None, **params})
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
