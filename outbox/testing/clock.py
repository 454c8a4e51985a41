"""Time passing, for tests: every instant of the rows moves back together (``elapse``), so
that a lease expires, a retry falls due or a row grows old without waiting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from ..store.sql import cached_text

# Every instant of the rows (and of their attempt rows) moves back together, as if `seconds` had
# passed on the database's clock: what was due in less than that is due, a lease that had less
# left has expired, a call older than key_ttl is so. Nothing else changes, so no state is
# reached that the product could not reach itself.
_ELAPSE = """
WITH moved AS (
    UPDATE outbox_message
    SET created_at = created_at - %(s)s * interval '1 second',
        available_at = available_at - %(s)s * interval '1 second',
        deadline = deadline - %(s)s * interval '1 second',
        dispatched_at = dispatched_at - %(s)s * interval '1 second',
        claimed_at = claimed_at - %(s)s * interval '1 second',
        lease_expires_at = lease_expires_at - %(s)s * interval '1 second',
        unknown_since = unknown_since - %(s)s * interval '1 second',
        completed_at = completed_at - %(s)s * interval '1 second',
        alerted_at = alerted_at - %(s)s * interval '1 second'
    WHERE CAST(%(ids)s AS bigint[]) IS NULL OR id = ANY(CAST(%(ids)s AS bigint[]))
    RETURNING id
), fenced AS (
    UPDATE outbox_attempt a
    SET started_at = started_at - %(s)s * interval '1 second',
        finished_at = finished_at - %(s)s * interval '1 second',
        settled_at = settled_at - %(s)s * interval '1 second'
    FROM moved WHERE a.message_id = moved.id
)
SELECT count(*) FROM moved
"""


def elapse(conn: Any, seconds: float, *, ids: Sequence[int] | None = None) -> int:
    """For tests and the demo: make ``seconds`` pass for the rows ``ids`` (all rows when None) by
    moving every instant they hold back by that much; how many rows. ``conn``: a psycopg
    connection or a SQLAlchemy ``Connection``/``Session`` (the caller commits unless it is in
    autocommit mode)."""
    params = {"s": float(seconds), "ids": list(ids) if ids is not None else None}
    if isinstance(conn, psycopg.Connection):
        row = conn.execute(_ELAPSE, params).fetchone()
    else:
        statement = cached_text(_ELAPSE.replace("%(s)s", ":s").replace("%(ids)s", ":ids"))
        row = conn.execute(statement, params).first()
    return int(row[0]) if row else 0
