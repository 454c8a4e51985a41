"""Rows by destination and state: the one read model that ``outbox status``, the dashboard's
overview and the metrics (the reconciler's ``database_metrics`` job) share. It only reads.

Two modes. Exact (``estimates=None``): every state asked for is counted, each waiting state on
its own partial index (``WHERE state = …``), the settled ones (``sent``, ``cancelled``, which
have no index of their own) in one scan. With :class:`Estimates`: a table the planner sizes
above ``table_rows`` has its settled counts, and any waiting state above ``state_rows``, taken
from the planner's estimate (``EXPLAIN``, nothing read) per destination, and marked as such:
counting them would read the whole table, which a page refreshed every 10 s cannot afford.

Takes a SQLAlchemy ``Connection`` (the CLI, the dashboard) or a psycopg connection (the
reconciler); the caller owns the transaction.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import Connection

from .. import states

#: The states a row waits in, each with a partial index of its own.
WAITING = (states.PENDING, states.DISPATCHED, states.IN_FLIGHT, states.UNKNOWN, states.FAILED)
#: The terminal states: most of a big table, and no index to count them on.
SETTLED = (states.SENT, states.CANCELLED)

#: The instant each waiting state's age is measured from, and which rows count: a pending row
#: from when it became due (a row waiting out its backoff is not late), a dispatched row from
#: its publication, an in_flight row from its claim, an unknown row from when it became unknown.
_AGE_FROM = {
    states.PENDING: ("available_at", "available_at <= now()"),
    states.DISPATCHED: ("dispatched_at", None),
    states.IN_FLIGHT: ("claimed_at", None),
    states.UNKNOWN: ("unknown_since", None),
}
#: The states whose age is read (the others' is None).
AGE_STATES = tuple(_AGE_FROM)


@dataclass(frozen=True)
class Estimates:
    """When counts are the planner's estimates rather than counted."""

    #: Below this many rows in the table (the planner's figure), every count is exact.
    table_rows: int = 200_000
    #: Above it, a waiting state the planner puts above this many rows is estimated too.
    state_rows: int = 100_000


@dataclass
class RowCounts:
    #: destination -> state -> rows, every state asked for present (zeros included), the
    #: destinations in order.
    by_destination: dict[str, dict[str, int]]
    #: (destination, state) -> seconds its oldest row has been in the state (pending: since it
    #: became due; None: no such row), for the counted rows of the states whose age was asked.
    ages: dict[tuple[str, str], float | None] = field(default_factory=dict)
    #: (destination, state) pairs whose count is the planner's estimate
    estimated: set[tuple[str, str]] = field(default_factory=set)
    #: the states asked for
    asked: tuple[str, ...] = states.ALL

    def totals(self) -> dict[str, int]:
        return {s: sum(c.get(s, 0) for c in self.by_destination.values()) for s in self.asked}

    def is_estimate(self, destination: str | None, state: str) -> bool:
        return any(s == state and (destination is None or d == destination) for d, s in self.estimated)

    def age(self, destination: str, state: str) -> float | None:
        return self.ages.get((destination, state))


def _oldest(state: str, *, in_scan: bool) -> str:
    """The oldest row's instant in ``state``: in a branch of that state alone, or in a scan of
    several (filtered to it)."""
    column, due = _AGE_FROM[state]
    conditions = [f"state = '{state}'"] if in_scan else []
    conditions += [due] if due else []
    return f"min({column})" + (f" FILTER (WHERE {' AND '.join(conditions)})" if conditions else "")


def _branch(state: str, aged: bool) -> str:
    age = f"EXTRACT(EPOCH FROM now() - {_oldest(state, in_scan=False)})" if aged else "NULL"
    return (
        f"SELECT destination, '{state}' AS state, count(*) AS n, {age} AS age\n"
        f"FROM outbox_message WHERE state = '{state}' GROUP BY destination"
    )


def _scan(asked: tuple[str, ...], ages: tuple[str, ...]) -> str:
    # Grouped by state, so each group's age is the aggregate of its own state. Each age is one
    # more filtered aggregate over every row of the table: only those asked for are read.
    whens = [f"    WHEN '{s}' THEN {_oldest(s, in_scan=True)}\n" for s in asked if s in ages]
    age = f"EXTRACT(EPOCH FROM now() - CASE state\n{''.join(whens)}    END)" if whens else "NULL"
    listed = ", ".join(f"'{s}'" for s in asked)
    where = "" if set(asked) == set(states.ALL) else f"WHERE state IN ({listed}) "
    return f"SELECT destination, state, count(*) AS n, {age} AS age\nFROM outbox_message {where}GROUP BY 1, 2"


