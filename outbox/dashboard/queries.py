"""What the dashboard reads that the CLI does not: the overview's counts (the read model
``outbox status`` and the metrics share, outbox.store.counts, with estimates above a size), the
last minute's confirmed rate and the last hour's throughput and latency (from samples), search,
and the keyset-paged lists. Each query is built to stay under the page budget at a million rows
in ``outbox_message``: one branch per state on that state's partial index, the ``purge`` index
for the last minute and the last hour, the key prefix and provider-reference indexes of
migration 0019.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

from ..ops.inspect import key_like
from ..ops.values import seconds
from ..store import counts as store_counts

#: Above this many rows in the table, the settled counts (sent, cancelled) are the planner's
#: estimates, marked as such: counting them exactly reads the whole table. So is a waiting state
#: (each on its partial index) that alone holds more than ``state_rows``.
ESTIMATES = store_counts.Estimates(table_rows=200_000, state_rows=100_000)
#: Rows read per minute of the last hour for throughput and latency.
SAMPLE_PER_MINUTE = 40
#: The window of the overview's "confirmed/s": the last minute. The page refreshes every 10 s, so
#: a drain, a burst or an outage shows within a refresh or two (300 rows confirmed in one minute
#: read 5.0/s for the minute after); a minute, not 10 s, so that a few confirmations at a low rate
#: do not make the figure jump between 0 and something at every refresh. The hour's average is
#: beside it, and the chart below keeps the hour minute by minute.
RECENT_SECONDS = 60
#: Confirmed rows read at most for it; above, the rate is estimated from how long the newest
#: this many took to be confirmed.
RECENT_SAMPLE = 2000
PAGE_ROWS = 50
BULK_LIMIT = 1000

Counts = store_counts.RowCounts


def counts(connection: Connection) -> Counts:
    """Rows by destination and state (the read model `outbox status` and the metrics share): exact
    on a small table; on a big one, the waiting states exactly (each on its partial index,
    unless it alone holds more than ``ESTIMATES.state_rows``) and the settled ones estimated."""
    return store_counts.rows_by_destination(connection, ages=(), estimates=ESTIMATES)


# -- the last hour -----------------------------------------------------------------------------------

# The first rows confirmed (sent) in each minute, read on the purge index's completed_at (whose
# predicate the IN repeats): a sample whose commit → confirmed times stand for the minute's, and
# whose spread says how fast the minute went.
_LAST_HOUR = text(
    """
SELECT b.minute, s.latency, s.completed_at
FROM generate_series(date_trunc('minute', now()) - interval '59 minutes',
                     date_trunc('minute', now()), interval '1 minute') AS b(minute)
LEFT JOIN LATERAL (
    SELECT EXTRACT(EPOCH FROM m.completed_at - m.created_at) AS latency, m.completed_at
    FROM outbox_message m
    WHERE m.state IN ('sent', 'cancelled') AND m.state = 'sent' AND m.completed_at >= b.minute
      AND m.completed_at < b.minute + interval '1 minute'
    ORDER BY m.completed_at
    LIMIT :n
) s ON true
WHERE s.latency IS NOT NULL
ORDER BY b.minute, s.completed_at
"""
)


@dataclass
class Recent:
    window_seconds: int
    #: Rows confirmed in the window, as read (at most the sample).
    confirmed: int
    per_second: float
    #: Whether the window held more than the sample: the rate is that of the newest rows.
    estimated: bool


# The newest rows confirmed (sent), on the purge index's completed_at, from the newest back (its
# predicate repeated in the IN): at most a sample, whatever the rate.
_RECENT = text(
    """
SELECT count(*) AS n, EXTRACT(EPOCH FROM now() - min(completed_at)) AS span
FROM (SELECT m.completed_at FROM outbox_message m
      WHERE m.state IN ('sent', 'cancelled') AND m.state = 'sent'
        AND m.completed_at > now() - :window * interval '1 second'
      ORDER BY m.completed_at DESC
      LIMIT :n) s
