#!/usr/bin/env python
"""The cost of the metrics, printed as figures (not a test).

(a) The reconciler's database reading (``outbox.metrics.read_database``: the per-state query
    and the heartbeat's no-consumer query) on a table of ``-n`` rows (default 1,000,000), almost
    all ``sent`` and ``cancelled`` and a few thousand in the other states: median and max of
    ``--repeat`` readings, and the plan of the per-state query (it must read the partial
    indexes, not the table). Target: <= 100 ms at 1,000,000 rows.
(b) What the counters add to the hot paths, per call, in this process: one relay batch's
    counters (``count_relay_group`` for one destination) and one delivery's (the outcome and
    answer counters and the two histograms).

Uses the machine's PostgreSQL when it answers on 127.0.0.1:5432, else an embedded one; a database
of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import connect, drop_database, migrate, recreate_database, servers  # noqa: E402
from outbox import metrics  # noqa: E402

DATABASE = "outbox_bench_metrics"

# Test data, written directly: a million rows through outbox.write would take minutes and
# measure the write path, which is not what this script is about.
FILL = """
INSERT INTO outbox_message (key, step, destination, payload, state, attempts, created_at,
                            available_at, dispatched_at, claimed_at, completed_at, claim_token,
                            provider_ref, unknown_since, lease_expires_at)
SELECT 'bench:' || g, 'charge', 'dest.' || (g %% 8), '{}'::jsonb, s.state,
       CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END,
       now() - interval '1 hour', now() - interval '1 hour',
       CASE WHEN s.state <> 'pending' THEN now() - interval '50 minutes' END,
       CASE WHEN s.state NOT IN ('pending', 'dispatched') THEN now() - interval '40 minutes' END,
       CASE WHEN s.state IN ('sent', 'cancelled', 'failed') THEN now() - interval '30 minutes' END,
       CASE WHEN s.state IN ('in_flight', 'unknown', 'sent') THEN gen_random_uuid() END,
       CASE WHEN s.state = 'sent' THEN 'ref' || g END,
       CASE WHEN s.state = 'unknown' THEN now() - interval '20 minutes' END,
       CASE WHEN s.state = 'in_flight' THEN now() + interval '1 minute' END
FROM generate_series(1, %(n)s) g
CROSS JOIN LATERAL (SELECT CASE
    WHEN g %% 1000 = 1 THEN 'pending' WHEN g %% 1000 = 2 THEN 'dispatched'
    WHEN g %% 1000 = 3 THEN 'in_flight' WHEN g %% 1000 = 4 THEN 'unknown'
    WHEN g %% 1000 = 5 THEN 'failed' WHEN g %% 10 = 0 THEN 'cancelled' ELSE 'sent' END AS state) s
"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=1_000_000, help="rows in the table (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=20, help="readings timed (default 20)")
    parser.add_argument("--database-url", help="an admin URL of the server to use")
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--embedded", action="store_true", help="an embedded PostgreSQL, not the machine's")
    args = parser.parse_args()

    with servers(args, "redis://127.0.0.1:6379/15", "outbox-bench-metrics-") as (admin_url, _redis, where):
        url = recreate_database(admin_url, DATABASE)
        try:
            migrate(url)
            with connect(url) as conn:
                started = time.perf_counter()
                conn.execute(FILL, {"n": args.n})
                conn.execute("VACUUM ANALYZE outbox_message")
                print(
                    f"PostgreSQL ({where}): {args.n:,} rows written in {time.perf_counter() - started:.1f} s"
                )
                counts = dict(
                    conn.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall()
                )
                print("  by state: " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
                metrics.read_database(conn)  # warm the cache and the plan
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    reading = metrics.read_database(conn)
                    times.append((time.perf_counter() - t) * 1000)
                assert sum(reading.rows.values()) == sum(counts.get(s, 0) for s in metrics.GAUGE_STATES)
                print(
                    f"(a) database reading: median {statistics.median(times):.1f} ms, "
                    f"max {max(times):.1f} ms over {args.repeat} (target <= 100 ms)"
                )
                from outbox.heartbeat import NO_CONSUMER_SQL

                for label, sql in (
                    ("per-state query", metrics.DATABASE_SQL),
                    ("no-consumer query", NO_CONSUMER_SQL),
                ):
                    one = []
                    for _ in range(args.repeat):
                        t = time.perf_counter()
                        conn.execute(sql).fetchall()
                        one.append((time.perf_counter() - t) * 1000)
                    print(f"    {label}: median {statistics.median(one):.1f} ms")
                plan = conn.execute("EXPLAIN " + metrics.DATABASE_SQL).fetchall()
                scans = sorted({line for (line,) in plan if "Scan" in line for line in [line.strip()]})
                print("    plan: " + "; ".join(s.split("  (")[0].lstrip("-> ") for s in scans))
                nc = conn.execute("EXPLAIN ANALYZE " + NO_CONSUMER_SQL).fetchall()
                print("    no-consumer plan:\n      " + "\n      ".join(line for (line,) in nc[:14]))
        finally:
            drop_database(admin_url, DATABASE)

    relay = timeit.repeat(lambda: metrics.count_relay_group({"dest.0": 1000}, {}), number=10_000, repeat=5)
    print(f"(b) relay batch counters: {min(relay) / 10_000 * 1e6:.2f} µs per batch")

    def delivery() -> None:
        metrics.DELIVERIES.labels(destination="dest.0", outcome="sent").inc()
        metrics.PROVIDER_RESPONSES.labels(destination="dest.0", status_class="2xx").inc()
        metrics.PUBLISHED_TO_CLAIMED.labels(destination="dest.0").observe(0.01)
        metrics.CLAIM_TO_CONFIRMED.labels(destination="dest.0").observe(0.01)
        metrics.WRITTEN_TO_CONFIRMED.labels(destination="dest.0").observe(0.02)

    worker = timeit.repeat(delivery, number=10_000, repeat=5)
    print(f"    delivery counters and histograms: {min(worker) / 10_000 * 1e6:.2f} µs per delivery")
    return 0


if __name__ == "__main__":
    sys.exit(main())
