#!/usr/bin/env python
"""Soak: live traffic over millions of terminal rows and ledger keys, with the purge and the ledger
horizon at equilibrium. Prints figures; not a test.

What it does, in order (see bench/README.md, "Soak and bytes per delivery"):

1. A database of its own (``bench_soak``), migrated, with ``docs/production.md``'s per-table
   autovacuum settings (``--table-settings``); the fast provider, ``outbox worker`` and ``outbox
   relay`` started.
2. Calibration: the live writer (``bench/steady.py``'s: an ``orders`` INSERT plus ``outbox.write``,
   one commit) writes a few hundred rows that the real path delivers; half of them are then
   purged into the key ledger by the purge's own statement. One delivered row, its attempt row
   and one ledger entry are kept as templates (``soak_template_*``).
3. Pre-seed: ``--preseed`` N copies of the delivered row (each with its attempt row) and
   ``--ledger`` M copies of the ledger entry, inserted in bulk by the server (``INSERT … SELECT``
   over ``generate_series``, triggers off for the session), every column as the template has it
   except the key, the payload's amount, the claim token, the provider's reference and the
   timestamps. Completion times are spread evenly over the window that makes rows cross the
   retention at ``--purge-rate`` rows/s (W = N / rate) and ledger entries cross the horizon at
   ``--ledger-rate`` (W_l = M / rate, older than the rows). Then VACUUM ANALYZE and a CHECKPOINT.
4. ``outbox reconcile`` starts with OUTBOX_RETENTION = W plus the time the pre-seed took and
   OUTBOX_LEDGER_HORIZON = W + W_l plus the same: the oldest row stands at the retention and the
   oldest entry at the horizon the moment it starts.
5. ``--minutes`` of steady traffic: the writer at ``--rate`` rows/s, and a filler that inserts
   ``--fill-rate`` already-delivered rows a second (default: purge rate - live rate) so that as
   many rows arrive as the purge removes; its rows go to another destination and are not counted
   as deliveries.

Every ``--report-every`` seconds one line: live deliveries/s and commit → confirmed p50/p99 (the
database's ``completed_at - created_at`` of the live destination's rows), the worker's claim and
the relay's take (client-side statement times, ``bench/soak_handlers.py``), the purge (rows/s
leaving ``outbox_message``, its statements' p99 and busy seconds, lock waits sampled from
``pg_stat_activity``), ledger in/out, rows past the retention not yet purged, table + index +
TOAST sizes, dead tuples, vacuums, and WAL bytes per delivery and per row entering history
(``pg_current_wal_lsn``: server-wide). At the end: first tenth against last tenth, sizes at the
start and the end, and bytes per delivered row and per ledger key.

The machine's PostgreSQL may run with ``autovacuum = off`` (this repository's CI server does):
then, unless ``--vacuum server``, the bench stands in for it, with autovacuum's own rule (every
``autovacuum_naptime``, each table whose dead or inserted tuples pass its threshold, at its
cost delay); ``--vacuum none`` measures what no vacuum does.

Servers: ``--database-url``/``--redis-url``, else ``OUTBOX_DATABASE_URL``/``OUTBOX_REDIS_URL``,
else the machine's ``postgresql://postgres@127.0.0.1:5432/test`` and ``redis://…:6379/9``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

from bench import common, e2e  # noqa: E402
from bench.soak_handlers import quantile, read_dumps  # noqa: E402
from bench.steady import _steady_writer, _wal_lsn  # noqa: E402
from outbox import store  # noqa: E402
from outbox.settings import libpq_url  # noqa: E402

MACHINE_REDIS_URL = "redis://127.0.0.1:6379/9"
DATABASE = "bench_soak"
NAMESPACE = "benchsoak"
#: The writer's destination (bench/e2e_handlers.py); the filler's rows go to another one, of the
#: same length, so that they can be told apart.
LIVE = "payments.charge"
FILLER = "payments.refund"
TABLES = ("outbox_message", "outbox_attempt", "outbox_key_ledger")
#: Keys are ``order:<n>``: ledger entries from KEY_BASE, pre-seeded rows after them, then the
#: live orders' ids (``orders`` restarts there), which the filler's rows share: 8 digits up to
#: 90 million.
KEY_BASE = 10_000_000
CALIBRATION_ROWS = 200
PRESEED_CHUNK = 50_000
LEDGER_CHUNK = 200_000
#: Live rows completed in the last seconds may not be committed yet: each interval reads the
#: window that ended this long before its tick.
COMMIT_LAG_SECONDS = 2.0
#: docs/production.md, "Autovacuum on a hot queue table".
PRODUCTION_SETTINGS = {
    "outbox_message": "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 1",
    "outbox_attempt": "autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_insert_scale_factor = 0.05",
    "outbox_key_ledger": "autovacuum_vacuum_scale_factor = 0.02",
}
TARGET = 0.10  # last tenth within 10 % of the first


@dataclass(frozen=True)
class Plan:
    """The arithmetic of the history: how many rows and entries, over which windows."""

    preseed: int
    ledger: int
    purge_rate: float
    ledger_rate: float
    rate: float
    fill_rate: float
    seconds: float

    @property
    def window(self) -> float:
        """Seconds of completions the pre-seeded rows span: they cross the retention at purge_rate."""
        return self.preseed / self.purge_rate

    @property
    def ledger_window(self) -> float:
        return self.ledger / self.ledger_rate

    @property
    def preseed_base(self) -> int:
        return KEY_BASE + self.ledger

    @property
    def orders_start(self) -> int:
        """The live orders' first id (the filler draws from the same sequence)."""
        return self.preseed_base + self.preseed


# -- templates: what the real path leaves behind ----------------------------------------------------


def _columns(conn: psycopg.Connection[Any], table: str) -> list[tuple[str, str]]:
    """(name, type) of the columns an INSERT must fill: not identity, not generated."""
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped "
            "AND attidentity = '' AND attgenerated = '' ORDER BY attnum",
            (table,),
        ).fetchall()
    ]


