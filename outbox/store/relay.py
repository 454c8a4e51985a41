"""The relay's statements: take a batch of due rows (``pending -> dispatched``), fill a limited
destination's dispatch window (outbox.windows), or give rows back when Redis refused them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from .. import db, ordering, sanitize, windows
from .sql import LIMITED_SQL, LIVE_DECLARATIONS_SQL

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


# The same, without the destinations whose windows the relay fills (their rows are taken by
# _DISPATCH_WINDOW, in their own order). Their due backlog is read past, not taken: the cost of a
# limited destination's backlog in PostgreSQL (docs/flow-control.md).
DISPATCH_DUE_EXCEPT_SQL = DISPATCH_DUE_SQL.replace(
    "AND NOT {blocked}".format(blocked=ordering.blocked_sql("outbox_message")),
    "AND destination <> ALL(%(windowed)s) AND NOT {blocked}".format(
        blocked=ordering.blocked_sql("outbox_message")
    ),
)

_DISPATCH_DUE_STATEMENT = db.Statement(DISPATCH_DUE_SQL)
_DISPATCH_DUE_EXCEPT_STATEMENT = db.Statement(DISPATCH_DUE_EXCEPT_SQL)


def dispatch_due(conn: psycopg.Connection[Any], *, limit: int, windowed: Sequence[str] = ()) -> list[Any]:
    """``pending`` -> ``dispatched`` for up to ``limit`` due rows, oldest due first; returns
    ``(id, destination, dispatched_at)`` per row. Run it in the transaction that publishes the
    rows: if the publish raises, the move rolls back with it. (The relay "takes" rows; only a
    consumer "claims" one.) ``windowed``: destinations left to :func:`dispatch_window`."""
    if not windowed:
        return _DISPATCH_DUE_STATEMENT.execute(conn, {"limit": limit}).fetchall()
    return _DISPATCH_DUE_EXCEPT_STATEMENT.execute(
        conn, {"limit": limit, "windowed": list(windowed)}
    ).fetchall()


# The limits in force of each limited destination (the operator's, else the lowest a live process
# declares; outbox.limits), each with whether this transaction holds its window: an advisory lock
# per destination, so that two relays never fill one window at once from the same count. Held to
# the end of the take's transaction; the window's count, read by the next statement, sees every
# take committed before the lock was granted.
#
# It also turns JIT compilation off for the rest of the take's transaction: the window's
# estimates (a nested loop per fairness key) pass jit_above_cost, and compiling the statement
# cost 50 ms of a 60 ms take over a 100,000-row backlog, for a plan that runs in 10.
_WINDOWS = f"""
SELECT d.destination, COALESCE(d.limit_in_flight, l.n), COALESCE(d.limit_per_second, l.rate),
       pg_try_advisory_xact_lock(hashtextextended('outbox.window:' || d.destination, 0)) AS ours
FROM outbox_destination d
LEFT JOIN ({LIVE_DECLARATIONS_SQL}) AS l ON l.destination = d.destination
WHERE {LIMITED_SQL} AND COALESCE(d.limit_in_flight, l.n, d.limit_per_second, l.rate) IS NOT NULL
  AND (SELECT set_config('jit', 'off', true)) IS NOT NULL
ORDER BY d.destination
"""


def limited_destinations(conn: psycopg.Connection[Any]) -> list[Any]:
    """``(destination, in_flight, per_second, ours)`` per destination with a limit in force;
    ``ours``: this transaction may fill its window (another relay's take is filling it now when
    not). Run in the take's transaction."""
    return conn.execute(_WINDOWS).fetchall()


_DUE = f"m.state = 'pending' AND m.available_at <= now() AND NOT {ordering.blocked_sql('m')}"
_KEY = "COALESCE(m.fairness_key, '')"

# The window's take, along outbox_message_fair_idx (destination, priority, fairness key, due
# time, id) of pending rows; rows without a key are the key ''.
#
# * room: the window's size less the destination's rows published and not settled: in flight
#   (any), and dispatched by a window take (``windowed``; rows the other take published before
#   the destination had a limit are not counted: they settle soon);
# * keys: for each priority, the fairness keys with pending rows of it, in key order from just
#   after that priority's cursor (the last key the previous take visited there; NULL: from the
#   first), wrapping round to the first key once, two index probes each (the next key, and
#   whether it has a due row): until the room's number of keys with due rows, since a take
#   serves no more, or windows.MAX_KEYS_VISITED keys. A large tenant's backlog is never read, and
#   100,000 tenants cost a take no more than those probes;
# * candidates: for each priority and key, its oldest due rows, at most room / keys (rounded up):
#   if every key had that many, the cut below would need no more; a key with fewer leaves the
#   window short this take, and the next take tops it up;
# * then the order of outbox.windows: aged priority (one class up per %(aging)s seconds due,
#   uncapped), the row's own priority, its turn within its key, due time, id; as many as the
#   room allows. The rows are locked SKIP LOCKED and moved by id, each returned with its place in
#   that order (the publication follows it) and its priority and key (the next cursors).
_NEXT_KEY = f"""(SELECT {_KEY} FROM outbox_message m
     WHERE m.destination = %(destination)s AND m.state = 'pending' AND m.priority = {{p}}
       AND {_KEY} > {{after}} ORDER BY {_KEY} LIMIT 1)"""