"""
)


def recent(connection: Connection, window: int = RECENT_SECONDS, sample: int = RECENT_SAMPLE) -> Recent:
    """Rows confirmed a second over the last ``window`` seconds: counted when fewer than
    ``sample``, else the newest ``sample`` rows over the time they took."""
    r = connection.execute(_RECENT, {"window": window, "n": sample}).one()
    n = int(r.n)
    if n < sample:
        return Recent(window, n, n / window, False)
    return Recent(window, n, n / max(float(r.span), 0.001), True)


_HOUR_START = text("SELECT date_trunc('minute', now()) - interval '59 minutes'")


@dataclass
class Minute:
    minute: datetime
    #: Rows settled that minute: exact when fewer than the sample size, else estimated from how
    #: long the sample took to settle (``estimated``).
    settled: float
    estimated: bool
    p50_seconds: float
    p95_seconds: float


@dataclass
class LastHour:
    minutes: list[Minute]
    sample_per_minute: int
    #: The first minute of the hour (the last is the current one, under way).
    start: datetime | None = None

    @property
    def settled(self) -> float:
        return sum(m.settled for m in self.minutes)

    @property
    def estimated(self) -> bool:
        return any(m.estimated for m in self.minutes)

    @property
    def per_second(self) -> float:
        return self.settled / 3600.0

    def p(self, which: str) -> float | None:
        values = [getattr(m, which) for m in self.minutes]
        return max(values) if values else None

    @property
    def peak(self) -> float:
        return max((m.settled for m in self.minutes), default=0.0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def last_hour(connection: Connection, sample: int = SAMPLE_PER_MINUTE) -> LastHour:
    """Rows settled per minute over the last hour, and commit → settled p50/p95 per minute, from
    at most ``sample`` rows a minute."""
    start = connection.execute(_HOUR_START).scalar_one()
    by_minute: dict[datetime, list[tuple[float, datetime]]] = {}
    for minute, latency, completed in connection.execute(_LAST_HOUR, {"n": sample}):
        by_minute.setdefault(minute, []).append((float(latency), completed))
    minutes = []
    for minute, rows in by_minute.items():
        latencies = [r[0] for r in rows]
        if len(rows) < sample:
            settled, estimated = float(len(rows)), False
        else:
            # n rows settled in the time from the minute's start to the n-th: the minute's rate.
            span = max((rows[-1][1] - minute).total_seconds(), 0.001)
            settled, estimated = min(len(rows) * 60.0 / span, 1e9), True
        minutes.append(
            Minute(minute, settled, estimated, _percentile(latencies, 0.5), _percentile(latencies, 0.95))
        )
    return LastHour(minutes, sample, start)


# -- reconciler alerts -------------------------------------------------------------------------------

_ALERTS = text(
    """
SELECT
  (SELECT count(*) FROM outbox_message WHERE state = 'unknown' AND alerted_at IS NOT NULL) AS unknown_alerted,
  (SELECT EXTRACT(EPOCH FROM now() - min(unknown_since)) FROM outbox_message WHERE state = 'unknown')
      AS oldest_unknown,
  (SELECT count(*) FROM outbox_message WHERE chain_problem IS NOT NULL AND alerted_at IS NULL
      AND state = 'sent') AS chain_problems,
  (SELECT EXTRACT(EPOCH FROM now() - min(available_at)) FROM outbox_message
      WHERE state = 'pending' AND available_at <= now()) AS oldest_pending