def _select(
    columns: list[tuple[str, str]], alias: str, overrides: dict[str, str], shift: str
) -> tuple[sql.Composable, sql.Composable]:
    """The column list and the SELECT list that copy template ``alias`` with ``overrides`` (SQL
    by column) and every other timestamp moved by ``shift`` (an interval expression)."""
    names, exprs = [], []
    for name, kind in columns:
        names.append(sql.Identifier(name))
        if name in overrides:
            exprs.append(sql.SQL(overrides[name]))
        elif kind == "timestamp with time zone":
            exprs.append(
                sql.SQL("{}.{} + ({})").format(sql.Identifier(alias), sql.Identifier(name), sql.SQL(shift))
            )
        else:
            exprs.append(sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(name)))
    return sql.SQL(", ").join(names), sql.SQL(", ").join(exprs)


#: The completion time of the ``i``-th copy (from 1): evenly spaced from ``first``.
_TARGET = "(%(first)s::timestamptz + (i - 1) * %(step)s * interval '1 second')"


class Seeder:
    """Inserts copies of the templates: delivered rows with their attempt rows, ledger entries."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        message = _columns(conn, "outbox_message")
        names, exprs = _select(
            message,
            "t",
            {
                "key": "'order:' || g",
                "destination": "%(destination)s",
                "payload": "jsonb_set(t.payload, '{amount_cents}', to_jsonb(1000 + g %% 500), false)",
                "provider_ref": "'ch_' || g",
                "response": "jsonb_set(t.response, '{id}', to_jsonb('ch_' || g), false)",
                "claim_token": "CASE WHEN t.claim_token IS NOT NULL THEN gen_random_uuid() END",
                "completed_at": _TARGET,
            },
            f"{_TARGET} - t.completed_at",
        )
        same_token = conn.execute(
            "SELECT a.claim_token = t.claim_token FROM soak_template_attempt a, soak_template_message t"
        ).fetchone()
        a_names, a_exprs = _select(
            _columns(conn, "outbox_attempt"),
            "a",
            {
                "message_id": "m.id",
                "claim_token": "m.claim_token" if same_token and same_token[0] else "gen_random_uuid()",
            },
            "m.completed_at - t.completed_at",
        )
        self.rows = sql.SQL(
            "WITH m AS (INSERT INTO outbox_message ({names}) SELECT {exprs} "
            "FROM unnest(%(keys)s::bigint[]) WITH ORDINALITY AS u(g, i) CROSS JOIN soak_template_message t "
            "RETURNING id, claim_token, completed_at) "
            "INSERT INTO outbox_attempt ({a_names}) SELECT {a_exprs} "
            "FROM m CROSS JOIN soak_template_attempt a CROSS JOIN soak_template_message t"
        ).format(names=names, exprs=exprs, a_names=a_names, a_exprs=a_exprs)
        l_names, l_exprs = _select(
            _columns(conn, "outbox_key_ledger"),
            "t",
            {
                "message_id": "g",
                "key": "'order:' || g",
                "payload_hash": "sha256(int8send(g))",
                "provider_ref": "'ch_' || g",
                "completed_at": _TARGET,
            },
            f"{_TARGET} - t.completed_at",
        )
        self.entries = sql.SQL(
            "INSERT INTO outbox_key_ledger ({names}) SELECT {exprs} "
            "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g CROSS JOIN soak_template_ledger t "
            "CROSS JOIN LATERAL (SELECT g - %(lo)s + 1 AS i) u"
        ).format(names=l_names, exprs=l_exprs)

    @staticmethod
    def session(conn: psycopg.Connection[Any]) -> None:
        """Triggers off for this session (superuser): no NOTIFY, no insert guard probing for keys
        unique by construction, no foreign-key check of attempt rows inserted with their row."""
        with contextlib.suppress(psycopg.Error):
            conn.execute("SET session_replication_role = replica")

    def add_rows(
        self, conn: psycopg.Connection[Any], keys: list[int], first: datetime, step: float, destination: str
    ) -> None:
        """Rows ``order:<key>`` (and their attempts), the i-th completed at ``first`` + i x
        ``step`` seconds."""
        params = {"keys": keys, "first": first, "step": step, "destination": destination}
        conn.execute(self.rows, params)

    def add_entries(
        self, conn: psycopg.Connection[Any], lo: int, hi: int, first: datetime, step: float
    ) -> None:
        """Ledger entries ``order:lo`` … ``order:hi``, spaced likewise."""
        conn.execute(self.entries, {"lo": lo, "hi": hi, "first": first, "step": step})


def keep_templates(conn: psycopg.Connection[Any]) -> None:
    """One delivered row (first attempt, sent), its attempt row and one ledger entry, copied to
    tables of the bench's own: the originals are purged in their turn."""
    row = conn.execute(
        "SELECT id FROM outbox_message WHERE state = 'sent' AND attempts = 1 AND destination = %s "
        "ORDER BY id DESC LIMIT 1",
        (LIVE,),
    ).fetchone()
    entry = conn.execute(
        "SELECT message_id FROM outbox_key_ledger ORDER BY message_id DESC LIMIT 1"
    ).fetchone()
    if row is None or entry is None:
        raise RuntimeError("calibration: no delivered row or no ledger entry to copy")
    for name, source in (
        ("soak_template_message", sql.SQL("SELECT * FROM outbox_message WHERE id = {}").format(row[0])),
        (
            "soak_template_attempt",
            sql.SQL("SELECT * FROM outbox_attempt WHERE message_id = {}").format(row[0]),
        ),
        (
            "soak_template_ledger",
            sql.SQL("SELECT * FROM outbox_key_ledger WHERE message_id = {}").format(entry[0]),
        ),
    ):
        conn.execute(sql.SQL("CREATE TABLE {} AS {}").format(sql.Identifier(name), source))
    (attempts,) = conn.execute("SELECT count(*) FROM soak_template_attempt").fetchone() or (0,)
    if attempts != 1:
        raise RuntimeError(f"calibration: the template row has {attempts} attempt rows, not 1")


