"""The relay's statements: take a batch of due rows (``pending -> dispatched``), or give them
back when Redis refused them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from .. import db, ordering, sanitize

# The ids are locked first (SKIP LOCKED, so several relays share the load) and handed to the
# UPDATE as an array, which keeps the UPDATE a primary-key lookup whatever the statistics say.
# Joined to a CTE instead, with a backlog of 100,000 analyzed pending rows the planner chose a
# hash join over a sequential scan of the whole table for every batch (EXPLAIN ANALYZE: 57 of
# 85 ms per 1,000 rows; 40-50 ms this way). The outer UPDATE has no `state = 'pending'` of its
# own on purpose: the rows are locked, so it would add nothing, and it makes the partial pending
# index eligible, which the planner picked before the table's first ANALYZE, scanning the whole
# index for each id (1 s per 1,000-row batch).
# All rows of a batch get the same dispatched_at (now() is the transaction's start time).
# Only the head of an ordering key is taken (outbox.ordering): the rows behind it wait `pending`.
DISPATCH_DUE_SQL = f"""
UPDATE outbox_message
SET state = 'dispatched', dispatched_at = now()
WHERE id = ANY(ARRAY(
    SELECT id FROM outbox_message
    WHERE state = 'pending' AND available_at <= now() AND NOT {ordering.blocked_sql("outbox_message")}
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
))
RETURNING id, destination, dispatched_at
"""


# Rows of a destination whose publication Redis refused go back to `pending`, due again after
# this long: left due, they would come first in every batch and, a batch of them, starve the
# other destinations' rows behind them. One statement, in the relay's transaction.
_UNDISPATCH = """
UPDATE outbox_message
SET state = 'pending', dispatched_at = NULL,
    -- The refusal stays on record: the latency metrics count the row from its writing.
    available_at = now() + %(retry_after)s * interval '1 second',
    last_error = %(error)s
WHERE id = ANY(%(ids)s) AND state = 'dispatched'
"""


_DISPATCH_DUE_STATEMENT = db.Statement(DISPATCH_DUE_SQL)


def dispatch_due(conn: psycopg.Connection[Any], *, limit: int) -> list[Any]:
    """``pending`` -> ``dispatched`` for up to ``limit`` due rows, oldest due first; returns
    ``(id, destination, dispatched_at)`` per row. Run it in the transaction that publishes the
    rows: if the publish raises, the move rolls back with it. (The relay "takes" rows; only a
    consumer "claims" one.)"""
    return _DISPATCH_DUE_STATEMENT.execute(conn, {"limit": limit}).fetchall()


def undispatch(
    conn: psycopg.Connection[Any], *, ids: Sequence[int], retry_after_seconds: float, error: str
) -> None:
    """``dispatched`` -> ``pending``, due ``retry_after_seconds`` from now, ``error`` as their
    last_error: rows whose publication Redis refused, in the transaction that took them."""
    params = {"ids": list(ids), "retry_after": retry_after_seconds, "error": sanitize.clean_text(error)}
    conn.execute(_UNDISPATCH, params)