"""
)


@dataclass
class Alerts:
    unknown_alerted: int
    oldest_unknown_seconds: float | None
    chain_problems: int
    oldest_pending_seconds: float | None


def alerts(connection: Connection) -> Alerts:
    r = connection.execute(_ALERTS).one()
    return Alerts(
        int(r.unknown_alerted), seconds(r.oldest_unknown), int(r.chain_problems), seconds(r.oldest_pending)
    )


# -- search ------------------------------------------------------------------------------------------


@dataclass
class Hit:
    kind: str  # "row", "key", "list"
    row_id: int | None = None
    key: str | None = None
    prefix: str | None = None
    why: str = ""


_BY_ID = text("SELECT id FROM outbox_message WHERE id = :id")
_BY_KEY = text("SELECT 1 FROM outbox_message WHERE key = :key LIMIT 1")
_BY_LEDGER_KEY = text("SELECT 1 FROM outbox_key_ledger WHERE key = :key LIMIT 1")
_BY_KEY_STEP = text("SELECT id FROM outbox_message WHERE key = :key AND step = :step")
_BY_REF = text("SELECT id FROM outbox_message WHERE provider_ref = :ref ORDER BY id LIMIT 2")
_DIGITS = re.compile(r"[0-9]{1,18}")


def search(connection: Connection, query: str) -> list[Hit]:
    """What ``query`` names, most specific first: a row id, a business key, an Idempotency-Key
    (``key:step``), a provider reference; and, always, the keys starting with it."""
    q = query.strip()
    hits: list[Hit] = []
    if not q:
        return hits
    if _DIGITS.fullmatch(q) and connection.execute(_BY_ID, {"id": int(q)}).first():
        hits.append(Hit("row", row_id=int(q), why="row id"))
    if (
        connection.execute(_BY_KEY, {"key": q}).first()
        or connection.execute(_BY_LEDGER_KEY, {"key": q}).first()
    ):
        hits.append(Hit("key", key=q, why="business key"))
    if ":" in q:
        key, step = q.rsplit(":", 1)
        found = connection.execute(_BY_KEY_STEP, {"key": key, "step": step}).first()
        if found:
            hits.append(Hit("row", row_id=int(found[0]), why="Idempotency-Key (key:step)"))
    for (row_id,) in connection.execute(_BY_REF, {"ref": q}):
        hits.append(Hit("row", row_id=int(row_id), why="provider reference"))
    hits.append(Hit("list", prefix=q, why="keys starting with it"))
    return hits


# -- keyset-paged lists ------------------------------------------------------------------------------

_SINCE = {
    "failed": "completed_at",
    "cancelled": "completed_at",
    "sent": "completed_at",
    "unknown": "unknown_since",
    "in_flight": "claimed_at",
    "dispatched": "dispatched_at",
    "pending": "available_at",
}


@dataclass(frozen=True)
class Filter:
    state: str | None = None
    destination: str | None = None
    #: only rows in their state for at least this long
    older_than_seconds: float | None = None
    #: a substring of last_error (case-insensitive)
    error: str | None = None
    key_prefix: str | None = None

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("state", "destination", "error", "key_prefix"):
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.older_than_seconds:
            # Plain digits: :g would write 14 days as 1.2096e+06s, which parse_duration refuses.
            out["older_than"] = format(self.older_than_seconds, ".6f").rstrip("0").rstrip(".") + "s"
        return out


@dataclass
class Page:
    rows: list[dict[str, Any]]
    #: the cursor of the next page (None: last page)
    after: str | None


def _where(f: Filter) -> tuple[str, dict[str, Any]]:
    clauses: list[str] = []
    params: dict[str, Any] = {}
    since = _SINCE.get(f.state or "", "created_at")
    if f.state:
        clauses.append("state = :state")
        params["state"] = f.state
    if f.destination:
        clauses.append("destination = :destination")
        params["destination"] = f.destination
    if f.older_than_seconds:
        clauses.append(f"COALESCE({since}, created_at) <= now() - :older * interval '1 second'")
        params["older"] = f.older_than_seconds
    if f.error:
        clauses.append("last_error ILIKE :error ESCAPE '\\'")
        params["error"] = "%" + key_like(f.error)[:-1] + "%"
    if f.key_prefix:
        clauses.append("key LIKE :key_like ESCAPE '\\'")
        params["key_like"] = key_like(f.key_prefix)
    return (" AND ".join(clauses) or "true"), params


def _order(f: Filter) -> str:
    # A key prefix lists in key order (its index); a state, longest in that state first; else
    # newest rows first (the primary key).
    if f.key_prefix and not f.state:
        return "key"
    if f.state:
        return f"COALESCE({_SINCE.get(f.state, 'created_at')}, created_at)"
    return "-id"


def list_page(connection: Connection, f: Filter, *, after: str | None = None, limit: int = PAGE_ROWS) -> Page:
    """One page of the rows ``f`` selects, after the cursor ``after`` (keyset: no OFFSET, so page
    200 costs what page 1 does)."""
    where, params = _where(f)
    order = _order(f)
    if order == "-id":
        sort, cursor_sql = "id DESC", "id < CAST(:c_id AS bigint)"
    elif order == "key":
        sort, cursor_sql = "key, id", "(key, id) > (CAST(:c_val AS text), CAST(:c_id AS bigint))"
    else:
        sort = f"{order}, id"
        cursor_sql = f"({order}, id) > (CAST(:c_val AS timestamptz), CAST(:c_id AS bigint))"
    if after:
        value, cursor_id = _parse_cursor(after, by_time=order not in ("-id", "key"))
        params.update(c_val=value, c_id=cursor_id)
        where = f"{where} AND {cursor_sql}"
    sort_value = "NULL" if order == "-id" else ("key" if order == "key" else order)
    rows = [
        dict(r)
        for r in connection.execute(
            text(
                f"""