def preseed(conn: psycopg.Connection[Any], seeder: Seeder, plan: Plan, now: datetime) -> None:
    """The history: ledger entries over [now - W - W_l, now - W), rows over [now - W, now)."""
    Seeder.session(conn)
    ledger_first = now - timedelta(seconds=plan.window + plan.ledger_window)
    rows_first = now - timedelta(seconds=plan.window)
    jobs: list[tuple[str, int, int, int]] = [("ledger", KEY_BASE, plan.ledger, LEDGER_CHUNK)]
    jobs.append(("rows", plan.preseed_base, plan.preseed, PRESEED_CHUNK))
    for what, base, count, chunk in jobs:
        if count <= 0:
            continue
        t0, shown = time.monotonic(), 0
        for lo in range(base, base + count, chunk):
            hi = min(lo + chunk, base + count) - 1
            if what == "ledger":
                first = ledger_first + timedelta(seconds=(lo - base) * plan.ledger_window / count)
                seeder.add_entries(conn, lo, hi, first, plan.ledger_window / count)
            else:
                first = rows_first + timedelta(seconds=(lo - base) * plan.window / count)
                seeder.add_rows(conn, list(range(lo, hi + 1)), first, plan.window / count, LIVE)
            done = hi - base + 1
            if done * 10 // count > shown:
                shown = done * 10 // count
                rate = done / (time.monotonic() - t0)
                print(f"  pre-seed {what}: {done:,}/{count:,} ({rate:,.0f}/s)", flush=True)


# -- what runs beside the processes ---------------------------------------------------------------


class Filler(threading.Thread):
    """Delivered rows arriving at ``rate`` a second (completed now), so that the message table
    gains what the purge takes; one statement a second. Their keys come from the live orders'
    sequence: live and filler keys grow together, as one application's would, and land at the
    right end of every index on the key."""

    def __init__(self, url: str, seeder: Seeder, rate: float) -> None:
        super().__init__(name="soak-filler", daemon=True)
        self.url, self.seeder, self.rate = url, seeder, rate
        self.stop = threading.Event()
        self.inserted = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with common.connect(self.url) as conn:
                Seeder.session(conn)
                start = time.monotonic()
                while not self.stop.wait(1.0):
                    n = int((time.monotonic() - start) * self.rate) - self.inserted
                    if n <= 0:
                        continue
                    now, keys = conn.execute(
                        "SELECT now(), array_agg(nextval(pg_get_serial_sequence('orders', 'id'))) "
                        "FROM generate_series(1, %s)",
                        (n,),
                    ).fetchone()  # type: ignore[misc]
                    self.seeder.add_rows(conn, keys, now, 0.0, FILLER)
                    self.inserted += n
        except BaseException as exc:  # reported by the main loop
            self.error = exc


