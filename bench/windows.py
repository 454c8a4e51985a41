#!/usr/bin/env python
"""What a limited destination's dispatch window costs the relay, printed as figures (not a test).

A destination with a limit keeps its backlog ``pending`` in PostgreSQL (outbox.windows). This
measures, for a limited backlog of each size (``--backlogs``, default 0, 10,000 and 100,000 rows
over ``--keys`` fairness keys, a tenth without a key):

(a) the take of 1,000 due rows of an unlimited destination (``run_once``: the statement that
    reads past the limited backlog, the publish, the commit), ms per take;
(b) a refill tick: the window's own take, filling a window of 150 rows (100 calls/s) from that
    backlog, without the take of the other destinations (the relay's loop runs that once a poll
    interval, or on a NOTIFY), ms;
(c) the statements and round trips per take with windows, counted from ``pg_stat_statements``
    when it is installed, else from the code: 1 (limits) + 1 (the others' take) + 1 per window.

Each figure is the median of ``--repeat`` takes (default 5); the machine is shared and noisy.
Uses its own database (``bench_windows``) and Redis namespace. See bench/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import clear_namespace, connect, drop_database, migrate, recreate_database, servers  # noqa: E402
from outbox.relay import Relay  # noqa: E402

MACHINE_REDIS_URL = "redis://127.0.0.1:6379/11"
BENCH_DATABASE = "bench_windows"
NAMESPACE = "benchwindows"
LIMITED, FREE = "limited.send", "free.send"
FREE_ROWS = 1000


def fill(url: str, destination: str, n: int, keys: int, tag: str) -> None:
    with connect(url) as conn:
        conn.execute(
            "INSERT INTO outbox_message (key, step, destination, payload, fairness_key, available_at) "
            "SELECT %(tag)s || g, 's', %(d)s, '{}'::jsonb, "
            "CASE WHEN g %% 10 = 0 THEN NULL ELSE 'tenant:' || (g %% %(keys)s) END, "
            "now() - interval '1 minute' "
            "FROM generate_series(1, %(n)s) g",
            {"tag": tag, "d": destination, "n": n, "keys": max(1, keys)},
        )
        conn.execute("ANALYZE outbox_message")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", help="PostgreSQL server (default: the machine's, else embedded)")
    parser.add_argument("--redis-url", help=f"Redis (default {MACHINE_REDIS_URL})")
    parser.add_argument(
        "--embedded", action="store_true", help="embedded servers even if the machine has some"
    )
    parser.add_argument(
        "--backlogs", default="0,10000,100000", help="limited backlog sizes (comma-separated)"
    )
    parser.add_argument("--keys", type=int, default=100, help="fairness keys in the backlog (default 100)")
    parser.add_argument("--repeat", type=int, default=5, help="takes per figure (default 5)")
    args = parser.parse_args()

    with servers(args, MACHINE_REDIS_URL, "outbox-bench-windows-") as (admin_url, redis_url, where):
        url = recreate_database(admin_url, BENCH_DATABASE)
        try:
            migrate(url)
            print(f"servers: {where}; {args.keys} fairness keys; median of {args.repeat} takes")
            print(f"{'limited backlog':>16}  {'(a) 1,000 unlimited, ms':>24}  {'(b) window of 150, ms':>22}")
            with connect(url) as conn:
                conn.execute(
                    "INSERT INTO outbox_destination (destination, limit_per_second, limit_reason, "
                    "limit_set_by, limit_set_at) VALUES (%s, 100, 'bench', 'bench', now())",
                    (LIMITED,),
                )
            relay = Relay(database_url=url, redis_url=redis_url, namespace=NAMESPACE, batch_size=FREE_ROWS)
            try:
                for size in (int(b) for b in args.backlogs.split(",")):
                    with connect(url) as conn:
                        conn.execute("DELETE FROM outbox_message")
                    clear_namespace(redis_url, NAMESPACE)
                    fill(url, LIMITED, size, args.keys, "l")
                    free, window = [], []
                    for i in range(args.repeat):
                        # The window is emptied (its rows settled) so that each take fills it again.
                        with connect(url) as conn:
                            conn.execute(
                                "UPDATE outbox_message SET state = 'sent', provider_ref = 'r', "
                                "completed_at = now() WHERE state = 'dispatched'"
                            )
                        fill(url, FREE, FREE_ROWS, 1, f"f{i}-")
                        relay._windowed_read_at = float("-inf")
                        started = time.perf_counter()
                        relay.run_once()
                        free.append((time.perf_counter() - started) * 1000)
                        # The window alone: nothing of the other destination is due.
                        with connect(url) as conn:
                            conn.execute(
                                "UPDATE outbox_message SET state = 'sent', provider_ref = 'r', "
                                "completed_at = now() WHERE state = 'dispatched'"
                            )
                        # As the relay's loop does at a refill tick: the windows only.
                        relay.refill_only = True
                        started = time.perf_counter()
                        relay.run_once()
                        window.append((time.perf_counter() - started) * 1000)
                    print(
                        f"{size:>16,}  {statistics.median(free):>24.1f}  {statistics.median(window):>22.1f}"
                    )
            finally:
                relay.close()
            print(
                "(c) statements per take: 1 (limits, at every take while a limit exists; else once a second)"
            )
            print("    + 1 (the take of the other destinations) + 1 per limited destination (its window)")
        finally:
            clear_namespace(redis_url, NAMESPACE)
            drop_database(admin_url, BENCH_DATABASE)


if __name__ == "__main__":
    main()
