#!/usr/bin/env python
"""End to end: business transactions → confirmed provider calls, outbox vs procrastinate.

Prints figures; not a test. For each system, in the same run and against the same servers:

* **write phase** — N business transactions by ``--writers`` processes (default 2, one
  connection each, like an application's web workers), each an ``orders`` INSERT plus the
  system's transactional enqueue, committed:
  outbox: ``outbox.write(conn, key="order:<id>", step="charge", …)``;
  procrastinate: ``charge.configure(connection=<the same psycopg connection>).defer(…)``.
* **delivery phase** — everything that turns those rows into confirmed HTTP calls to a no-op
  provider on 127.0.0.1 (each call carries ``Idempotency-Key: order:<id>:charge``):
  outbox: ``outbox relay`` + ``outbox worker bench.e2e_handlers --processes 2 --concurrency 8``;
  procrastinate: 2 x ``procrastinate worker --concurrency 8`` running ``bench.e2e_procrastinate``.

Deliveries per second are computed from the database's own completion timestamps, **from the
first to the last confirmed delivery** (outbox: ``outbox_message.completed_at`` of `sent` rows;
procrastinate: ``procrastinate_events.at`` of `succeeded` events), so process start-up is not
counted for either system; the wall time from the start of the delivery phase to the last
confirmed delivery is printed too. CPU seconds per delivery are measured with psutil over the
delivery phase for each process group (workers, relay, provider, the PostgreSQL backends of the
bench database, PostgreSQL's auxiliary processes, Redis); "machine" is the whole machine's busy
CPU over the same window, so "machine - ours" shows what neighbours took. On a shared machine
the deliveries/s of one run depend on what the neighbours do at that moment; "deliveries per
CPU-second of our processes" does not, and is printed next to the ratio. Both systems log at
their CLI's default level, INFO (httpx's own per-request INFO line is silenced for both).

The systems run alternately (``--repeat``, default 2: outbox, procrastinate, outbox, …) on freshly
created databases (``bench_e2e_outbox``, ``bench_e2e_procrastinate``) and the medians are
reported. Round trips and commits per delivery come from ``pg_stat_database.xact_commit`` deltas
(server side, bench database only), from client-side counters in both systems' worker processes
(``BENCH_COUNT_ROUND_TRIPS``, see ``bench/e2e_handlers.py`` and ``bench/e2e_procrastinate.py``;
``--no-count-round-trips`` turns them off) and from Redis ``INFO commandstats`` deltas
(server-wide: other users of the same Redis would show up there).

``--profile`` instead runs the outbox delivery phase once with ``py-spy record`` attached to one
worker process and prints where that worker's CPU goes per delivery.

Servers: ``--database-url``/``--redis-url``, else ``OUTBOX_DATABASE_URL``/``OUTBOX_REDIS_URL``,
else the machine's ``postgresql://postgres@127.0.0.1:5432/test`` and ``redis://…:6379/8`` when
they answer, else embedded ones (``outbox.testing.embedded``). Network traffic stays on 127.0.0.1 and
every wait has a timeout. See bench/README.md (## e2e).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import psycopg
import redis
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

import outbox  # noqa: E402
from bench.common import (  # noqa: E402
    checkpoint,
    clear_namespace,
    connect,
    drop_database,
    migrate,
    recreate_database,
    servers,
    wait_for,
)
from outbox.settings import libpq_url, normalize_database_url  # noqa: E402

MACHINE_REDIS_URL = "redis://127.0.0.1:6379/8"
OUTBOX_DB = "bench_e2e_outbox"
PROCRASTINATE_DB = "bench_e2e_procrastinate"
NAMESPACE = "benche2e"
DESTINATION = "payments.charge"

PROVIDER_PID: list[int] = []
PROFILE_RATE = 250  # py-spy samples per second

TARGET_RATIO = 1.5
STRETCH_RATIO = 2.0

ORDERS_DDL = """
CREATE TABLE orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    amount_cents integer NOT NULL,
    currency text NOT NULL,
    status text NOT NULL DEFAULT 'paid',
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
INSERT_ORDER = text(
    "INSERT INTO orders (customer, amount_cents, currency) VALUES (:customer, :amount, 'EUR') RETURNING id"
)


# -- processes and CPU -----------------------------------------------------------------------------

_BACKEND = re.compile(r"^postgres: (?:\S+: )?(\S+) (\S+) (\S+\(\d+\)|\[local\])")


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0.0


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _redis_pids(redis_url: str) -> list[int]:
    port = urlsplit(redis_url).port or 6379
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "redis-server" and any(
            f":{port}" in a or a == str(port) for a in p.info["cmdline"] or []
        ):
            found.append(p.pid)
    return found


@dataclass
class Snapshot:
    at: float
    groups: dict[str, dict[int, float]]
    machine_busy: float


class CpuMeter:
    """CPU seconds per process group between two snapshots; processes that appear in between
    count from zero, so the snapshots must be taken while the processes are alive."""

    def __init__(self, database: str, redis_url: str) -> None:
        self.database = database
        self.redis_pids = _redis_pids(redis_url)
        self.fixed: dict[str, list[int]] = {}  # group -> root pids (whole trees)

    def snapshot(self) -> Snapshot:
        groups: dict[str, dict[int, float]] = collections.defaultdict(dict)
        for name, roots in self.fixed.items():
            for root in roots:
                for p in _tree(root):
                    groups[name][p.pid] = _cpu(p)
        for p in psutil.process_iter(["name", "cmdline"]):
            if p.info["name"] != "postgres":
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            m = _BACKEND.match(cmd)
            if m is None:
                groups["postgres aux"][p.pid] = _cpu(p)
            elif m.group(2) == self.database:
                groups["postgres backends"][p.pid] = _cpu(p)
        for pid in self.redis_pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                groups["redis"][pid] = _cpu(psutil.Process(pid))
        me = psutil.Process()
        groups["bench"][me.pid] = _cpu(me)
        t = psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "nice", 0) + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
        return Snapshot(time.monotonic(), dict(groups), busy)

    @staticmethod
    def delta(start: Snapshot, end: Snapshot, overrides: dict[int, float] | None = None) -> dict[str, float]:
        overrides = overrides or {}
        out: dict[str, float] = {}
        for name, pids in end.groups.items():
            before = start.groups.get(name, {})
            out[name] = sum(
                max(0.0, cpu - overrides.get(pid, before.get(pid, 0.0))) for pid, cpu in pids.items()
            )
        out["machine"] = end.machine_busy - start.machine_busy
        return out


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in reversed(_tree(proc.pid)):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait(10)