class Sampler(threading.Thread):
    """``pg_stat_activity`` of the bench database ``hz`` times a second: lock waits of the purge's
    connection, of anyone the purge blocks, and of every connection by its application name
    (``lock:NAME``; the relay's and the bench's have none)."""

    FIELDS = ("samples", "purge_active", "purge_lock", "blocked_by_purge", "lock_any")

    def __init__(self, url: str, hz: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.url, self.hz = url, hz
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(self.FIELDS, 0)

    def take(self) -> dict[str, int]:
        with self.lock:
            counts, self.counts = self.counts, dict.fromkeys(self.FIELDS, 0)
        return counts

    def run(self) -> None:
        with common.connect(self.url) as conn:
            while not self.stop.wait(1 / self.hz):
                rows = conn.execute(
                    "SELECT pid, application_name LIKE 'outbox-reconcile-purge%%', state = 'active', "
                    "wait_event_type = 'Lock', split_part(application_name, '/', 1), "
                    "CASE WHEN wait_event_type = 'Lock' THEN pg_blocking_pids(pid) END "
                    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
                purge = {r[0] for r in rows if r[1]}
                with self.lock:
                    c = self.counts
                    c["samples"] += 1
                    c["purge_active"] += any(r[1] and r[2] for r in rows)
                    c["purge_lock"] += any(r[1] and r[3] for r in rows)
                    c["blocked_by_purge"] += sum(1 for r in rows if r[5] and purge & set(r[5]))
                    c["lock_any"] += sum(1 for r in rows if r[3])
                    for r in rows:
                        if r[3]:
                            c[f"lock:{r[4] or '-'}"] = c.get(f"lock:{r[4] or '-'}", 0) + 1


class VacuumStandIn(threading.Thread):
    """Autovacuum's rule, run by the bench on a server whose autovacuum is off: every naptime, each
    table of the database whose dead tuples (or inserts) pass ``threshold + scale_factor x
    reltuples`` (the table's own settings, else the server's) is vacuumed at autovacuum's cost
    delay, and analyzed when its changes pass the analyze threshold."""

    def __init__(self, url: str) -> None:
        super().__init__(name="soak-vacuum", daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.runs: dict[str, int] = {}
        self.seconds = 0.0
        self.conn: psycopg.Connection[Any] | None = None

    def cancel(self) -> None:
        self.stop.set()
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.cancel_safe()

    def run(self) -> None:
        with common.connect(self.url) as conn:
            self.conn = conn
            server = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings "
                    "WHERE name LIKE 'autovacuum%%' OR name LIKE 'vacuum_cost%%'"
                ).fetchall()
            )
            naptime = float(server.get("autovacuum_naptime", 60))
            while not self.stop.wait(naptime):
                tables = conn.execute(
                    "SELECT s.relname, c.reltuples, s.n_dead_tup, s.n_ins_since_vacuum, "
                    "s.n_mod_since_analyze, COALESCE(c.reloptions, '{}') "
                    "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid"
                ).fetchall()
                for name, reltuples, dead, inserted, modified, reloptions in tables:
                    if self.stop.is_set():
                        return
                    own = dict(o.split("=", 1) for o in reloptions)

                    def setting(key: str, own: dict[str, str] = own) -> float:
                        return float(own.get(key, server.get(key, 0)))

                    live = max(float(reltuples), 0.0)
                    vacuum = (
                        dead
                        > setting("autovacuum_vacuum_threshold")
                        + setting("autovacuum_vacuum_scale_factor") * live
                        or inserted
                        > setting("autovacuum_vacuum_insert_threshold")
                        + setting("autovacuum_vacuum_insert_scale_factor") * live
                    )
                    analyze = (
                        modified
                        > setting("autovacuum_analyze_threshold")
                        + setting("autovacuum_analyze_scale_factor") * live
                    )
                    if not (vacuum or analyze):
                        continue
                    delay = setting("autovacuum_vacuum_cost_delay")
                    limit = setting("autovacuum_vacuum_cost_limit")
                    conn.execute(f"SET vacuum_cost_delay = {delay:g}")
                    conn.execute(
                        f"SET vacuum_cost_limit = {limit if limit > 0 else setting('vacuum_cost_limit'):g}"
                    )
                    what = "VACUUM (ANALYZE)" if vacuum and analyze else "VACUUM" if vacuum else "ANALYZE"
                    t0 = time.monotonic()
                    try:
                        conn.execute(sql.SQL(what + " {}").format(sql.Identifier(name)))
                    except psycopg.errors.QueryCanceled:
                        return
                    self.seconds += time.monotonic() - t0
                    self.runs[name] = self.runs.get(name, 0) + 1


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Tables:
    """pg_stat_user_tables and sizes of the outbox tables at one moment."""

    at: float
    heap: dict[str, int]
    indexes: dict[str, int]
    toast: dict[str, int]
    stats: dict[str, dict[str, int]]

    def total(self, table: str) -> int:
        return self.heap[table] + self.indexes[table] + self.toast[table]


def read_tables(conn: psycopg.Connection[Any]) -> Tables:
    heap, indexes, toast, stats = {}, {}, {}, {}
    for row in conn.execute(
        "SELECT c.relname, pg_table_size(c.oid) - COALESCE(pg_total_relation_size(c.reltoastrelid), 0), "
        "pg_indexes_size(c.oid), COALESCE(pg_total_relation_size(c.reltoastrelid), 0), "
        "s.n_live_tup, s.n_dead_tup, s.n_tup_ins, s.n_tup_del, s.autovacuum_count, s.vacuum_count, "
        "s.autoanalyze_count, s.analyze_count "
        "FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.relname = ANY(%s)",
        (list(TABLES),),
    ).fetchall():
        name = row[0]
        heap[name], indexes[name], toast[name] = int(row[1]), int(row[2]), int(row[3])
        keys = ("live", "dead", "ins", "del", "autovacuum", "vacuum", "autoanalyze", "analyze")
        stats[name] = {k: int(v or 0) for k, v in zip(keys, row[4:], strict=True)}
    return Tables(time.monotonic(), heap, indexes, toast, stats)


@dataclass
class Interval:
    """One report line's figures."""

    t: float
    seconds: float
    deliveries: int
    p50_ms: float
    p99_ms: float
    claim: tuple[float, float]
    take: tuple[float, float]
    purge_stmt_p99_ms: float
    drop_stmt_p99_ms: float
    purge_busy_s: float
    purged: int
    ledger_in: int
    ledger_out: int
    overdue: int
    overdue_age_s: float
    mb: dict[str, float]
    dead: dict[str, int]
    vacuums: int
    analyzes: int
    wal: int
    filled: int
    lock: dict[str, int] = field(default_factory=dict)
    provider_requests: int = 0
    #: The whole machine's busy CPU over the interval, a fraction of all its cores.
    cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.deliveries / self.seconds if self.seconds else 0.0


def _ms(counts: list[int], q: float) -> float:
    return quantile(counts, q) * 1e3


HEADER = (
    f"{'t s':>6}{'deliv/s':>8}{'p50':>6}{'p99':>6} {'claim 50/99':>12} {'take 50/99':>11}{'purge/s':>8}"
    f"{'stmt99':>7}{'busy':>5}{'lockw':>6}{'led+/s':>7}{'led-/s':>7}{'overdue':>8}"
    f"{'msg MB':>8}{'att MB':>7}{'led MB':>7}{'dead k m/a/l':>15}{'vac':>4}{'WAL/dlv':>8}{'WAL/row':>8}"
    f"{'cpu':>5}"
)


def line(i: Interval) -> str:
    s = i.seconds
    rows_in = i.deliveries + i.filled
    return (
        f"{i.t:>6.0f}{i.rate:>8.0f}{i.p50_ms:>6.0f}{i.p99_ms:>6.0f} "
        f"{i.claim[0]:>5.1f}/{i.claim[1]:<6.1f} {i.take[0]:>4.1f}/{i.take[1]:<6.1f}"
        f"{i.purged / s:>8.0f}{i.purge_stmt_p99_ms:>7.0f}{i.purge_busy_s:>5.1f}"
        f"{i.lock.get('purge_lock', 0) + i.lock.get('blocked_by_purge', 0):>6}"
        f"{i.ledger_in / s:>7.0f}{i.ledger_out / s:>7.0f}{i.overdue:>8}"
        f"{i.mb['outbox_message']:>8.0f}{i.mb['outbox_attempt']:>7.0f}{i.mb['outbox_key_ledger']:>7.0f}"
        f"{'/'.join(str(round(i.dead[t] / 1000)) for t in TABLES):>15}{i.vacuums:>4}"
        f"{i.wal / max(i.deliveries, 1):>8.0f}{i.wal / max(rows_in, 1):>8.0f}{i.cpu:>5.0%}"
    )


class Meter:
    """Reads one interval's figures at each tick."""

    def __init__(
        self,
        admin_url: str,
        url: str,
        times_dir: Path,
        retention: float,
        sampler: Sampler,
        filler: Filler | None,
    ) -> None:
        self.admin_url, self.conn, self.times_dir = admin_url, common.connect(url), times_dir
        self.retention, self.sampler, self.filler = retention, sampler, filler
        self.completed = array("d")  # epoch of each live delivery
        self.latency = array("d")  # its commit -> confirmed, seconds
        self.tables = self.first_tables = read_tables(self.conn)
        self.times = read_dumps(str(times_dir))
        self.wal = _wal_lsn(admin_url)
        self.filled = 0
        self.t0 = time.monotonic()
        self.busy = self._busy()
        self.tick_db = self._now()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(t.user + t.system + t.nice + getattr(t, "irq", 0) + getattr(t, "softirq", 0))

    def _cpu(self, seconds: float) -> float:
        before, self.busy = self.busy, self._busy()
        return (self.busy - before) / max(seconds, 1e-9) / (psutil.cpu_count() or 1)

    def _now(self) -> datetime:
        (now,) = self.conn.execute("SELECT now()").fetchone()  # type: ignore[misc]
        return now  # type: ignore[no-any-return]

    def _live(self, until: datetime) -> list[float]:
        """Commit -> confirmed of the live rows completed from the last read to ``until``
        (kept for the summary), sorted."""
        lag = timedelta(seconds=COMMIT_LAG_SECONDS)
        rows = self.conn.execute(
            "SELECT EXTRACT(EPOCH FROM completed_at), EXTRACT(EPOCH FROM completed_at - created_at) "
            "FROM outbox_message WHERE state = 'sent' AND destination = %s "
            "AND completed_at >= %s AND completed_at < %s",
            (LIVE, self.tick_db - lag, until),
        ).fetchall()
        for r in rows:
            self.completed.append(float(r[0]))
            self.latency.append(float(r[1]))
        return sorted(float(r[1]) for r in rows)

    def finish(self) -> None:
        """The deliveries of the last seconds, once they are committed."""
        time.sleep(COMMIT_LAG_SECONDS)
        self._live(self._now())

    def tick(self, provider_url: str) -> Interval:
        now = self._now()
        lat = self._live(now - timedelta(seconds=COMMIT_LAG_SECONDS))
        window = (now - self.tick_db).total_seconds()
        self.tick_db = now
        counts, sums = read_dumps(str(self.times_dir))
        d = {k: [a - b for a, b in zip(counts[k], self.times[0][k], strict=True)] for k in counts}
        busy = sums["purge"] - self.times[1]["purge"] + sums["ledger_drop"] - self.times[1]["ledger_drop"]
        self.times = (counts, sums)
        tables = read_tables(self.conn)
        before, self.tables = self.tables, tables
        st, sb = tables.stats, before.stats
        overdue, age = self.conn.execute(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(completed_at)) - %(r)s, 0) "
            "FROM outbox_message WHERE state IN ('sent', 'cancelled') "
            "AND completed_at < now() - %(r)s * interval '1 second'",
            {"r": self.retention},
        ).fetchone()  # type: ignore[misc]
        wal = _wal_lsn(self.admin_url)
        wal_delta, self.wal = wal - self.wal, wal
        filled = self.filler.inserted if self.filler else 0
        filled_delta, self.filled = filled - self.filled, filled
        stats = e2e.provider_stats(provider_url)
        e2e.provider_reset(provider_url)
        n = len(lat)
        return Interval(
            t=time.monotonic() - self.t0,
            seconds=window,
            deliveries=n,
            p50_ms=statistics.median(lat) * 1e3 if lat else 0.0,
            p99_ms=lat[min(n - 1, int(0.99 * n))] * 1e3 if lat else 0.0,
            claim=(_ms(d["claim"], 0.5), _ms(d["claim"], 0.99)),
            take=(_ms(d["take"], 0.5), _ms(d["take"], 0.99)),
            purge_stmt_p99_ms=_ms(d["purge"], 0.99),
            drop_stmt_p99_ms=_ms(d["ledger_drop"], 0.99),
            purge_busy_s=busy,
            purged=st["outbox_message"]["del"] - sb["outbox_message"]["del"],
            ledger_in=st["outbox_key_ledger"]["ins"] - sb["outbox_key_ledger"]["ins"],
            ledger_out=st["outbox_key_ledger"]["del"] - sb["outbox_key_ledger"]["del"],
            overdue=int(overdue),
            overdue_age_s=float(age),
            mb={t: tables.total(t) / 1e6 for t in TABLES},
            dead={t: st[t]["dead"] for t in TABLES},
            vacuums=sum(
                st[t]["autovacuum"] + st[t]["vacuum"] - sb[t]["autovacuum"] - sb[t]["vacuum"] for t in TABLES
            ),
            analyzes=sum(
                st[t]["autoanalyze"] + st[t]["analyze"] - sb[t]["autoanalyze"] - sb[t]["analyze"]
                for t in TABLES
            ),
            wal=wal_delta,
            filled=filled_delta,
            lock=self.sampler.take(),
            provider_requests=int(stats.get("requests", 0)),
            cpu=self._cpu(window),
        )