_DUE_KEY = f"""EXISTS (SELECT 1 FROM outbox_message m
     WHERE m.destination = %(destination)s AND m.state = 'pending' AND m.priority = {{p}}
       AND {_KEY} = {{k}} AND m.available_at <= now())"""
_FIRST_KEY = f"""(SELECT {_KEY} FROM outbox_message m
     WHERE m.destination = %(destination)s AND m.state = 'pending' AND m.priority = {{p}}
     ORDER BY {_KEY} LIMIT 1)"""

_DISPATCH_WINDOW = f"""
WITH RECURSIVE room AS (
    SELECT CAST(%(size)s AS bigint)
           - (SELECT count(*) FROM outbox_message
              WHERE destination = %(destination)s AND state = 'dispatched' AND windowed)
           - (SELECT count(*) FROM outbox_message
              WHERE destination = %(destination)s AND state = 'in_flight') AS n
), cursors AS (
    SELECT priority, cursor FROM (VALUES (1, CAST(%(after_high)s AS text)),
                                         (0, CAST(%(after_normal)s AS text)),
                                         (-1, CAST(%(after_low)s AS text))) AS c(priority, cursor)
    WHERE (SELECT n FROM room) > 0
), keys AS (
    -- n: keys with due rows so far, m: keys visited so far.
    SELECT c.priority, c.cursor, s.k, s.wrapped, s.due, CAST(s.due AS int) AS n, 1 AS m
    FROM cursors c CROSS JOIN LATERAL (
        SELECT y.k, y.wrapped, y.k IS NOT NULL AND {_DUE_KEY.format(p="c.priority", k="y.k")} AS due
        FROM (SELECT COALESCE(x.after, x.first) AS k, x.after IS NULL AND c.cursor IS NOT NULL AS wrapped
              FROM (SELECT CASE WHEN c.cursor IS NULL THEN {_FIRST_KEY.format(p="c.priority")}
                                ELSE {_NEXT_KEY.format(p="c.priority", after="c.cursor")} END AS after,
                           CASE WHEN c.cursor IS NULL THEN NULL
                                ELSE {_FIRST_KEY.format(p="c.priority")} END AS first) x) y
    ) s
    UNION ALL
    SELECT f.priority, f.cursor, s.k, s.wrapped, s.due, f.n + CAST(s.due AS int), f.m + 1
    FROM keys f CROSS JOIN LATERAL (
        SELECT y.k, y.wrapped, y.k IS NOT NULL AND {_DUE_KEY.format(p="f.priority", k="y.k")} AS due
        FROM (SELECT CASE WHEN x.after IS NOT NULL THEN x.after WHEN NOT f.wrapped THEN x.first END AS k,
                     f.wrapped OR x.after IS NULL AS wrapped
              FROM (SELECT {_NEXT_KEY.format(p="f.priority", after="f.k")} AS after,
                           CASE WHEN f.wrapped OR f.cursor IS NULL THEN NULL
                                ELSE {_FIRST_KEY.format(p="f.priority")} END AS first) x) y
    ) s
    WHERE f.k IS NOT NULL AND f.n < (SELECT n FROM room) AND f.m < %(max_keys)s
      AND NOT (f.wrapped AND f.k >= f.cursor)
), seen AS (
    -- Once round, a key past the cursor was seen already.
    SELECT priority, k, due, n, m FROM keys WHERE k IS NOT NULL AND NOT (wrapped AND k > cursor)
), served AS (
    SELECT priority, k FROM seen WHERE due
), visited AS (
    -- Each priority's next cursor: the last key visited, due rows or not (a key whose rows are
    -- all due later is passed over, not waited on), in the database's own collation; and
    -- whether the visit stopped short (the room's number of keys with due rows, or
    -- %(max_keys)s keys visited): more keys may have due rows.
    SELECT jsonb_object_agg(priority, jsonb_build_array(
               last, due_keys >= (SELECT n FROM room) OR visited >= %(max_keys)s)) AS cursors
    FROM (SELECT priority, (array_agg(k ORDER BY m DESC))[1] AS last, max(n) AS due_keys,
                 max(m) AS visited
          FROM seen GROUP BY priority) v
), share AS (
    SELECT priority, CAST(ceil((SELECT n FROM room) / CAST(count(*) AS float8)) AS bigint) AS n
    FROM served GROUP BY priority
), candidates AS (
    SELECT c.id, f.k, f.priority, c.available_at
    FROM served f JOIN share USING (priority)
    CROSS JOIN LATERAL (
        SELECT m.id, m.available_at FROM outbox_message m
        WHERE m.destination = %(destination)s AND m.priority = f.priority AND {_KEY} = f.k AND {_DUE}
        ORDER BY m.available_at, m.id LIMIT share.n
    ) c
), ranked AS (
    SELECT id, k, priority, available_at,
           priority + floor(extract(epoch FROM now() - available_at) / %(aging)s) AS rank
    FROM candidates
), picked AS (
    SELECT array_agg(id ORDER BY place) AS ids FROM (
        SELECT id, row_number() OVER (ORDER BY rank DESC, priority DESC, turn, available_at, id) AS place
        FROM (SELECT id, rank, priority, available_at,
                     row_number() OVER (PARTITION BY k, rank ORDER BY available_at, id) AS turn
              FROM ranked) t
    ) o WHERE place <= (SELECT n FROM room)
), moved AS (
    UPDATE outbox_message
    SET state = 'dispatched', dispatched_at = now(), windowed = true
    WHERE id = ANY(ARRAY(
        SELECT id FROM outbox_message
        WHERE id = ANY(CAST((SELECT ids FROM picked) AS bigint[])) AND state = 'pending'
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING id, destination, dispatched_at, array_position((SELECT ids FROM picked), id) AS place
)
-- The room and the cursors are returned even when nothing moved.
SELECT (SELECT n FROM room), (SELECT cursors FROM visited), moved.id, moved.destination,
       moved.dispatched_at, moved.place
FROM (SELECT 1) AS one LEFT JOIN moved ON true
"""