def start_logged(
    cmd: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``cmd`` run from the repository root, its stdout and stderr written to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def log_count(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def provider(
    kind: str, workdir: Path, latency_ms: float = 0.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    ready = workdir / "provider.url"
    if kind == "fast":
        cmd = [sys.executable, str(ROOT / "bench" / "fast_provider.py"), "--ready-file", str(ready)]
        cmd += ["--latency-ms", str(latency_ms)]
    else:
        cmd = [sys.executable, "-m", "outbox.testing.provider", "--ready-file", str(ready)]
    proc = start_logged(cmd, workdir / "provider.log")
    try:
        url = wait_for(lambda: ready.exists() and ready.read_text(), 20, "the provider to listen")
        yield url, proc
    finally:
        stop_process(proc)


def provider_stats(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/_stats", timeout=10)
    r.raise_for_status()
    return r.json()


def provider_reset(url: str) -> None:
    httpx.post(f"{url}/_reset", timeout=10).raise_for_status()


def pg_counters(admin_url: str, database: str) -> tuple[int, int]:
    """Committed and rolled-back transactions of ``database`` so far, read from another database
    so that reading does not count. A backend flushes its counters at most once a second, and
    always when it exits: read this once the backends of interest have gone (`wait_no_backends`)."""
    with connect(admin_url) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_no_backends(admin_url: str, database: str, timeout: float = 30) -> None:
    with connect(admin_url) as conn:

        def gone() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
            ).fetchone()
            return row is not None and row[0] == 0

        wait_for(gone, timeout, f"the backends of {database} to exit", 0.05)


def redis_commandstats(redis_url: str) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


# -- results ---------------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    n: int
    write_seconds: float = 0.0
    write_client_cpu: float = 0.0
    write_backend_cpu: float = 0.0
    write_commits: int = 0
    write_statements: int = 0
    span_seconds: float = 0.0  # first -> last confirmed delivery
    wall_seconds: float = 0.0  # start of delivery phase -> last confirmed delivery
    first_after: float = 0.0  # start of delivery phase -> first confirmed delivery
    cpu: dict[str, float] = field(default_factory=dict)
    commits: int = 0
    rollbacks: int = 0
    redis_calls: dict[str, int] = field(default_factory=dict)
    client_counts: dict[str, int] = field(default_factory=dict)
    provider: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    #: Sampled at 10 Hz over the delivery phase: the provider's concurrent requests (median of
    #: the samples between 10% and 90% of the deliveries, and the maximum), the bench database's
    #: backends (every process of the deployment), and its new sessions (connects).
    inflight_median: float = 0.0
    inflight_max: int = 0
    connections_max: int = 0
    sessions: int = 0
    #: Peak resident memory (VmHWM) summed over the worker processes, MB.
    worker_rss_mb: float = 0.0

    @property
    def write_rate(self) -> float:
        return self.n / self.write_seconds

    @property
    def rate(self) -> float:
        return (self.n - 1) / self.span_seconds if self.span_seconds > 0 else 0.0

    @property
    def wall_rate(self) -> float:
        return self.n / self.wall_seconds


# -- the write phase -------------------------------------------------------------------------------


class StatementCounter:
    """Counts psycopg statements sent by this process (one extended-protocol flight each)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = psycopg.Cursor.execute

    def __enter__(self) -> StatementCounter:
        original = self._original

        def execute(cur: Any, query: Any, params: Any = None, **kw: Any) -> Any:
            self.count += 1
            return original(cur, query, params, **kw)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.Cursor.execute = self._original  # type: ignore[method-assign]


def _writer(
    url: str, lo: int, hi: int, enqueue: Callable[[Any, int], None], go: Any, release: Any, results: Any
) -> None:
    """One writer process (forked): business transactions ``lo..hi`` on one connection."""
    engine = create_engine(normalize_database_url(url), pool_size=1, max_overflow=0)
    try:
        with engine.begin() as conn:  # open the connection (and outbox's one-time schema check)
            conn.execute(text("SELECT 1"))
        results.put(("ready", 0, 0.0, 0))
        if not go.wait(120):
            raise TimeoutError("the write phase never started")
        with StatementCounter() as counter:
            cpu0 = time.process_time()
            for i in range(lo, hi):
                with engine.begin() as conn:
                    order_id = conn.execute(
                        INSERT_ORDER, {"customer": f"c{i}", "amount": 1000 + i % 500}
                    ).scalar_one()
                    enqueue(conn, order_id)
            cpu = time.process_time() - cpu0
        results.put(("done", hi - lo, cpu, counter.count))
        release.wait(60)  # keep the backend until the parent has read its CPU
    except BaseException as exc:
        results.put(("error", 0, 0.0, repr(exc)))
        raise
    finally:
        engine.dispose()


def write_phase(
    result: Result,
    admin_url: str,
    url: str,
    database: str,
    redis_url: str,
    enqueue: Callable[[Any, int], None],
    writers: int,
) -> None:
    """N business transactions — INSERT the order, enqueue, COMMIT — by ``writers`` forked
    processes with one connection each (the application's web workers), timed together."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    wait_no_backends(admin_url, database)
    commits0, _ = pg_counters(admin_url, database)
    meter = CpuMeter(database, redis_url)
    go, release, results = ctx.Event(), ctx.Event(), ctx.Queue()
    bounds = [result.n * k // writers for k in range(writers + 1)]
    procs = [
        ctx.Process(
            target=_writer, args=(url, bounds[k], bounds[k + 1], enqueue, go, release, results), daemon=True
        )
        for k in range(writers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, _n, _cpu, info = results.get(timeout=60)
            if kind != "ready":
                raise RuntimeError(f"writer failed: {info}")
        before = meter.snapshot()
        start = time.perf_counter()
        go.set()
        done = [results.get(timeout=max(60.0, result.n / 20)) for _ in procs]
        result.write_seconds = time.perf_counter() - start
        after = meter.snapshot()
        release.set()
        for kind, _n, _cpu, info in done:
            if kind != "done":
                raise RuntimeError(f"writer failed: {info}")
    finally:
        release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    wait_no_backends(admin_url, database)
    commits1, _ = pg_counters(admin_url, database)
    d = CpuMeter.delta(before, after)
    result.write_client_cpu = sum(c for _k, _n, c, _i in done)
    result.write_backend_cpu = d.get("postgres backends", 0.0)
    result.write_commits = commits1 - commits0 - writers  # minus each writer's opening SELECT 1
    result.write_statements = sum(int(i) for _k, _n, _c, i in done)


# -- the delivery phase, both systems --------------------------------------------------------------


def after_writes(url: str, table: str) -> None:
    with connect(url) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")  # as autovacuum would after 20k inserts
    checkpoint(url)


class Phase:
    """What both systems' delivery phases measure alike, on the bench database ``database``: the
    commits and rollbacks (less the bench's own polls), CPU per process group, the first and last
    confirmed delivery, the workers' client-side counts (``counts_dir``), the provider's stats.

    ``env`` is the environment for the system's processes (provider URL, ``PYTHONPATH``, and
    ``BENCH_COUNT_ROUND_TRIPS`` unless ``--no-count-round-trips``)."""

    def __init__(
        self,
        args: argparse.Namespace,
        result: Result,
        admin_url: str,
        database: str,
        redis_url: str,
        provider_url: str,
        counts_dir: Path,
    ) -> None:
        self.args, self.result, self.admin_url, self.database = args, result, admin_url, database
        self.provider_url, self.counts_dir = provider_url, counts_dir
        counts_dir.mkdir()
        self.env = dict(os.environ)
        self.env.update(
            BENCH_PROVIDER_URL=provider_url,
            PYTHONPATH=os.pathsep.join([str(ROOT), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        if args.count_round_trips:
            self.env["BENCH_COUNT_ROUND_TRIPS"] = str(counts_dir)
        provider_reset(provider_url)
        self.meter = CpuMeter(database, redis_url)
        wait_no_backends(admin_url, database)
        self.commits0, self.rollbacks0 = pg_counters(admin_url, database)
        self.polls = 0  # the bench's own statements on the bench database: each one a commit

    def row(self, conn: psycopg.Connection[Any], sql: Any, params: Any = None) -> tuple[Any, ...]:
        """One row of the bench's own query on the bench database, counted."""
        self.polls += 1
        row = conn.execute(sql, params).fetchone()
        assert row is not None
        return row

    def start(self) -> None:
        """The delivery phase starts now (CPU snapshot, wall clock, the 10 Hz sampler)."""
        self.before = self.meter.snapshot()
        self.t0 = time.monotonic()
        self._sampling = threading.Event()
        self._samples: list[tuple[int, int, int]] = []  # (in flight, backends, confirmed so far)
        self._sessions0 = self._sessions()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sessions(self) -> int:
        with connect(self.admin_url) as conn:
            row = conn.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = %s", (self.database,)
            ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _sample(self) -> None:
        client = httpx.Client(timeout=2)
        try:
            with connect(self.admin_url) as conn:
                while not self._sampling.wait(0.1):
                    try:
                        stats = client.get(f"{self.provider_url}/_stats").json()
                    except httpx.HTTPError:
                        continue
                    (backends,) = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (self.database,)
                    ).fetchone() or (0,)
                    self._samples.append(
                        (int(stats.get("in_flight", 0)), int(backends), int(stats.get("requests", 0)))
                    )
        finally:
            client.close()

    def _stop_sampling(self, processes: list[subprocess.Popen[bytes]]) -> None:
        self._sampling.set()
        self._sampler.join(10)
        result, n = self.result, self.args.n
        steady = [f for f, _, done in self._samples if 0.1 * n <= done <= 0.9 * n] or [
            f for f, _, _ in self._samples
        ]
        result.inflight_median = statistics.median(steady) if steady else 0.0
        result.inflight_max = max((f for f, _, _ in self._samples), default=0)
        result.connections_max = max((b for _, b, _ in self._samples), default=0)
        result.sessions = self._sessions() - self._sessions0
        peak = 0
        for p in processes[:1]:
            for proc in _tree(p.pid):
                with contextlib.suppress(OSError, ValueError):
                    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak += int(line.split()[1])
        result.worker_rss_mb = peak / 1024

    def wait_confirmed(
        self,
        conn: psycopg.Connection[Any],
        processes: list[subprocess.Popen[bytes]],
        exited: str,
        counts_sql: str,
        failed: str,
        what: str,
    ) -> None:
        """Until ``counts_sql`` (confirmed, failed) counts N confirmed; then the phase ends (wall
        clock, CPU snapshot). Fails as soon as one of ``processes`` exits or one row fails."""
        workdir = self.counts_dir.parent

        def done() -> bool:
            if any(p.poll() is not None for p in processes):
                raise RuntimeError(f"{exited}; see {workdir}")
            confirmed, bad = self.row(conn, counts_sql)
            if bad:
                raise RuntimeError(f"{bad} {failed}; see {workdir}")
            return bool(confirmed >= self.args.n)

        wait_for(done, self.args.timeout, what, 0.2)
        self.t1 = time.monotonic()
        self.after = self.meter.snapshot()
        self._stop_sampling(processes)

    def read_times(self, conn: psycopg.Connection[Any], span_sql: str) -> None:
        """First and last confirmed delivery (``span_sql``) and the start of the phase, all on the
        database's clock."""
        first, last = self.row(conn, span_sql)
        (wall_start,) = self.row(
            conn, "SELECT now() - make_interval(secs => %s)", (time.monotonic() - self.t0,)
        )
        self.result.span_seconds = (last - first).total_seconds()
        self.result.wall_seconds = self.t1 - self.t0
        self.result.first_after = (first - wall_start).total_seconds()

    def finish(self, cpu_overrides: dict[int, float]) -> None:
        """Once the system's processes have stopped: commits, CPU, client counts, provider checks."""
        result = self.result
        wait_no_backends(self.admin_url, self.database)
        commits1, rollbacks1 = pg_counters(self.admin_url, self.database)
        result.cpu = CpuMeter.delta(self.before, self.after, overrides=cpu_overrides)
        result.commits = commits1 - self.commits0 - self.polls
        result.rollbacks = rollbacks1 - self.rollbacks0
        for f in self.counts_dir.glob("*.json"):
            for k, v in json.loads(f.read_text()).items():
                result.client_counts[k] = result.client_counts.get(k, 0) + v
        result.provider = provider_stats(self.provider_url)
        p = result.provider
        if p.get("requests") != result.n:
            result.checks.append(f"provider saw {p.get('requests')} requests for {result.n} deliveries")
        if p.get("distinct_keys", result.n) != result.n or p.get("keys_seen_more_than_once", 0):
            result.checks.append(f"provider keys: {p}")


# -- outbox ----------------------------------------------------------------------------------------


def _py_spy() -> str:
    """py-spy beside this interpreter (a virtualenv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        sys.exit('--profile needs py-spy: pip install -e ".[bench]"')
    return found


def run_outbox(
    args: argparse.Namespace,
    admin_url: str,
    redis_url: str,
    provider_url: str,
    workdir: Path,
    tag: str,
    profile: bool = False,
    pgbouncer_pool_size: int | None = None,
) -> Result:
    result = Result("outbox" if pgbouncer_pool_size is None else "outbox+pgbouncer", args.n)
    url = libpq_url(recreate_database(admin_url, OUTBOX_DB))
    migrate(url, ORDERS_DDL)
    clear_namespace(redis_url, NAMESPACE)
    checkpoint(url)

    def enqueue(conn: Any, order_id: int) -> None:
        outbox.write(
            conn,
            key=f"order:{order_id}",
            step="charge",
            destination=DESTINATION,
            payload={"amount_cents": 1000 + order_id % 500, "currency": "EUR"},
        )

    write_phase(result, admin_url, url, OUTBOX_DB, redis_url, enqueue, args.writers)
    after_writes(url, "outbox_message")

    phase = Phase(args, result, admin_url, OUTBOX_DB, redis_url, provider_url, workdir / f"counts-{tag}")
    env = dict(
        phase.env,
        OUTBOX_DATABASE_URL=url,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_NAMESPACE=NAMESPACE,
        OUTBOX_POLL_INTERVAL="1",
    )
    pooler = contextlib.ExitStack()
    if pgbouncer_pool_size is not None:
        from outbox.testing.pgbouncer import pgbouncer

        # The workers' and the relay's hot paths through PgBouncer in transaction mode, this many
        # server connections for all of them; LISTEN and the failover guards direct. PgBouncer's
        # own CPU is in the "machine" column only.
        pooled = pooler.enter_context(pgbouncer(url, pool_size=pgbouncer_pool_size))
        env.update(
            OUTBOX_DATABASE_URL=pooled, OUTBOX_DATABASE_POOLER="transaction", OUTBOX_DIRECT_DATABASE_URL=url
        )
    if args.async_handler:
        env["BENCH_ASYNC_HANDLER"] = "1"
    worker_log = workdir / f"worker-{tag}.log"
    relay_log = workdir / f"relay-{tag}.log"
    workers = start_logged(
        [
            sys.executable,
            "-m",
            "outbox",
            "--log-level",
            args.log_level,
            "worker",
            "bench.e2e_handlers",
            "--processes",
            str(args.processes),
            "--concurrency",
            str(args.threads),
        ],
        worker_log,
        env,
    )
    relay: subprocess.Popen[bytes] | None = None
    spy: subprocess.Popen[bytes] | None = None
    try:
        # Ready = each process's Dramatiq consumer has polled Redis once (its heartbeat).
        heartbeats = redis.Redis.from_url(redis_url, socket_timeout=10)
        try:
            wait_for(
                lambda: (
                    int(heartbeats.zcard(f"{NAMESPACE}:__heartbeats__")) >= args.processes
                    or workers.poll() is not None
                    or log_count(worker_log, "restarting it") > 0
                ),
                60,
                "the outbox workers to start",
                0.1,
            )
        finally:
            heartbeats.close()
        if workers.poll() is not None or log_count(worker_log, "restarting it"):
            raise RuntimeError(
                f"outbox worker exited with {workers.returncode}:\n{worker_log.read_text()[-3000:]}"
            )
        phase.meter.fixed = {"workers": [workers.pid], "provider": [PROVIDER_PID[0]]}
        redis0 = redis_commandstats(redis_url)
        phase.start()
        relay = start_logged(
            [sys.executable, "-m", "outbox", "--log-level", args.log_level, "relay"], relay_log, env
        )
        phase.meter.fixed["relay"] = [relay.pid]
        # Its start-up (imports, schema check) is not delivery work, as for procrastinate's
        # workers: count its CPU from its first claim.
        relay_ready: dict[int, float] = {}
        with connect(url) as probe:

            def relay_started() -> bool:
                if relay.poll() is not None:  # type: ignore[union-attr]
                    raise RuntimeError(f"the relay exited:\n{relay_log.read_text()[-3000:]}")
                sql = "SELECT EXISTS (SELECT 1 FROM outbox_message WHERE state <> 'pending')"
                return bool(phase.row(probe, sql)[0])

            wait_for(relay_started, 60, "the relay to start", 0.01)
        relay_ready[relay.pid] = _cpu(psutil.Process(relay.pid))
        if profile:
            # The first worker process: a child of the supervisor, or the one process itself.
            child = next((p for p in _tree(workers.pid) if p.pid != workers.pid), psutil.Process(workers.pid))
            spy = subprocess.Popen(
                [
                    _py_spy(),
                    "record",
                    "--pid",
                    str(child.pid),
                    "--rate",
                    str(PROFILE_RATE),
                    "--format",
                    "raw",
                    "--gil",
                    "--output",
                    str(workdir / "profile.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            result.client_counts["profiled_pid"] = child.pid
            result.client_counts["profiled_cpu0"] = int(_cpu(child) * 1e6)
        with connect(url) as poll:
            phase.wait_confirmed(
                poll,
                [workers, relay],
                "a worker or the relay exited during the run",
                "SELECT count(*) FILTER (WHERE state = 'sent'), count(*) FILTER (WHERE state IN "
                "('failed', 'unknown')) FROM outbox_message",
                "rows failed or unknown",
                "every outbox row to be sent",
            )
            redis1 = redis_commandstats(redis_url)
            if profile:
                child = psutil.Process(result.client_counts["profiled_pid"])
                result.client_counts["profiled_cpu1"] = int(_cpu(child) * 1e6)
                result.client_counts["profiled_deliveries"] = int(
                    phase.row(poll, "SELECT count(*) FROM outbox_message")[0]
                )
            (attempts,) = phase.row(poll, "SELECT count(*) FROM outbox_attempt")
            phase.read_times(poll, "SELECT min(completed_at), max(completed_at) FROM outbox_message")
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
        if relay is not None:
            stop_process(relay)
        stop_process(workers, 60)
        pooler.close()
    result.redis_calls = {k: v - redis0.get(k, 0) for k, v in redis1.items() if v - redis0.get(k, 0)}
    if attempts != args.n:
        result.checks.append(f"{attempts} attempt rows for {args.n} rows")
    phase.finish(relay_ready)
    return result


# -- procrastinate ---------------------------------------------------------------------------------


def run_procrastinate(
    args: argparse.Namespace, admin_url: str, redis_url: str, provider_url: str, workdir: Path, tag: str
) -> Result:
    from procrastinate.schema import SchemaManager

    result = Result("procrastinate", args.n)
    url = libpq_url(recreate_database(admin_url, PROCRASTINATE_DB))
    with connect(url) as conn:
        conn.execute(SchemaManager.get_schema())  # type: ignore[arg-type]
        conn.execute(ORDERS_DDL)
    checkpoint(url)

    os.environ["BENCH_PROCRASTINATE_DSN"] = url
    os.environ["BENCH_PROVIDER_URL"] = provider_url
    import bench.e2e_procrastinate as papp

    task = papp.app.tasks[args.procrastinate_task]

    def enqueue(conn: Any, order_id: int) -> None:
        raw = conn.connection.driver_connection  # the psycopg connection in this transaction
        task.configure(connection=raw).defer(
            order_id=order_id,
            key=f"order:{order_id}:charge",
            amount_cents=1000 + order_id % 500,
            currency="EUR",
        )

    write_phase(result, admin_url, url, PROCRASTINATE_DB, redis_url, enqueue, args.writers)
    after_writes(url, "procrastinate_jobs")

    phase = Phase(
        args, result, admin_url, PROCRASTINATE_DB, redis_url, provider_url, workdir / f"pcounts-{tag}"
    )
    env = dict(phase.env, BENCH_PROCRASTINATE_DSN=url)
    phase.start()
    logs = [workdir / f"procrastinate-{tag}-{i}.log" for i in range(args.processes)]
    workers: list[subprocess.Popen[bytes]] = []
    ready_cpu: dict[int, float] = {}
    try:
        for log_path in logs:
            workers.append(
                start_logged(
                    [
                        sys.executable,
                        "-m",
                        "procrastinate",
                        "--app=bench.e2e_procrastinate.app",
                        f"--log-level={args.log_level.lower()}",
                        "worker",
                        "--queues=charges",
                        f"--concurrency={args.threads}",
                    ],
                    log_path,
                    env,
                )
            )
        phase.meter.fixed = {"workers": [w.pid for w in workers], "provider": [PROVIDER_PID[0]]}
        # Start-up (imports, pool) is not delivery work: read the workers' CPU the moment they
        # have registered themselves (procrastinate_workers), and count from there (the outbox
        # workers are started before its window opens).
        with connect(url) as poll:

            def started() -> bool:
                for w, log_path in zip(workers, logs, strict=True):
                    if w.poll() is not None:
                        raise RuntimeError(f"procrastinate worker exited:\n{log_path.read_text()[-3000:]}")
                return bool(phase.row(poll, "SELECT count(*) FROM procrastinate_workers")[0] >= len(workers))

            wait_for(started, 60, "the procrastinate workers to start", 0.01)
            for w in workers:
                ready_cpu[w.pid] = _cpu(psutil.Process(w.pid))
            phase.wait_confirmed(
                poll,
                workers,
                "a procrastinate worker exited",
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status "
                "IN ('failed', 'cancelled', 'aborted')) FROM procrastinate_jobs",
                "procrastinate jobs failed",
                "every procrastinate job to succeed",
            )
            phase.read_times(
                poll, "SELECT min(at), max(at) FROM procrastinate_events WHERE type = 'succeeded'"
            )
    finally:
        for w in workers:
            stop_process(w, 60)
    phase.finish(ready_cpu)
    return result


# -- the profile -----------------------------------------------------------------------------------

_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("logging (outbox log line per delivery)", ("logging/", "outbox/logs.py")),
    ("httpx/httpcore/h11 (the provider call)", ("httpx/", "httpcore/", "h11/")),
    ("psycopg claim", ("claim (outbox/store/delivery.py",)),
    ("psycopg record", ("record (outbox/store/delivery.py",)),
    ("dramatiq (fetch, ack, middleware, Redis)", ("dramatiq/", "redis/")),
    ("json", ("json/",)),
]


def summarize_profile(path: Path, cpu_seconds: float, deliveries: int) -> list[str]:
    """py-spy raw output (collapsed stacks) → share of the worker's samples per category; idle
    samples are excluded by --nonblocking + py-spy's default of skipping idle threads."""
    totals: collections.Counter[str] = collections.Counter()
    leafs: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        for label, needles in _CATEGORIES:
            if any(needle in stack for needle in needles):
                totals[label] += n
                break
        else:
            if "outbox/" in stack:
                totals["outbox (consumer, policy, rest)"] += n
            else:
                totals["other"] += n
        leafs[stack.rsplit(";", 1)[-1]] += n
    per = cpu_seconds / deliveries * 1e3 if deliveries else 0.0
    lines = [
        f"worker process profiled: {cpu_seconds:.2f} CPU s for {deliveries} deliveries, "
        f"{per:.2f} ms CPU/delivery; {samples} py-spy samples (--gil: a thread holding the GIL) = "
        f"{samples / PROFILE_RATE:.1f} s, the rest is C without the GIL (syscalls, libpq); "
        "shares below are of the samples, ms scaled to all the process's CPU"
    ]
    for label, n in totals.most_common():
        lines.append(f"  {label:<45} {n / samples:6.1%}  ~{per * n / samples:.3f} ms/delivery")
    lines.append("  top leaf frames:")
    for leaf, n in leafs.most_common(12):
        lines.append(f"    {n / samples:6.1%}  {leaf}")
    return lines


# -- report ----------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _ours(r: Result) -> float:
    """CPU seconds of every process of ours in the delivery phase (not the bench's poller)."""
    return sum(v for k, v in r.cpu.items() if k not in ("machine", "bench"))


def _ms(r: Result, group: str) -> float:
    return r.cpu.get(group, 0.0) / r.n * 1e3


def _med(group: list[Result], value: Callable[[Result], float]) -> float:
    return median([value(r) for r in group])


def report(args: argparse.Namespace, results: list[Result], where: str, provider_kind: str) -> None:
    ob = [r for r in results if r.system == "outbox"]
    pr = [r for r in results if r.system == "procrastinate"]
    print()
    print(
        f"e2e: N={args.n} business transactions ({args.writers} writer processes), servers {where}, "
        f"provider {provider_kind}, workers {args.processes} processes x {args.threads} threads/concurrency, "
        f"log level {args.log_level}, procrastinate task {args.procrastinate_task}, provider latency "
        f"{args.latency_ms:g} ms, outbox handler {'async' if args.async_handler else 'sync'}"
    )
    print("deliv/s = (N-1) / (last confirmed - first confirmed), from the database's own timestamps;")
    print(
        "wall/s  = N / (start of the delivery phase -> last confirmed);"
        " the phase starts with the relay / the procrastinate workers"
    )
    print(
        "CPU columns: ms of CPU per delivery over the delivery phase (total = ours; machine = all processes)"
    )
    print(
        f"{'run':<15}{'write tx/s':>11}{'deliv/s':>8}{'wall/s':>7}{'1st after':>10}{'workers':>8}"
        f"{'pg back':>8}{'pg aux':>7}{'redis':>6}{'relay':>6}{'provider':>9}{'total':>7}{'machine':>8}"
    )
    for r in results:
        print(
            f"{r.system:<15}{r.write_rate:>11.0f}{r.rate:>8.0f}{r.wall_rate:>7.0f}{r.first_after:>9.2f}s"
            f"{_ms(r, 'workers'):>8.3f}{_ms(r, 'postgres backends'):>8.3f}{_ms(r, 'postgres aux'):>7.3f}"
            f"{_ms(r, 'redis'):>6.3f}{_ms(r, 'relay'):>6.3f}{_ms(r, 'provider'):>9.3f}"
            f"{_ours(r) / r.n * 1e3:>7.3f}{_ms(r, 'machine'):>8.3f}"
        )
    print()
    print(
        "calls in flight = the provider's concurrent requests at 10 Hz (median between 10% and 90% of "
        "the deliveries; max); connections = max of 10 Hz samples of the bench database's backends "
        "(every process); sessions = connects during the phase; RSS = peak (VmHWM) summed over the "
        "worker processes"
    )
    print(f"{'run':<15}{'in flight':>10}{'max':>6}{'connections':>12}{'sessions':>9}{'worker RSS':>11}")
    for r in results:
        print(
            f"{r.system:<15}{r.inflight_median:>10.0f}{r.inflight_max:>6}{r.connections_max:>12}"
            f"{r.sessions:>9}{r.worker_rss_mb:>9.0f}MB"
        )
    print()
    pooled = [r for r in results if r.system == "outbox+pgbouncer"]
    for name, group in (("outbox", ob), ("outbox+pgbouncer", pooled), ("procrastinate", pr)):
        if not group:
            continue
        print(
            f"{name} medians over {len(group)} run(s): "
            f"write {_med(group, lambda r: r.write_rate):.0f} tx/s "
            f"(client {_med(group, lambda r: r.write_client_cpu / r.n * 1e3):.3f} ms CPU/tx, "
            f"backend {_med(group, lambda r: r.write_backend_cpu / r.n * 1e3):.3f} ms CPU/tx, "
            f"{_med(group, lambda r: r.write_statements / r.n):.2f} statements/tx, "
            f"{_med(group, lambda r: r.write_commits / r.n):.2f} commits/tx); "
            f"delivery {_med(group, lambda r: r.rate):.0f}/s first-to-last, "
            f"{_med(group, lambda r: r.wall_rate):.0f}/s wall"
        )
    if ob and pooled:
        pairs = ", ".join(f"{p.rate / o.rate:.2f}" for o, p in zip(ob, pooled, strict=False))
        print(
            f"ratio outbox+pgbouncer/outbox deliveries/s: "
            f"{_med(pooled, lambda r: r.rate) / _med(ob, lambda r: r.rate):.2f}x first-to-last "
            f"(per pair: {pairs}); target 0.80x"
        )
    if ob and pr:
        ratio = _med(ob, lambda r: r.rate) / _med(pr, lambda r: r.rate)
        wall_ratio = _med(ob, lambda r: r.wall_rate) / _med(pr, lambda r: r.wall_rate)
        write_ratio = _med(ob, lambda r: r.write_rate) / _med(pr, lambda r: r.write_rate)
        verdict = (
            "stretch met"
            if ratio >= STRETCH_RATIO
            else "target met"
            if ratio >= TARGET_RATIO
            else "TARGET MISSED"
        )
        pairs = ", ".join(f"{o.rate / p.rate:.2f}" for o, p in zip(ob, pr, strict=False))
        print(
            f"ratio outbox/procrastinate deliveries/s: {ratio:.2f}x first-to-last (per pair: {pairs}), "
            f"{wall_ratio:.2f}x wall; target {TARGET_RATIO}x, stretch {STRETCH_RATIO}x: {verdict}; "
            f"write phase {write_ratio:.2f}x"
        )
        cpu_ob = _med(ob, lambda r: _ours(r) / r.n)
        cpu_pr = _med(pr, lambda r: _ours(r) / r.n)
        print(
            f"deliveries per CPU-second of our processes (immune to neighbours): outbox {1 / cpu_ob:.0f}, "
            f"procrastinate {1 / cpu_pr:.0f}: {cpu_pr / cpu_ob:.2f}x"
        )
        print(
            f"worker CPU per delivery: outbox {_med(ob, lambda r: _ms(r, 'workers')):.3f} ms "
            f"(+ relay {_med(ob, lambda r: _ms(r, 'relay')):.3f}), "
            f"procrastinate {_med(pr, lambda r: _ms(r, 'workers')):.3f} ms; PostgreSQL backends: "
            f"outbox {_med(ob, lambda r: _ms(r, 'postgres backends')):.3f} ms, "
            f"procrastinate {_med(pr, lambda r: _ms(r, 'postgres backends')):.3f} ms"
        )
    print()
    for r in ob[-1:]:
        cc = r.client_counts
        print(f"outbox round trips and commits per delivery (last outbox run, N={r.n}):")
        print(
            f"  PostgreSQL commits (pg_stat_database.xact_commit delta / N, bench db, delivery phase): "
            f"{r.commits / r.n:.3f} (rollbacks {r.rollbacks})"
        )
        pg = {k.removeprefix("pg."): v for k, v in cc.items() if k.startswith("pg.")}
        if pg:
            print(
                "  worker statements (client side): "
                + ", ".join(f"{k} {v / r.n:.3f}" for k, v in sorted(pg.items()))
            )
            rd = {k.removeprefix("redis.cmd."): v for k, v in cc.items() if k.startswith("redis.cmd.")}
            top = sorted(rd.items(), key=lambda kv: -kv[1])
            print(
                "  worker Redis round trips (client side): "
                f"{cc.get('redis.requests', 0) / r.n:.3f} per delivery; "
                "commands: " + ", ".join(f"{k} {v / r.n:.3f}" for k, v in top)
            )
        rc = sorted(r.redis_calls.items(), key=lambda kv: -kv[1])[:8]
        print(
            "  Redis INFO commandstats delta / N (server-wide): "
            + ", ".join(f"{k} {v / r.n:.3f}" for k, v in rc)
        )
        # The worker's own commits: one per claim statement (a group claims several rows) and one
        # per record; what is left is the relay's batches and idle polls.
        worker_commits = (pg.get("claim", r.n) + pg.get("record", r.n)) / r.n
        print(
            "  relay: BEGIN + claim UPDATE + one pipelined HSET/RPUSH + COMMIT per batch of <= 1000 rows; "
            f"the {r.commits / r.n - worker_commits:.3f} commits/delivery above the worker's "
            f"{worker_commits:.3f} (claim statements + records) are its batches and idle polls"
        )
    for r in pr[-1:]:
        print(f"procrastinate round trips and commits per delivery (last procrastinate run, N={r.n}):")
        print(
            f"  PostgreSQL commits (xact_commit delta / N): {r.commits / r.n:.3f} (rollbacks {r.rollbacks})"
        )
        pg = {k.removeprefix("pg."): v for k, v in r.client_counts.items() if k.startswith("pg.")}
        if pg:
            top = sorted(pg.items(), key=lambda kv: -kv[1])
            print(
                f"  worker statements (client side): {sum(pg.values()) / r.n:.3f} per delivery: "
                + ", ".join(f"{k} {v / r.n:.3f}" for k, v in top)
            )
    bad = [f"{r.system}: {c}" for r in results for c in r.checks]
    print()
    ok = "every run: N provider calls, N distinct Idempotency-Keys, none repeated"
    print("checks: " + ("; ".join(bad) if bad else ok))


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-n", type=int, default=20_000, help="business transactions per system per run (default 20000)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per system, alternating (default 2)")
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--embedded", action="store_true", help="start embedded servers even if the machine's answer"
    )
    parser.add_argument(
        "--writers", type=int, default=2, help="write-phase processes, one connection each (default 2)"
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=8, help="outbox threads / procrastinate concurrency per process"
    )
    parser.add_argument("--provider", choices=["fast", "simulator"], default="fast")
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="the fast provider answers each charge this late (a slow provider; default 0)",
    )
    parser.add_argument(
        "--async-handler", action="store_true", help="outbox: the async def twin of the handler"
    )
    parser.add_argument(
        "--procrastinate-task",
        choices=["charge_async", "charge_sync"],
        default="charge_sync",
        help="procrastinate task flavour (default charge_sync: the lower CPU per job of the two here)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="both systems' worker log level (default INFO, both CLIs' default)",
    )
    parser.add_argument("--only", choices=["outbox", "procrastinate"], help="run one system only")
    parser.add_argument(
        "--pgbouncer",
        type=int,
        metavar="POOL_SIZE",
        help="also run outbox through PgBouncer in transaction mode (Debian's pgbouncer, started "
        "here) with this many server connections for the whole deployment, right after each "
        "direct outbox run",
    )
    parser.add_argument("--no-count-round-trips", dest="count_round_trips", action="store_false")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one profiled outbox run (py-spy on a worker); with --steady, py-spy on one worker "
        "process (and outbox's relay) of each run",
    )
    parser.add_argument("--timeout", type=float, default=240, help="seconds a delivery phase may take")
    parser.add_argument("--keep", action="store_true", help="keep the bench databases and logs")
    parser.add_argument(
        "--steady",
        metavar="RATES",
        help="steady state instead (issue 17): writes arrive while the system delivers, at each "
        "offered rate of this comma-separated list (rows/s, or 'max': --writers processes as "
        "fast as they commit); see bench/steady.py",
    )
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="--steady: seconds of writing per run (default 20)"
    )
    args = parser.parse_args(argv)
    if args.n < 2:
        parser.error("-n must be at least 2")

    workdir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    results: list[Result] = []
    with (
        servers(args, MACHINE_REDIS_URL, "bench-e2e-") as (admin_url, redis_url, where),
        provider(args.provider, workdir, args.latency_ms) as (provider_url, pproc),
    ):
        PROVIDER_PID.append(pproc.pid)
        print(f"servers: {where}; provider {provider_url}; logs in {workdir}", flush=True)
        try:
            if args.profile and not args.steady:
                r = run_outbox(args, admin_url, redis_url, provider_url, workdir, "profile", profile=True)
                cc = r.client_counts
                cpu = (cc["profiled_cpu1"] - cc["profiled_cpu0"]) / 1e6
                # Deliveries of that one process: the claims it counted (else N / processes).
                own = workdir / "counts-profile" / f"{cc['profiled_pid']}.json"
                share = (
                    json.loads(own.read_text()).get("pg.claim", 0)
                    if own.exists()
                    else args.n // args.processes
                )
                print(f"profiled outbox run: {r.rate:.0f} deliveries/s first-to-last (py-spy attached)")
                for line in summarize_profile(workdir / "profile.txt", cpu, share):
                    print(line)
                return 0
            systems = [s for s in ("outbox", "procrastinate") if args.only in (None, s)]
            if args.pgbouncer is not None and "outbox" in systems:
                systems.insert(systems.index("outbox") + 1, "outbox+pgbouncer")
            if args.steady:
                from bench.steady import WARMUP_SECONDS, report_steady, run_steady

                steady = []
                for offered in [r.strip() for r in args.steady.split(",") if r.strip()]:
                    for i in range(args.repeat):
                        for system in systems:
                            t = time.monotonic()
                            s = run_steady(
                                args,
                                system,
                                offered,
                                admin_url,
                                redis_url,
                                provider_url,
                                workdir,
                                f"{offered}-{i}",
                                PROVIDER_PID[0],
                            )
                            steady.append(s)
                            print(
                                f"steady {offered} run {i + 1}/{args.repeat} {system}: "
                                f"written {s.write_rate:.0f}/s, "
                                f"delivered {s.rate:.0f}/s, p50 {s.p50_ms:.1f} ms, p99 {s.p99_ms:.1f} ms "
                                f"(after {WARMUP_SECONDS:g} s {s.p99_warm_ms:.1f} ms), "
                                f"{s.per_cpu_second:.0f} deliveries per CPU-second "
                                f"({time.monotonic() - t:.0f} s)",
                                flush=True,
                            )
                report_steady(args, steady, where)
                return 0
            for i in range(args.repeat):
                for system in systems:
                    t = time.monotonic()
                    if system == "outbox":
                        r = run_outbox(args, admin_url, redis_url, provider_url, workdir, f"{i}")
                    elif system == "outbox+pgbouncer":
                        r = run_outbox(
                            args,
                            admin_url,
                            redis_url,
                            provider_url,
                            workdir,
                            f"{i}-pgb",
                            pgbouncer_pool_size=args.pgbouncer,
                        )
                    else:
                        r = run_procrastinate(args, admin_url, redis_url, provider_url, workdir, f"{i}")
                    results.append(r)
                    print(
                        f"run {i + 1}/{args.repeat} {system}: write {r.write_rate:.0f} tx/s, deliveries "
                        f"{r.rate:.0f}/s first-to-last ({r.wall_rate:.0f}/s wall), "
                        f"run took {time.monotonic() - t:.0f} s",
                        flush=True,
                    )
            report(args, results, where, args.provider)
        finally:
            if not args.keep:
                for name in (OUTBOX_DB, PROCRASTINATE_DB):
                    with contextlib.suppress(psycopg.Error):
                        drop_database(admin_url, name)
                clear_namespace(redis_url, NAMESPACE)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