# -- bytes ------------------------------------------------------------------------------------------


def bytes_report(conn: psycopg.Connection[Any], sample_rows: int = 100_000) -> list[str]:
    """Where the bytes of each outbox table go: rows, heap (live tuples, dead, free), each index,
    TOAST, and the average stored size of each column (a sample of ``sample_rows``)."""
    out = []
    has_stattuple = True
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    except psycopg.Error:
        has_stattuple = False
    for table in TABLES:
        (rows,) = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()  # type: ignore[misc]
        heap, toast, fsm_vm = conn.execute(
            "SELECT pg_relation_size(c.oid), COALESCE(pg_total_relation_size(c.reltoastrelid), 0), "
            "pg_relation_size(c.oid, 'fsm') + pg_relation_size(c.oid, 'vm') "
            "FROM pg_class c WHERE c.oid = to_regclass(%s)",
            (table,),
        ).fetchone()  # type: ignore[misc]
        per = max(int(rows), 1)
        out.append(
            f"{table}: {rows:,} rows; heap {heap / 1e6:,.1f} MB = {heap / per:,.0f} B/row, "
            f"fsm+vm {fsm_vm / per:.0f} B/row, TOAST {toast / per:.0f} B/row"
        )
        if has_stattuple:
            tl, tc, dl, fs = conn.execute(
                "SELECT approx_tuple_len, approx_tuple_count, dead_tuple_len, approx_free_space "
                "FROM pgstattuple_approx(to_regclass(%s))",
                (table,),
            ).fetchone()  # type: ignore[misc]
            out.append(
                f"  heap (pgstattuple_approx): live tuples ~{tl / max(tc, 1):,.0f} B each, "
                f"dead {dl / per:,.0f} B/row, free space {fs / per:,.0f} B/row "
                f"({fs / max(heap, 1):.0%} of the heap)"
            )
        for name, size, definition in conn.execute(
            "SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid), "
            "pg_get_indexdef(i.indexrelid) "
            "FROM pg_index i WHERE i.indrelid = to_regclass(%s) ORDER BY 2 DESC",
            (table,),
        ).fetchall():
            density = ""
            if has_stattuple and size > 8192:
                (leaf,) = conn.execute("SELECT avg_leaf_density FROM pgstatindex(%s)", (name,)).fetchone()  # type: ignore[misc]
                density = f", leaf density {leaf:.0f} %"
            where = definition.split(" WHERE ", 1)[1] if " WHERE " in definition else "all rows"
            using = definition.split(" USING ", 1)[1].split(" WHERE ")[0]
            out.append(f"  index {name} {using} [{where}]: {size / per:,.1f} B/row{density}")
        columns = [c for c, _ in _columns(conn, table)] + (["id"] if table != "outbox_key_ledger" else [])
        fraction = min(100.0, 100.0 * sample_rows / per)
        avg = conn.execute(
            sql.SQL("SELECT avg(pg_column_size(s.*)), {} FROM {} s TABLESAMPLE SYSTEM ({})").format(
                sql.SQL(", ").join(
                    sql.SQL("avg(COALESCE(pg_column_size({}), 0)), avg(({} IS NULL)::int)").format(
                        sql.Identifier(c), sql.Identifier(c)
                    )
                    for c in columns
                ),
                sql.Identifier(table),
                sql.Literal(fraction),
            )
        ).fetchone()
        if avg and avg[0] is not None:
            sizes = {c: float(avg[1 + 2 * k]) for k, c in enumerate(columns)}
            nulls = {c: float(avg[2 + 2 * k]) for k, c in enumerate(columns)}
            data = sum(sizes.values())
            shown = ", ".join(
                f"{c} {v:.0f}" for c, v in sorted(sizes.items(), key=lambda kv: -kv[1]) if v >= 0.5
            )
            always_null = [c for c in columns if nulls[c] >= 0.999]
            out.append(
                f"  row datum {float(avg[0]):.0f} B = columns {data:.0f} B + header, null bitmap and "
                f"alignment {float(avg[0]) - data:.0f} B; by column: {shown}"
            )
            if always_null:
                out.append(f"  always NULL here ({len(always_null)}): {', '.join(always_null)}")
    return out


