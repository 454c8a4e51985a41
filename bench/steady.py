"""Steady state for ``bench/e2e.py --steady`` (issue 17): writes arrive while the system delivers.

``bench/e2e.py``'s default writes every row first and then drains them; production looks
different: one business transaction at a time, while the relay and the workers run. Here, for
each offered rate (``--steady 100,300,max``) and each system, in the same run:

* the delivery processes start first and are ready (outbox: ``outbox worker`` + ``outbox
  relay``; procrastinate: its workers);
* writers commit business transactions (an ``orders`` INSERT plus the system's enqueue, one
  commit each) at the offered rate for ``--seconds`` (one writer process, paced on an absolute
  schedule), or, for ``max``, ``--writers`` processes as fast as their connections go;
* the run ends when the last row is confirmed.

Reported per system and rate: rows offered and written per second, deliveries/s from the first
write to the last confirmation (the database's clock), commit → confirmed p50/p99 (outbox:
``completed_at - created_at``; procrastinate: its ``succeeded`` event minus its ``deferred``
event; both from the business transaction's start), and CPU per delivery per process group over
the same window: the writer (client), relay, workers, PostgreSQL backends of the bench database
(the writer's included), PostgreSQL's auxiliary processes (WAL writer, checkpointer...), Redis.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis
from sqlalchemy import create_engine, text

import outbox
from bench.common import checkpoint, clear_namespace, connect, migrate, recreate_database, wait_for
from outbox.settings import libpq_url, normalize_database_url

#: The rows written in the first seconds of a run are left out of the "p99 2s+" column: the
#: workers' first calls open their connections and pools while the writes already arrive at
#: the full rate (at 400/s, 300 ms provider, async: the first ~200 rows took 400-760 ms, the
#: rest p99 ~350 ms), and in a 20 s run those rows alone are most of the slowest 1%.
WARMUP_SECONDS = 2.0


def _p99(sorted_seconds: list[float]) -> float:
    n = len(sorted_seconds)
    return sorted_seconds[min(n - 1, int(0.99 * n))] * 1e3 if n else 0.0


#: Groups shown, in order; "writer" is the writing processes themselves.
GROUPS = ("writer", "relay", "workers", "postgres backends", "postgres aux", "redis")


@dataclass
class Steady:
    system: str
    offered: str
    written: int = 0
    write_seconds: float = 0.0
    span_seconds: float = 0.0  # first write -> last confirmation (database clock)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    #: p99 of the rows written after the first WARMUP_SECONDS (the processes' first connections,
    #: pools and lazy imports are behind them)
    p99_warm_ms: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    wal_bytes: int = 0
    statements: int = 0
    commits: int = 0
    checks: list[str] = field(default_factory=list)
    #: --profile: (what, py-spy output, CPU seconds of the profiled process while it was attached)
    profiles: list[tuple[str, Path, float]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.written / self.span_seconds if self.span_seconds > 0 else 0.0

    @property
    def write_rate(self) -> float:
        return self.written / self.write_seconds if self.write_seconds > 0 else 0.0

    def ms(self, group: str) -> float:
        return self.cpu.get(group, 0.0) / max(self.written, 1) * 1e3

    @property
    def delivery_cpu(self) -> float:
        """CPU seconds of everything but the writing client: relay, workers, PostgreSQL, Redis."""
        return sum(v for k, v in self.cpu.items() if k in GROUPS and k != "writer")

    @property
    def per_cpu_second(self) -> float:
        return self.written / self.delivery_cpu if self.delivery_cpu > 0 else 0.0


def _steady_writer(
    url: str, rate: float | None, seconds: float, first: int, stride: int, system: str, go: Any, results: Any
) -> None:
    """One writer process (forked): business transactions until ``seconds`` have passed, paced
    at ``rate`` per second on an absolute schedule (None: as fast as the connection goes)."""
    import os

    engine = create_engine(normalize_database_url(url), pool_size=1, max_overflow=0)
    insert = text(
        "INSERT INTO orders (customer, amount_cents, currency) "
        "VALUES (:customer, :amount, 'EUR') RETURNING id"
    )
    if system == "procrastinate":
        import bench.e2e_procrastinate as papp

        task = papp.app.tasks[os.environ.get("BENCH_PROCRASTINATE_TASK_NAME", "charge_sync")]
    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT 1"))
        results.put(("ready", 0, 0.0))
        if not go.wait(120):
            raise TimeoutError("the steady writers never started")
        cpu0 = time.process_time()
        start = time.monotonic()
        n = 0
        i = first
        while True:
            now = time.monotonic()
            if now - start >= seconds:
                break
            if rate is not None:
                due = start + n / rate
                if due > now:
                    time.sleep(due - now)
            with engine.begin() as conn:
                order_id = conn.execute(insert, {"customer": f"c{i}", "amount": 1000 + i % 500}).scalar_one()
                if system == "outbox":
                    outbox.write(
                        conn,
                        key=f"order:{order_id}",
                        step="charge",
                        destination="payments.charge",
                        payload={"amount_cents": 1000 + order_id % 500, "currency": "EUR"},
                    )
                else:
                    raw = conn.connection.driver_connection
                    task.configure(connection=raw).defer(
                        order_id=order_id,
                        key=f"order:{order_id}:charge",
                        amount_cents=1000 + order_id % 500,
                        currency="EUR",
                    )
            n += 1
            i += stride
        results.put(("done", n, time.process_time() - cpu0))
    except BaseException as exc:
        results.put(("error", 0, repr(exc)))
        raise
    finally:
        engine.dispose()


def _start_spies(
    args: argparse.Namespace, system: str, procs: list[subprocess.Popen[bytes]], workdir: Path, tag: str
) -> list[tuple[str, psutil.Process, subprocess.Popen[bytes], Path, float]]:
    """--profile: py-spy on one worker process (a forked child of ``outbox worker``, or the first
    procrastinate worker) and, for outbox, on the relay, from the writers' start to the last
    confirmation; raw (collapsed) stacks, idle threads skipped."""
    from bench import e2e

    targets: list[tuple[str, psutil.Process]] = []
    if system == "outbox":
        parent = psutil.Process(procs[0].pid)
        # --processes 1: the worker delivers itself; more: its first child does
        targets.append(("worker", next(iter(parent.children(recursive=True)), parent)))
        targets.append(("relay", psutil.Process(procs[1].pid)))
    else:
        targets.append(("worker", psutil.Process(procs[0].pid)))
    spies = []
    for what, proc in targets:
        out = workdir / f"profile-{system}-{what}-{tag}.txt"
        spy = subprocess.Popen(
            [
                e2e._py_spy(),
                "record",
                "--pid",
                str(proc.pid),
                "--rate",
                str(e2e.PROFILE_RATE),
                "--format",
                "raw",
                "--gil",
                "--output",
                str(out),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        spies.append((what, proc, spy, out, cpu_of(proc.pid)))
    time.sleep(0.5)  # py-spy attached
    return spies


def _stop_spies(
    spies: list[tuple[str, psutil.Process, subprocess.Popen[bytes], Path, float]],
) -> list[tuple[str, Path, float]]:
    import contextlib
    import signal

    done = []
    for what, proc, spy, out, cpu0 in spies:
        cpu = cpu_of(proc.pid) - cpu0
        spy.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(30)
        done.append((what, out, cpu))
    return done


def _wal_lsn(admin_url: str) -> int:
    with connect(admin_url) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        return int(row[0]) if row else 0


def _statements(admin_url: str, database: str) -> int | None:
    """Statements run in ``database`` so far (pg_stat_statements, when the server has it)."""
    try:
        with connect(admin_url) as conn:
            row = conn.execute(
                "SELECT sum(calls) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                "WHERE d.datname = %s",
                (database,),
            ).fetchone()
            return int(row[0] or 0) if row else None
    except psycopg.Error:
        return None


def run_steady(
    args: argparse.Namespace,
    system: str,
    offered: str,
    admin_url: str,
    redis_url: str,
    provider_url: str,
    workdir: Path,
    tag: str,
    provider_pid: int,
) -> Steady:
    """One system at one offered rate (``100``, ``300``, ``max``)."""
    import multiprocessing

    from bench import e2e

    result = Steady(system, offered)
    database = e2e.OUTBOX_DB if system == "outbox" else e2e.PROCRASTINATE_DB
    url = libpq_url(recreate_database(admin_url, database))
    if system == "outbox":
        migrate(url, e2e.ORDERS_DDL)
        clear_namespace(redis_url, e2e.NAMESPACE)
    else:
        from procrastinate.schema import SchemaManager

        with connect(url) as conn:
            conn.execute(SchemaManager.get_schema())  # type: ignore[arg-type]
            conn.execute(e2e.ORDERS_DDL)
    checkpoint(url)
    e2e.provider_reset(provider_url)
    meter = e2e.CpuMeter(database, redis_url)
    env = dict(
        __import__("os").environ,
        BENCH_PROVIDER_URL=provider_url,
        PYTHONPATH=str(e2e.ROOT),
        OUTBOX_DATABASE_URL=url,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_NAMESPACE=e2e.NAMESPACE,
        OUTBOX_POLL_INTERVAL="1",
        BENCH_PROCRASTINATE_DSN=url,
    )
    if args.async_handler:
        env["BENCH_ASYNC_HANDLER"] = "1"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if system == "outbox":
            workers = e2e.start_logged(
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
                    "--threads",
                    str(args.threads),
                ],
                workdir / f"steady-worker-{tag}.log",
                env,
            )
            relay = e2e.start_logged(
                [sys.executable, "-m", "outbox", "--log-level", args.log_level, "relay"],
                workdir / f"steady-relay-{tag}.log",
                env,
            )
            procs = [workers, relay]
            heartbeats = redis.Redis.from_url(redis_url, socket_timeout=10)
            try:
                wait_for(
                    lambda: int(heartbeats.zcard(f"{e2e.NAMESPACE}:__heartbeats__")) >= args.processes,
                    60,
                    "the outbox workers to start",
                    0.1,
                )
            finally:
                heartbeats.close()
            time.sleep(1.0)  # the relay's start-up (imports, LISTEN) done
            meter.fixed = {"workers": [workers.pid], "relay": [relay.pid], "provider": [provider_pid]}
        else:
            for i in range(args.processes):
                procs.append(
                    e2e.start_logged(
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
                        workdir / f"steady-procrastinate-{tag}-{i}.log",
                        env,
                    )
                )
            with connect(url) as poll:
                wait_for(
                    lambda: (
                        poll.execute("SELECT count(*) FROM procrastinate_workers").fetchone()[0]  # type: ignore[index]
                        >= args.processes
                    ),
                    60,
                    "the procrastinate workers to start",
                    0.1,
                )
            meter.fixed = {"workers": [p.pid for p in procs], "provider": [provider_pid]}

        ctx = multiprocessing.get_context("fork")
        go, results = ctx.Event(), ctx.Queue()
        rate = None if offered == "max" else float(offered)
        writers = args.writers if rate is None else 1
        import os

        os.environ["BENCH_PROCRASTINATE_DSN"] = url
        os.environ["BENCH_PROVIDER_URL"] = provider_url
        os.environ["BENCH_PROCRASTINATE_TASK_NAME"] = args.procrastinate_task
        writer_procs = [
            ctx.Process(
                target=_steady_writer,
                args=(url, rate, args.seconds, k, writers, system, go, results),
                daemon=True,
            )
            for k in range(writers)
        ]
        for p in writer_procs:
            p.start()
        for _ in writer_procs:
            kind, _n, info = results.get(timeout=60)
            if kind != "ready":
                raise RuntimeError(f"writer failed: {info}")
        meter.fixed["writer"] = [p.pid for p in writer_procs]
        spies = _start_spies(args, system, procs, workdir, tag) if args.profile else []
        stmts0 = _statements(admin_url, database)
        wal0 = _wal_lsn(admin_url)
        commits0, _ = e2e.pg_counters(admin_url, database)
        before = meter.snapshot()
        t0 = time.monotonic()
        go.set()
        done = [results.get(timeout=args.seconds + 120) for _ in writer_procs]
        result.write_seconds = time.monotonic() - t0
        for kind, _n, info in done:
            if kind != "done":
                raise RuntimeError(f"writer failed: {info}")
        result.written = sum(n for _k, n, _c in done)
        writer_cpu = sum(c for _k, _n, c in done)
        confirmed_sql = (
            "SELECT count(*) FILTER (WHERE state = 'sent') FROM outbox_message"
            if system == "outbox"
            else "SELECT count(*) FILTER (WHERE status = 'succeeded') FROM procrastinate_jobs"
        )
        with connect(url) as poll:
            wait_for(
                lambda: (
                    poll.execute(confirmed_sql).fetchone()[0] >= result.written  # type: ignore[index]
                    or any(p.poll() is not None for p in procs)
                ),
                args.timeout,
                f"{system}: every row to be confirmed",
                0.05,
            )
            after = meter.snapshot()
            result.profiles = _stop_spies(spies)
            wal1 = _wal_lsn(admin_url)
            stmts1 = _statements(admin_url, database)
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a {system} process exited; logs in {workdir}")
            if system == "outbox":
                first, last = poll.execute(
                    "SELECT min(created_at), max(completed_at) FROM outbox_message"
                ).fetchone()  # type: ignore[misc]
                timed = poll.execute(
                    "SELECT EXTRACT(EPOCH FROM created_at - min(created_at) OVER ()), "
                    "EXTRACT(EPOCH FROM completed_at - created_at) FROM outbox_message"
                ).fetchall()
            else:
                first, last = poll.execute(
                    "SELECT min(at) FILTER (WHERE type = 'deferred'), "
                    "max(at) FILTER (WHERE type = 'succeeded') "
                    "FROM procrastinate_events"
                ).fetchone()  # type: ignore[misc]
                timed = poll.execute(
                    "SELECT EXTRACT(EPOCH FROM d.at - min(d.at) OVER ()), EXTRACT(EPOCH FROM s.at - d.at) "
                    "FROM procrastinate_events d "
                    "JOIN procrastinate_events s ON s.job_id = d.job_id AND s.type = 'succeeded' "
                    "WHERE d.type = 'deferred'"
                ).fetchall()
        result.span_seconds = (last - first).total_seconds()
        lat = sorted(float(r[1]) for r in timed)
        warm = sorted(float(r[1]) for r in timed if float(r[0]) >= WARMUP_SECONDS)
        result.p50_ms = statistics.median(lat) * 1e3 if lat else 0.0
        result.p99_ms = _p99(lat)
        result.p99_warm_ms = _p99(warm)
        result.cpu = e2e.CpuMeter.delta(before, after)
        result.cpu["writer"] = writer_cpu
        result.wal_bytes = wal1 - wal0
        if stmts0 is not None and stmts1 is not None:
            result.statements = stmts1 - stmts0
        for p in writer_procs:
            p.join(10)
    finally:
        for p in procs:
            e2e.stop_process(p, 60)
    e2e.wait_no_backends(admin_url, database)
    commits1, _ = e2e.pg_counters(admin_url, database)
    result.commits = commits1 - commits0
    stats = e2e.provider_stats(provider_url)
    if stats.get("requests") != result.written:
        result.checks.append(f"provider saw {stats.get('requests')} requests for {result.written} rows")
    return result


def report_steady(args: argparse.Namespace, results: list[Steady], where: str) -> None:
    print()
    print(
        f"steady state: writers commit one business transaction at a time while the system delivers; "
        f"{args.seconds:g} s of writing per run, servers {where}, workers {args.processes} x {args.threads}, "
        f"outbox handler {'async' if args.async_handler else 'sync'}, "
        f"procrastinate task {args.procrastinate_task}"
    )
    print(
        "deliv/s = rows / (first write -> last confirmation); latency = commit -> confirmed; "
        f"p99 2s+ = of the rows written after the first {WARMUP_SECONDS:g} s"
    )
    print(
        "CPU: ms per delivery by process group; 'delivery' = all but the writer; "
        "/CPU-s = rows per CPU-second of it"
    )
    head = (
        f"{'system':<14}{'offered':>8}{'written/s':>10}{'deliv/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'p99 2s+':>8}"
        + "".join(f"{g.replace('postgres ', 'pg '):>10}" for g in GROUPS)
        + f"{'delivery':>9}{'/CPU-s':>7}{'WAL B':>7}{'commits':>8}{'stmts':>6}"
    )
    print(head)
    for r in results:
        print(
            f"{r.system:<14}{r.offered:>8}{r.write_rate:>10.0f}{r.rate:>8.0f}{r.p50_ms:>8.1f}{r.p99_ms:>8.1f}"
            + f"{r.p99_warm_ms:>8.1f}"
            + "".join(f"{r.ms(g):>10.3f}" for g in GROUPS)
            + f"{r.delivery_cpu / max(r.written, 1) * 1e3:>9.3f}{r.per_cpu_second:>7.0f}"
            + f"{r.wal_bytes / max(r.written, 1):>7.0f}{r.commits / max(r.written, 1):>8.2f}"
            + (f"{r.statements / max(r.written, 1):>6.1f}" if r.statements else f"{'-':>6}")
            + (f"  CHECK: {'; '.join(r.checks)}" if r.checks else "")
        )
    print()
    for offered in dict.fromkeys(r.offered for r in results):
        ob = [r for r in results if r.offered == offered and r.system == "outbox"]
        pr = [r for r in results if r.offered == offered and r.system == "procrastinate"]
        if ob and pr:
            rate = statistics.median(r.rate for r in ob) / statistics.median(r.rate for r in pr)
            per_cpu = statistics.median(r.per_cpu_second for r in ob) / statistics.median(
                r.per_cpu_second for r in pr
            )
            print(
                f"offered {offered}: outbox/procrastinate deliveries/s {rate:.2f}x, "
                f"deliveries per CPU-second {per_cpu:.2f}x (target at max: 1.5x both)"
            )

    from bench import e2e

    for r in results:
        for what, path, cpu in r.profiles:
            share = r.written // args.processes if what == "worker" else r.written
            print(f"\n--profile {r.system} {r.offered} {what} (py-spy): {path}")
            if path.exists():
                for line in e2e.summarize_profile(path, cpu, share):
                    print(line)


def cpu_of(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0
