"""Chains against independent rows (issue 14): N keys x 3 steps, delivered by the same relay and
workers, in one run, alternating.

* independent: the bench writes the 3 rows of each key at once (3 destinations);
* chained: it writes the first step only; each step's ``@then`` writes the next one in the
  statement that records it ``sent`` (``bench/chain_handlers.py``).

Two shapes, each run for both modes:

* **backlog**: the rows (the first steps, for the chain) are written before the relay and the
  workers start; deliveries/s from the start of the delivery phase to the last confirmation.
  The independent rows are all visible at once and go out in full relay batches, while a
  chain's second and third steps appear one at a time, each when the step before is recorded
  (the relay wakes for each, a batch of about one row), so this shape is the chain's worst case.
* **live**: the application writes while the relay and the workers run, one transaction per key
  (like a web request: three rows, or the chain's first row), as fast as one writer thread can;
  deliveries/s from the first write to the last confirmation. Both modes pay for their writes
  and wake the relay per transaction.

Figures come from the database's own ``completed_at``; the ratio is chained / independent (the
issue's target: >= 0.8).

    python bench/chains.py                 # the machine's servers, else embedded ones
    python bench/chains.py -n 3000 --repeat 2 --shape live
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy.orm import Session  # noqa: E402

import outbox  # noqa: E402
from bench.chain_handlers import DESTINATIONS, STEPS  # noqa: E402
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
from outbox.db import make_engine  # noqa: E402

DATABASE = "bench_chains"
NAMESPACE = "benchchains"


def write_rows(url: str, n: int, chained: bool, per_transaction: int = 1000) -> None:
    engine = make_engine(url)
    try:
        for start in range(0, n, per_transaction):
            with Session(engine) as s, s.begin():
                for i in range(start, min(n, start + per_transaction)):
                    for step in STEPS[:1] if chained else STEPS:
                        outbox.write(
                            s,
                            key=f"order:{i}",
                            step=step,
                            destination=DESTINATIONS[step],
                            payload={"amount_cents": 1000 + i % 500},
                        )
    finally:
        engine.dispose()


def run(
    mode: str,
    shape: str,
    n: int,
    admin_url: str,
    redis_url: str,
    provider_url: str,
    workdir: Path,
    threads: int,
) -> float:
    url = recreate_database(admin_url, DATABASE)
    migrate(url)
    clear_namespace(redis_url, NAMESPACE)
    chained = mode == "chained"
    if shape == "backlog":
        write_rows(url, n, chained)
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=url,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_NAMESPACE=NAMESPACE,
        OUTBOX_POLL_INTERVAL="1",
        BENCH_PROVIDER_URL=provider_url,
        BENCH_CHAINED="1" if mode == "chained" else "0",
        PYTHONPATH=str(ROOT),
    )
    cmd = [sys.executable, "-m", "outbox", "--log-level", "WARNING"]
    workers = start_logged(
        [*cmd, "worker", "bench.chain_handlers", "--processes", "2", "--threads", str(threads)],
        workdir / f"worker-{mode}.log",
        env,
    )
    relay: subprocess.Popen[bytes] | None = None
    writer: threading.Thread | None = None
    try:
        time.sleep(3)  # the workers' start-up is not delivery work
        if shape == "live":
            relay = start_logged([*cmd, "relay"], workdir / f"relay-{mode}.log", env)
            time.sleep(1)
            started = time.time()
            writer = threading.Thread(target=write_rows, args=(url, n, chained, 1), daemon=True)
            writer.start()
        else:
            started = time.time()
            relay = start_logged([*cmd, "relay"], workdir / f"relay-{mode}.log", env)
        with connect(url) as conn:

            def done() -> bool:
                row = conn.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()
                return bool(row and row[0] == 3 * n)

            wait_for(done, 600, f"{3 * n} rows sent ({mode})", interval=0.2)
            last = conn.execute("SELECT EXTRACT(EPOCH FROM max(completed_at)) FROM outbox_message").fetchone()
            bad = conn.execute("SELECT count(*) FROM outbox_message WHERE state <> 'sent'").fetchone()
        assert last is not None and bad is not None and bad[0] == 0
        return 3 * n / (float(last[0]) - started)
    finally:
        if writer is not None:
            writer.join(60)
        if relay is not None:
            stop_process(relay)
        stop_process(workers, 60)
        drop_database(admin_url, DATABASE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=3000, help="keys per run (3 rows each; default 3000)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads per process (default 8)")
    parser.add_argument(
        "--shape",
        choices=["backlog", "live", "both"],
        default="both",
        help="rows written before the delivery phase, while it runs, or both (default both)",
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--embedded", action="store_true", help="start embedded servers even if the machine's answer"
    )
    args = parser.parse_args()
    shapes = ("backlog", "live") if args.shape == "both" else (args.shape,)
    rates: dict[tuple[str, str], list[float]] = {
        (s, m): [] for s in shapes for m in ("independent", "chained")
    }
    with (
        tempfile.TemporaryDirectory(prefix="bench-chains-") as tmp,
        servers(args, "redis://127.0.0.1:6379/5", "bench-chains-") as (admin_url, redis_url, where),
        provider("fast", Path(tmp)) as (provider_url, _proc),
    ):
        print(
            f"servers: {where}; {args.n} keys x 3 steps per run, 2 worker processes x {args.threads} threads"
        )
        for i in range(args.repeat):
            order = ("independent", "chained") if i % 2 == 0 else ("chained", "independent")
            for shape in shapes:
                for mode in order:
                    rate = run(
                        mode, shape, args.n, admin_url, redis_url, provider_url, Path(tmp), args.threads
                    )
                    rates[shape, mode].append(rate)
                    print(f"run {i + 1} {shape:<7} {mode:<11} {rate:7.0f} deliveries/s", flush=True)
    for shape in shapes:
        ind = statistics.median(rates[shape, "independent"])
        ch = statistics.median(rates[shape, "chained"])
        print(
            f"{shape:<7} medians: independent {ind:.0f}/s, chained {ch:.0f}/s, "
            f"chained / independent = {ch / ind:.2f} (target >= 0.80)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