# -- the run ----------------------------------------------------------------------------------------


def _start(args: argparse.Namespace, env: dict[str, str], log: Path, main: str, *command: str) -> Any:
    """``python -m MAIN --log-level LEVEL COMMAND…`` from the repository root, logged to ``log``."""
    return e2e.start_logged([sys.executable, "-m", main, "--log-level", args.log_level, *command], log, env)


def start_processes(
    args: argparse.Namespace, env: dict[str, str], workdir: Path, redis_url: str
) -> tuple[Any, Any]:
    """``outbox worker`` and the relay (through bench.soak_handlers, timed), ready."""
    workers = _start(
        args,
        env,
        workdir / "worker.log",
        "outbox",
        *(
            "worker",
            "bench.soak_handlers",
            "--processes",
            str(args.processes),
            "--concurrency",
            str(args.threads),
        ),
    )
    relay = _start(args, env, workdir / "relay.log", "bench.soak_handlers", "relay")
    beats = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        common.wait_for(
            lambda: (
                int(beats.zcard(f"{NAMESPACE}:__heartbeats__")) >= args.processes
                or workers.poll() is not None
                or relay.poll() is not None
            ),
            60,
            "the outbox workers to start",
            0.1,
        )
    finally:
        beats.close()
    if workers.poll() is not None or relay.poll() is not None:
        raise RuntimeError(f"a worker or the relay exited at start; logs in {workdir}")
    return workers, relay


@contextlib.contextmanager
def writer(url: str, rate: float, seconds: float) -> Iterator[Any]:
    """bench/steady.py's writer process, started (it waits for ``go``); yields (go, results)."""
    ctx = multiprocessing.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=_steady_writer, args=(url, rate, seconds, 0, 1, "outbox", go, results), daemon=True
    )
    proc.start()
    try:
        kind, _n, info = results.get(timeout=60)
        if kind != "ready":
            raise RuntimeError(f"writer failed: {info}")
        yield go, results
    finally:
        proc.join(seconds + 60 if go.is_set() else 1)
        if proc.is_alive():
            proc.kill()


def calibrate(url: str, seeder_conn: psycopg.Connection[Any], timeout: float) -> None:
    """Real deliveries to copy: CALIBRATION_ROWS written and delivered, half of them purged into
    the ledger by the purge's own statement."""
    with writer(url, 100.0, CALIBRATION_ROWS / 100.0) as (go, results):
        go.set()
        kind, written, info = results.get(timeout=60)
        if kind != "done":
            raise RuntimeError(f"writer failed: {info}")
    common.wait_for(
        lambda: (
            (
                seeder_conn.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()
                or (0,)
            )[0]
            >= written
        ),
        timeout,
        "the calibration rows to be delivered",
        0.2,
    )
    store.recovery.purge(seeder_conn, retention_seconds=0.001, limit=written // 2)
    keep_templates(seeder_conn)
    # Gone before the pre-seed: its keys and times, higher than all the pre-seeded ones, would
    # make every pre-seeded index entry land left of them, splitting pages in halves instead of
    # filling them as entries appended at the right end do (an index's state after bulk loading
    # is then half empty, which no real history gives).
    seeder_conn.execute("DELETE FROM outbox_message")
    seeder_conn.execute("DELETE FROM outbox_key_ledger")
    for table in TABLES:
        seeder_conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(table)))