_DISPATCH_WINDOW_STATEMENT = db.Statement(_DISPATCH_WINDOW)


@dataclass
class Window:
    """What :func:`dispatch_window` did: the room the window had, the rows it took (``(id,
    destination, dispatched_at)``, in the order of outbox.windows), each priority's next cursor
    (the last fairness key it visited), and whether a visit stopped at the room's number of keys
    (more keys may have due rows)."""

    room: int
    rows: list[Any]
    cursors: dict[int, str]
    more_keys: bool


def dispatch_window(
    conn: psycopg.Connection[Any],
    *,
    destination: str,
    size: int,
    cursors: Mapping[int, str | None] | None = None,
) -> Window:
    """``pending`` -> ``dispatched`` for as many due rows of ``destination`` as its window of
    ``size`` has room for (``size`` minus its rows ``dispatched`` or ``in_flight``), in the order
    of outbox.windows, each priority's fairness keys visited from just after its cursor
    (``cursors``: priority -> the last key visited there; None: from the first). In the take's
    transaction, after :func:`limited_destinations` said ``ours``."""
    after = dict(cursors or {})
    params = {
        "destination": destination,
        "size": size,
        "aging": windows.PRIORITY_AGING_SECONDS,
        "max_keys": windows.MAX_KEYS_VISITED,
        "after_high": after.get(1),
        "after_normal": after.get(0),
        "after_low": after.get(-1),
    }
    result = _DISPATCH_WINDOW_STATEMENT.execute(conn, params).fetchall()
    visited = result[0][1] or {}
    moved = sorted((r for r in result if r[2] is not None), key=lambda r: r[5])
    return Window(
        room=int(result[0][0]),
        rows=[r[2:5] for r in moved],
        cursors={int(p): last for p, (last, _) in visited.items()},
        more_keys=any(stopped for _, stopped in visited.values()),
    )


def undispatch(
    conn: psycopg.Connection[Any], *, ids: Sequence[int], retry_after_seconds: float, error: str
) -> None:
    """``dispatched`` -> ``pending``, due ``retry_after_seconds`` from now, ``error`` as their
    last_error: rows whose publication Redis refused, in the transaction that took them."""
    params = {"ids": list(ids), "retry_after": retry_after_seconds, "error": sanitize.clean_text(error)}
    conn.execute(_UNDISPATCH, params)