SELECT id, key, step, destination, state, attempts, created_at, completed_at, last_error,
       provider_ref, {sort_value} AS cursor_value,
       EXTRACT(EPOCH FROM now() - COALESCE({_SINCE.get(f.state or "", "created_at")}, created_at)) AS age
FROM outbox_message WHERE {where} ORDER BY {sort} LIMIT :limit
"""
            ),
            {**params, "limit": limit + 1},
        ).mappings()
    ]
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = None
    if more and rows:
        last = rows[-1]
        value = last["cursor_value"]
        text_value = value.isoformat() if isinstance(value, datetime) else (value or "")
        nxt = f"{text_value}|{last['id']}"
    return Page(rows, nxt)


_MAX_ID = 2**63 - 1


def _parse_cursor(after: str, *, by_time: bool) -> tuple[Any, int]:
    """A page cursor ``VALUE|ID`` as :func:`list_page` wrote it; ValueError for anything else."""
    value, sep, row_id = after.rpartition("|")
    if not sep or not re.fullmatch(r"[0-9]{1,19}", row_id) or int(row_id) > _MAX_ID:
        raise ValueError("not a page cursor")
    if not by_time:
        return value or None, int(row_id)
    try:
        return datetime.fromisoformat(value), int(row_id)
    except ValueError:
        raise ValueError("not a page cursor") from None


def matching_ids(connection: Connection, f: Filter, limit: int = BULK_LIMIT) -> tuple[list[int], bool]:
    """The ids ``f`` selects, oldest in their state first, at most ``limit`` (and whether more
    match): what a bulk action previews."""
    where, params = _where(f)
    order = _order(f)
    sort = "id" if order in ("-id", "key") else f"{order}, id"
    ids = [
        int(r[0])
        for r in connection.execute(
            text(f"SELECT id FROM outbox_message WHERE {where} ORDER BY {sort} LIMIT :limit"),
            {**params, "limit": limit + 1},
        )
    ]
    return ids[:limit], len(ids) > limit


# -- the row page's extras ---------------------------------------------------------------------------

_ROW_EXTRAS = text("SELECT batch_id, parent_id, via FROM outbox_message WHERE id = :id")


def row_extras(connection: Connection, row_id: int) -> dict[str, Any]:
    r = connection.execute(_ROW_EXTRAS, {"id": row_id}).mappings().first()
    return dict(r) if r else {}


_BATCHES = text(
    """
SELECT id, name, created_at, finished_at, outcome, total, sent, failed, cancelled
FROM outbox_batch
WHERE (CAST(:before AS bigint) IS NULL OR id < CAST(:before AS bigint))
ORDER BY id DESC LIMIT :limit
"""
)


def batches(
    connection: Connection, *, before: int | None = None, limit: int = PAGE_ROWS
) -> list[dict[str, Any]]:
    return [dict(r) for r in connection.execute(_BATCHES, {"before": before, "limit": limit}).mappings()]


#: A duration typed in a filter or a pause: longer than this is a typo (and overflows an interval).
MAX_DURATION_SECONDS = 100 * 365 * 86400


def parse_duration(value: str | None) -> float | None:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d`` → seconds; empty → None. ValueError otherwise."""
    if not value or not value.strip():
        return None
    m = re.fullmatch(r"\s*([0-9]{1,12}(?:\.[0-9]{1,6})?)\s*([smhd]?)\s*", value)
    if not m:
        raise ValueError(f"{value[:40]!r} is not a duration (e.g. 90s, 15m, 2h, 1d)")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    seconds = float(m.group(1)) * unit
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"{value[:40]!r} is longer than 100 years")
    return seconds


def describe_age(value: float | None) -> str:
    if value is None:
        return "-"
    return str(timedelta(seconds=int(value))) if value >= 0 else f"in {timedelta(seconds=int(-value))}"