def summarize(
    args: argparse.Namespace, plan: Plan, meter: Meter, intervals: list[Interval], wall: float
) -> list[str]:
    out = []
    if not meter.completed:
        return ["no live delivery was measured"]
    start, end = min(meter.completed), max(meter.completed)
    tenth = (end - start) / 10

    def window(a: float, b: float) -> tuple[float, float]:
        lat = sorted(x for t, x in zip(meter.completed, meter.latency, strict=True) if a <= t < b)
        n = len(lat)
        return n / (b - a), (lat[min(n - 1, int(0.99 * n))] * 1e3 if lat else 0.0)

    (r1, p1), (r2, p2) = window(start, start + tenth), window(end - tenth, end)
    k = max(1, len(intervals) // 10)
    first, last = intervals[:k], intervals[-k:]

    def mean(xs: list[Interval], f: Any) -> float:
        return statistics.fmean(f(x) for x in xs) if xs else 0.0

    verdict = "met" if abs(r2 - r1) <= TARGET * r1 and p2 <= (1 + TARGET) * p1 else "MISSED"
    out.append(
        f"first tenth vs last tenth ({tenth:.0f} s each): deliveries/s {r1:.1f} -> {r2:.1f} "
        f"({(r2 / r1 - 1) if r1 else 0:+.1%}), commit->confirmed p99 {p1:.0f} -> {p2:.0f} ms "
        f"({(p2 / p1 - 1) if p1 else 0:+.1%}); target within {TARGET:.0%}: {verdict}"
    )
    for label, f in (
        ("claim p99 ms", lambda i: i.claim[1]),
        ("take p99 ms", lambda i: i.take[1]),
        ("purge rows/s", lambda i: i.purged / i.seconds),
        ("purge statement p99 ms", lambda i: i.purge_stmt_p99_ms),
        ("ledger drop statement p99 ms", lambda i: i.drop_stmt_p99_ms),
        ("WAL B per row in", lambda i: i.wal / max(i.deliveries + i.filled, 1)),
        ("machine CPU %", lambda i: i.cpu * 100),
    ):
        out.append(f"  {label}: first {k} interval(s) {mean(first, f):.1f}, last {k} {mean(last, f):.1f}")
    purged = sum(i.purged for i in intervals)
    seconds = sum(i.seconds for i in intervals)
    out.append(
        f"purge: {purged:,} rows in {seconds:.0f} s = {purged / seconds:.0f}/s offered {plan.purge_rate:g}/s "
        f"(+ the live rows' own after {plan.window:.0f} s); most rows past the retention at a tick: "
        f"{max(i.overdue for i in intervals):,}; lock waits sampled: "
        f"{sum(i.lock.get('purge_lock', 0) for i in intervals)} purge, "
        f"{sum(i.lock.get('blocked_by_purge', 0) for i in intervals)} blocked by it, "
        f"{sum(i.lock.get('lock_any', 0) for i in intervals)} any, of "
        f"{sum(i.lock.get('samples', 0) for i in intervals)} samples"
    )
    waiting: dict[str, int] = {}
    for i in intervals:
        for k, v in i.lock.items():
            if k.startswith("lock:"):
                waiting[k[5:]] = waiting.get(k[5:], 0) + v
    if waiting:
        out.append("  lock waits by connection: " + ", ".join(f"{k} {v}" for k, v in sorted(waiting.items())))
    ledger_in, ledger_out = sum(i.ledger_in for i in intervals), sum(i.ledger_out for i in intervals)
    out.append(
        f"ledger: +{ledger_in / seconds:.0f}/s -{ledger_out / seconds:.0f}/s "
        f"(horizon drop offered {plan.ledger_rate:g}/s)"
    )
    a, b = meter.first_tables, meter.tables
    out.append(f"{'sizes MB':<22}{'heap':>9}{'indexes':>9}{'toast':>7}{'total':>9}   (start -> end)")
    for t in TABLES:
        out.append(
            f"  {t:<20}{a.heap[t] / 1e6:>9.0f}{a.indexes[t] / 1e6:>9.0f}{a.toast[t] / 1e6:>7.0f}"
            f"{a.total(t) / 1e6:>9.0f} -> {b.heap[t] / 1e6:.0f} / {b.indexes[t] / 1e6:.0f} / "
            f"{b.toast[t] / 1e6:.0f} / {b.total(t) / 1e6:.0f}"
            f" ({b.total(t) / max(a.total(t), 1) - 1:+.1%})"
        )
    return out


def run(args: argparse.Namespace, admin_url: str, redis_url: str, workdir: Path) -> int:
    seconds = args.minutes * 60
    rate_gap = max(0.0, args.purge_rate - args.rate)
    plan = Plan(
        preseed=args.preseed,
        ledger=args.preseed if args.ledger is None else args.ledger,
        purge_rate=args.purge_rate,
        ledger_rate=args.purge_rate if args.ledger_rate is None else args.ledger_rate,
        rate=args.rate,
        fill_rate=rate_gap if args.fill_rate is None else args.fill_rate,
        seconds=seconds,
    )
    url = libpq_url(common.recreate_database(admin_url, args.database_name))
    statements = [e2e.ORDERS_DDL, f"ALTER TABLE orders ALTER COLUMN id RESTART WITH {plan.orders_start}"]
    if args.table_settings == "production":
        statements += [f"ALTER TABLE {t} SET ({s})" for t, s in PRODUCTION_SETTINGS.items()]
    common.migrate(url, *statements)
    common.clear_namespace(redis_url, NAMESPACE)
    times_dir = workdir / "times"
    times_dir.mkdir()
    with common.connect(url) as conn:
        (autovacuum,) = conn.execute("SHOW autovacuum").fetchone()  # type: ignore[misc]
    vacuum_mode = args.vacuum or ("server" if autovacuum == "on" else "bench")
    print(
        f"soak: pre-seed {plan.preseed:,} rows + {plan.ledger:,} ledger keys; live {plan.rate:g}/s for "
        f"{args.minutes:g} min; purge offered {plan.purge_rate:g}/s (rows span {plan.window:,.0f} s), ledger "
        f"drop {plan.ledger_rate:g}/s (entries span {plan.ledger_window:,.0f} s), filler "
        f"{plan.fill_rate:g}/s; workers {args.processes} x {args.threads}; server autovacuum "
        f"{autovacuum}, vacuum by {vacuum_mode}; "
        f"table settings {args.table_settings}; logs in {workdir}",
        flush=True,
    )
    with e2e.provider("fast", workdir, args.latency_ms) as (provider_url, _pproc):
        env = dict(
            os.environ,
            BENCH_PROVIDER_URL=provider_url,
            BENCH_SOAK_TIMES=str(times_dir),
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            OUTBOX_DATABASE_URL=url,
            OUTBOX_REDIS_URL=redis_url,
            OUTBOX_NAMESPACE=NAMESPACE,
            OUTBOX_POLL_INTERVAL="1",
        )
        procs: list[Any] = []
        threads: list[Any] = []
        try:
            procs.extend(start_processes(args, env, workdir, redis_url))
            with common.connect(url) as conn:
                calibrate(url, conn, 120)
                seeder = Seeder(conn)
                (seed_at,) = conn.execute("SELECT now()").fetchone()  # type: ignore[misc]
                wal0, t0 = _wal_lsn(admin_url), time.monotonic()
                preseed(conn, seeder, plan, seed_at)
                seeded = time.monotonic() - t0
                wal_seed = _wal_lsn(admin_url) - wal0
                total = plan.preseed + plan.ledger
                print(
                    f"pre-seed: {seeded:.0f} s ({total / max(seeded, 1e-9):,.0f} rows+keys/s), WAL "
                    f"{wal_seed / max(total, 1):.0f} B per row or key",
                    flush=True,
                )
                t1 = time.monotonic()
                conn.execute("RESET session_replication_role")
                for t in TABLES:
                    conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(t)))
                print(f"VACUUM ANALYZE: {time.monotonic() - t1:.0f} s", flush=True)
                if args.bytes:
                    print("bytes after the pre-seed:")
                    for text in bytes_report(conn):
                        print("  " + text)
                common.checkpoint(url)
                (elapsed,) = conn.execute("SELECT EXTRACT(EPOCH FROM now() - %s)", (seed_at,)).fetchone()  # type: ignore[misc]
            retention = plan.window + float(elapsed) + 1.0
            horizon = retention + plan.ledger_window
            renv = dict(
                env,
                OUTBOX_RETENTION=f"{retention:.3f}",
                OUTBOX_LEDGER_HORIZON=f"{horizon:.3f}",
                OUTBOX_RECONCILE_INTERVAL=str(args.reconcile_interval),
            )
            reconciler = _start(
                args, renv, workdir / "reconcile.log", "outbox", "reconcile", "bench.soak_handlers"
            )
            procs.append(reconciler)
            print(f"reconciler: retention {retention:,.0f} s, ledger horizon {horizon:,.0f} s", flush=True)
            sampler = Sampler(url, args.sample_hz)
            filler = Filler(url, seeder, plan.fill_rate) if plan.fill_rate > 0 else None
            vacuum = VacuumStandIn(url) if vacuum_mode == "bench" else None
            threads = [t for t in (sampler, filler, vacuum) if t is not None]
            meter = Meter(admin_url, url, times_dir, retention, sampler, filler)
            intervals: list[Interval] = []
            log = (workdir / "soak.jsonl").open("w")
            with writer(url, plan.rate, seconds) as (go, results):
                for t in threads:
                    t.start()
                go.set()
                start = time.monotonic()
                print(HEADER, flush=True)
                ticks = math.ceil(seconds / args.report_every)
                for k in range(1, ticks + 1):
                    time.sleep(max(0.0, start + min(k * args.report_every, seconds) - time.monotonic()))
                    for p in procs:
                        if p.poll() is not None:
                            raise RuntimeError(f"a process exited ({p.args[3:6]}); logs in {workdir}")
                    if filler is not None and filler.error is not None:
                        raise RuntimeError(f"the filler failed: {filler.error!r}")
                    interval = meter.tick(provider_url)
                    intervals.append(interval)
                    print(line(interval), flush=True)
                    log.write(json.dumps(interval.__dict__) + "\n")
                kind, written, info = results.get(timeout=120)
                if kind != "done":
                    raise RuntimeError(f"writer failed: {info}")
            wall = time.monotonic() - start
            meter.finish()
            log.close()
            print()
            print(
                f"written {written:,} rows in {wall:.0f} s ({written / wall:.1f}/s); "
                f"filler {filler.inserted if filler else 0:,}"
                f"; vacuum by {vacuum_mode}" + (f": {vacuum.runs} ({vacuum.seconds:.0f} s)" if vacuum else "")
            )
            for text in summarize(args, plan, meter, intervals, wall):
                print(text)
            with common.connect(url) as conn:
                bad = conn.execute(
                    "SELECT count(*) FROM outbox_message WHERE state IN ('failed', 'unknown')"
                ).fetchone()
                if bad and bad[0]:
                    print(f"CHECK: {bad[0]} rows failed or unknown")
                for table, per in (
                    ("outbox_message", "delivered row (+ its attempt row)"),
                    ("outbox_key_ledger", "ledger key"),
                ):
                    (rows,) = conn.execute(
                        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
                    ).fetchone()  # type: ignore[misc]
                    size = meter.tables.total(table) + (
                        meter.tables.total("outbox_attempt") if table == "outbox_message" else 0
                    )
                    print(
                        f"bytes per {per}: {size / max(rows, 1):,.0f} "
                        f"(table + indexes + TOAST, {rows:,} rows)"
                    )
                if args.bytes:
                    print("bytes at the end:")
                    for text in bytes_report(conn):
                        print("  " + text)
        finally:
            for t in threads:
                if isinstance(t, VacuumStandIn):
                    t.cancel()
                else:
                    t.stop.set()
            for p in reversed(procs):
                e2e.stop_process(p, 60)
            for t in threads:
                t.join(30)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preseed", type=int, default=10_000_000, help="terminal rows to pre-seed (default 10,000,000)"
    )
    parser.add_argument("--ledger", type=int, help="ledger keys to pre-seed (default: --preseed)")
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes of live traffic (default 60)")
    parser.add_argument("--rate", type=float, default=300.0, help="live writes per second (default 300)")
    parser.add_argument(
        "--purge-rate",
        type=float,
        default=1000.0,
        help="pre-seeded rows crossing the retention per second (default 1000)",
    )
    parser.add_argument(
        "--ledger-rate",
        type=float,
        help="pre-seeded ledger keys crossing the horizon per second (default: --purge-rate)",
    )
    parser.add_argument(
        "--fill-rate",
        type=float,
        help="delivered rows inserted per second besides the live ones (default: purge rate - live rate)",
    )
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--threads", type=int, default=8, help="concurrency per worker process (default 8)")
    parser.add_argument(
        "--report-every", type=float, default=60.0, help="seconds between report lines (default 60)"
    )
    parser.add_argument(
        "--reconcile-interval", type=float, default=10.0, help="OUTBOX_RECONCILE_INTERVAL (default 10)"
    )
    parser.add_argument(
        "--vacuum",
        choices=["server", "bench", "none"],
        help="who vacuums (default: server if its autovacuum is on, else bench)",
    )
    parser.add_argument("--table-settings", choices=["production", "default"], default="production")
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="the provider's answer delay (default 0)"
    )
    parser.add_argument(
        "--sample-hz", type=float, default=5.0, help="pg_stat_activity samples per second (default 5)"
    )
    parser.add_argument("--no-bytes", dest="bytes", action="store_false", help="skip the bytes breakdown")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--embedded", action="store_true", help="start embedded servers even if the machine's answer"
    )
    parser.add_argument(
        "--database-name", default=DATABASE, help=f"the database created and dropped (default {DATABASE})"
    )
    parser.add_argument("--keep", action="store_true", help="keep the database and the logs")
    args = parser.parse_args(argv)
    if args.preseed < 0 or args.purge_rate <= 0 or args.rate <= 0 or args.minutes <= 0:
        parser.error("--preseed >= 0; --purge-rate, --rate and --minutes > 0")
    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    with common.servers(args, MACHINE_REDIS_URL, "bench-soak-") as (admin_url, redis_url, _where):
        try:
            return run(args, admin_url, redis_url, workdir)
        finally:
            if not args.keep:
                with contextlib.suppress(psycopg.Error):
                    common.drop_database(admin_url, args.database_name)
                common.clear_namespace(redis_url, NAMESPACE)
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