@functools.cache
def exact_sql(asked: tuple[str, ...], ages: tuple[str, ...] = AGE_STATES) -> str:
    """The statement counting the states ``asked`` exactly: ``destination, state, n, age`` rows
    (the age NULL but for the states of ``ages``, of :data:`AGE_STATES`).
    Waiting states only: one branch per state, on its partial index. With a settled state, which
    has no index of its own, the table is read once (a parallel scan), every state asked at once.
    The states are written into it (from :data:`states.ALL` only), not passed as parameters: a
    partial index serves a statement whose predicate is the index's own literally."""
    unknown = [s for s in asked if s not in states.ALL] + [s for s in ages if s not in _AGE_FROM]
    if unknown:
        raise ValueError(f"not row states: {unknown}")
    if any(s in SETTLED for s in asked):
        return _scan(tuple(s for s in states.ALL if s in asked), ages)
    return "\nUNION ALL\n".join(_branch(s, s in ages) for s in WAITING if s in asked)


_TABLE_ROWS = "SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = 'outbox_message'::regclass"
_STATE_ROWS = "EXPLAIN (FORMAT JSON) SELECT destination FROM outbox_message WHERE state = %(s)s"
_PAIR_ROWS = "EXPLAIN (FORMAT JSON) SELECT 1 FROM outbox_message WHERE destination = %(d)s AND state = %(s)s"
#: The destinations to estimate for: those workers serve, those with settings, and the
#: table's most common ones (its statistics), beside those counted.
_DESTINATIONS_SEEN = """
SELECT DISTINCT d FROM (
    SELECT unnest(queues) AS d FROM outbox_process WHERE last_seen_at > now() - interval '1 day'
    UNION ALL SELECT destination FROM outbox_destination
    UNION ALL SELECT unnest(most_common_vals::text::text[]) FROM pg_stats
     WHERE tablename = 'outbox_message' AND attname = 'destination' AND schemaname = current_schema()
) s WHERE d IS NOT NULL
"""


def _fetch(conn: Connection | psycopg.Connection[Any], sql: str, params: Any = None) -> list[Any]:
    if isinstance(conn, psycopg.Connection):
        return conn.execute(sql, params).fetchall()
    return list(conn.exec_driver_sql(sql, params).all())


def _planned_rows(conn: Connection | psycopg.Connection[Any], sql: str, params: dict[str, str]) -> int:
    plan = _fetch(conn, sql, params)[0][0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


def rows_by_destination(
    conn: Connection | psycopg.Connection[Any],
    *,
    asked: Sequence[str] = states.ALL,
    ages: Sequence[str] = AGE_STATES,
    estimates: Estimates | None = None,
) -> RowCounts:
    """Rows by destination and state for the states ``asked``, and the age of the oldest row
    of those of ``ages`` that are counted: exact without ``estimates``; with them, the
    planner's estimates where :class:`Estimates` says (marked in ``estimated``)."""
    asked = tuple(s for s in states.ALL if s in asked)
    aged = tuple(s for s in AGE_STATES if s in ages)
    counted: Iterable[str] = asked
    guessed: list[str] = []
    if estimates is not None:
        table_rows = int(_fetch(conn, _TABLE_ROWS)[0][0] or 0)
        if table_rows >= estimates.table_rows:
            guessed = [s for s in asked if s in SETTLED]
            guessed += [
                s
                for s in asked
                if s in WAITING and _planned_rows(conn, _STATE_ROWS, {"s": s}) > estimates.state_rows
            ]
            counted = tuple(s for s in asked if s not in guessed)
    out: dict[str, dict[str, int]] = {}
    oldest: dict[tuple[str, str], float | None] = {}
    if counted:
        for destination, state, n, age in _fetch(conn, exact_sql(tuple(counted), aged)):
            out.setdefault(destination, dict.fromkeys(asked, 0))[state] = int(n)
            if state in aged:
                oldest[(destination, state)] = float(age) if age is not None else None
    estimated: set[tuple[str, str]] = set()
    if guessed:
        destinations = {r[0] for r in _fetch(conn, _DESTINATIONS_SEEN)} | set(out)
        for destination in destinations:
            row = out.setdefault(destination, dict.fromkeys(asked, 0))
            for state in guessed:
                row[state] = _planned_rows(conn, _PAIR_ROWS, {"d": destination, "s": state})
                estimated.add((destination, state))
    return RowCounts({d: out[d] for d in sorted(out)}, oldest, estimated, asked)
