"""Ordered against unordered rows (issue 15): the same rows, delivered by the same relay and
workers, with and without ordering keys, in one run, alternating; and one hot key.

* **unordered**: N rows, no ordering key;
* **ordered**: the same N rows over N / 10 ordering keys (10 rows each, interleaved in id order
  as a stream of customers' changes would be): only each key's head is published and claimed,
  the next one when it settles;
* **hot key**: every row on one ordering key (``--hot`` rows): one claim -> call -> record at a
  time, by construction; its rate is reported, not compared.

The rows are written before the relay and the workers start (one ``INSERT … SELECT``, through
the table's triggers, so the ordered writes take their per-key lock); deliveries/s from the
relay's start to the last ``completed_at`` (the database's clock). The ratio is ordered /
unordered (the issue's target: >= 0.70).

    python bench/ordering.py                       # 10,000 keys x 10 rows, as the issue says
    python bench/ordering.py -n 20000 --repeat 1   # a quicker look
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chain_handlers import DESTINATIONS  # noqa: E402
from bench.common import (  # noqa: E402
    clear_namespace,
    connect,
    drop_database,
    migrate,
    recreate_database,
    servers,
    wait_for,
)
from bench.e2e import provider, start_logged, stop_process  # noqa: E402

DATABASE = "bench_ordering"
NAMESPACE = "benchordering"
ROWS_PER_KEY = 10


def write_rows(url: str, n: int, keys: int | None, per_transaction: int = 1000) -> None:
    """``n`` rows on ``bench.charge``; over ``keys`` ordering keys (row g on key g % keys), or
    none. 1,000 rows a transaction: each ordering key's lock is held until its commit."""
    with connect(url) as conn:
        for start in range(1, n + 1, per_transaction):
            conn.execute(
                "INSERT INTO outbox_message (key, step, destination, payload, ordering_key) "
                "SELECT 'order:' || g, 'charge', %(destination)s, "
                "jsonb_build_object('amount_cents', 1000 + g %% 500), "
                "CASE WHEN %(keys)s::int IS NULL THEN NULL ELSE 'customer:' || (g %% %(keys)s::int) END "
                "FROM generate_series(%(start)s::int, %(end)s::int) g",
                {
                    "destination": DESTINATIONS["charge"],
                    "keys": keys,
                    "start": start,
                    "end": min(n, start + per_transaction - 1),
                },
            )
        conn.execute("ANALYZE outbox_message")


def run(
    mode: str, n: int, admin_url: str, redis_url: str, provider_url: str, workdir: Path, threads: int
) -> float:
    url = recreate_database(admin_url, DATABASE)
    migrate(url)
    clear_namespace(redis_url, NAMESPACE)
    keys = {"unordered": None, "ordered": max(1, n // ROWS_PER_KEY), "hot": 1}[mode]
    write_rows(url, n, keys)
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=url,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_NAMESPACE=NAMESPACE,
        OUTBOX_POLL_INTERVAL="1",
        BENCH_PROVIDER_URL=provider_url,
        BENCH_CHAINED="0",
        PYTHONPATH=str(ROOT),
    )
    cmd = [sys.executable, "-m", "outbox", "--log-level", "WARNING"]
    workers = start_logged(
        [*cmd, "worker", "bench.chain_handlers", "--processes", "2", "--threads", str(threads)],
        workdir / f"worker-{mode}.log",
        env,
    )
    relay: subprocess.Popen[bytes] | None = None
    try:
        time.sleep(3)  # the workers' start-up is not delivery work
        started = time.time()
        relay = start_logged([*cmd, "relay"], workdir / f"relay-{mode}.log", env)
        with connect(url) as conn:

            def done() -> bool:
                row = conn.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()
                return bool(row and row[0] == n)

            wait_for(done, 900, f"{n} rows sent ({mode})", interval=0.2)
            last = conn.execute("SELECT EXTRACT(EPOCH FROM max(completed_at)) FROM outbox_message").fetchone()
            if keys is not None:
                # Within each ordering key, confirmed in id order.
                (disorder,) = conn.execute(
                    "SELECT count(*) FROM (SELECT completed_at < lag(completed_at) OVER "
                    "(PARTITION BY ordering_key ORDER BY id) AS early FROM outbox_message) t WHERE early"
                ).fetchone()
                assert disorder == 0, f"{disorder} rows confirmed before an earlier row of their key"
        assert last is not None
        return n / (float(last[0]) - started)
    finally:
        if relay is not None:
            stop_process(relay)
        stop_process(workers, 60)
        drop_database(admin_url, DATABASE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-n", type=int, default=100_000, help="rows per run (default 100000: 10,000 keys x 10)"
    )
    parser.add_argument(
        "--hot", type=int, default=1000, help="rows on the one hot key (default 1000; 0: skip)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode, alternating (default 1)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads per process (default 8)")
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--embedded", action="store_true", help="start embedded servers even if the machine's answer"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"unordered": [], "ordered": []}
    with (
        tempfile.TemporaryDirectory(prefix="bench-ordering-") as tmp,
        servers(args, "redis://127.0.0.1:6379/5", "bench-ordering-") as (admin_url, redis_url, where),
        provider("fast", Path(tmp)) as (provider_url, _proc),
    ):
        print(f"servers: {where}; {args.n} rows per run, 2 worker processes x {args.threads} threads")
        for i in range(args.repeat):
            order = ("unordered", "ordered") if i % 2 == 0 else ("ordered", "unordered")
            for mode in order:
                rate = run(mode, args.n, admin_url, redis_url, provider_url, Path(tmp), args.threads)
                rates[mode].append(rate)
                print(f"run {i + 1} {mode:<9} {rate:7.0f} deliveries/s", flush=True)
        hot = (
            run("hot", args.hot, admin_url, redis_url, provider_url, Path(tmp), args.threads)
            if args.hot
            else None
        )
    unordered, ordered = statistics.median(rates["unordered"]), statistics.median(rates["ordered"])
    print(
        f"medians: unordered {unordered:.0f}/s, ordered ({ROWS_PER_KEY} rows per key) {ordered:.0f}/s, "
        f"ordered / unordered = {ordered / unordered:.2f} (target >= 0.70)"
    )
    if hot is not None:
        print(
            f"one hot key ({args.hot} rows): {hot:.0f} deliveries/s (one claim -> call -> record at a time)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
