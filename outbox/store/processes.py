"""Every process's statements about itself: its heartbeat (``outbox_process``) and the
database identity it checks for a failover (``outbox_db_identity``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

_BEAT = """
INSERT INTO outbox_process AS p
    (id, kind, hostname, pid, queues, interval_seconds, started_at, last_seen_at, process_clock,
     schema_oldest, schema_newest)
VALUES (%(id)s, %(kind)s, %(hostname)s, %(pid)s, %(queues)s, %(interval)s,
        clock_timestamp(), clock_timestamp(), %(clock)s, %(schema_oldest)s, %(schema_newest)s)
ON CONFLICT (id) DO UPDATE
SET last_seen_at = clock_timestamp(), process_clock = EXCLUDED.process_clock,
    queues = EXCLUDED.queues, interval_seconds = EXCLUDED.interval_seconds, stopped_at = NULL
"""

_STOP = """
UPDATE outbox_process
SET stopped_at = clock_timestamp(), last_seen_at = clock_timestamp(), process_clock = %(clock)s
WHERE id = %(id)s
"""


def beat(conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> None:
    """One heartbeat of a process (outbox.heartbeat): its row written, or refreshed."""
    conn.execute(_BEAT, params)


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
