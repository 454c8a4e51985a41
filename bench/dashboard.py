"""The dashboard's pages on a big table (issue 16): every page in <= 200 ms with 1,000,000 rows in
``outbox_message``.

A database of its own is filled with ``--rows`` rows shaped like a day of production: 96% sent
(completed over the last 24 hours, one confirmed attempt row each, a provider reference), 1.5%
failed with an error text, 0.5% unknown, 1% pending, 1% cancelled, over five destinations, a
tenth of them on ordering keys, a thousand batches; then ANALYZE. ``outbox dashboard`` is served
by uvicorn as a real process, and each page is requested ``--requests`` times (after one warm-up
request) by a logged-in client: median and p95 of the whole request, as a browser would wait.

    python bench/dashboard.py                     # 1,000,000 rows, 20 requests a page
    python bench/dashboard.py --rows 200000       # a quicker look
    python bench/dashboard.py --keep              # reuse the filled database next time
    python bench/dashboard.py --keep --database mydb --skip-pages   # the queries only

Before the pages, the read model's queries are timed in this process, ``--requests`` times each
after a warm-up: the overview's counts (estimates above a size) on a connection set up as the
dashboard's (JIT off, statement timeout), the query behind ``outbox status`` (exact counts) in
its read-only transaction, the reconciler's metrics reading, and ``outbox status --json`` as a
process (interpreter start included).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import connect, drop_database, migrate, servers, wait_for, with_database  # noqa: E402
from outbox.dashboard.security import hash_password  # noqa: E402

DATABASE = "bench_dashboard"
BUDGET_MS = 200.0
DESTINATIONS = ["payments.charge", "invoicing.export", "mail.send", "crm.update", "webhooks.deliver"]
SECRET = "bench-dashboard-secret-0123456789abcdef"

FILL = """
INSERT INTO outbox_message (key, step, destination, payload, state, attempts, created_at,
    available_at, dispatched_at, claimed_at, completed_at, unknown_since, provider_ref, last_error,
    ordering_key, claim_token, batch_id)
SELECT 'order:' || g, 'charge', (ARRAY{destinations})[1 + g %% 5],
       jsonb_build_object('amount_cents', 100 + g %% 9000, 'currency', 'EUR',
                          'customer', 'c' || (g %% 50000)),
       s.state, CASE WHEN s.state = 'pending' THEN 0 ELSE 1 END,
       t.at, t.at, t.at + interval '2 ms', t.at + interval '3 ms',
       CASE WHEN s.state IN ('sent', 'failed', 'cancelled') THEN t.at + (g %% 900) * interval '1 ms' END,
       CASE WHEN s.state = 'unknown' THEN t.at + interval '1 s' END,
       CASE WHEN s.state = 'sent' THEN 'ch_' || g END,
       CASE WHEN s.state = 'failed' THEN 'card declined: insufficient funds (HTTP 402) #' || (g %% 97)
            WHEN s.state = 'unknown' THEN 'ReadTimeout: no answer within time_limit' END,
       CASE WHEN g %% 10 = 0 THEN 'customer:' || (g %% 50000) END,
       CASE WHEN s.state <> 'pending' THEN gen_random_uuid() END,
       CASE WHEN g %% 1000 < 3 THEN 1 + g %% 1000 END
FROM generate_series(%(start)s, %(stop)s) AS g,
     LATERAL (SELECT CASE WHEN g %% 1000 < 960 THEN 'sent'
                          WHEN g %% 1000 < 975 THEN 'failed'
                          WHEN g %% 1000 < 980 THEN 'unknown'
                          WHEN g %% 1000 < 990 THEN 'pending'
                          ELSE 'cancelled' END AS state) s,
     LATERAL (SELECT now() - interval '24 hours' + (g::float8 / %(rows)s) * interval '24 hours' AS at) t
"""
ATTEMPTS = """
INSERT INTO outbox_attempt (message_id, attempt, claim_token, started_at, finished_at, outcome,
                            http_status, error)
SELECT id, 1, claim_token, claimed_at, COALESCE(completed_at, unknown_since),
       CASE state WHEN 'sent' THEN 'sent' WHEN 'failed' THEN 'failed' WHEN 'unknown' THEN 'unknown'
                  ELSE 'released' END,
       CASE state WHEN 'sent' THEN 200 WHEN 'failed' THEN 402 END,
       CASE WHEN state IN ('failed', 'unknown') THEN last_error END
FROM outbox_message WHERE claim_token IS NOT NULL AND id BETWEEN %(start)s AND %(stop)s
"""
BATCHES = """
INSERT INTO outbox_batch (id, name, created_at, total)
SELECT g, 'import-' || g, now() - interval '1 day', NULL FROM generate_series(1, 1000) g
ON CONFLICT DO NOTHING
"""


def fill(url: str, rows: int) -> None:
    step = 100_000
    with connect(url) as conn:
        conn.execute(BATCHES)
        sql = FILL.replace("{destinations}", "[" + ", ".join(f"'{d}'" for d in DESTINATIONS) + "]")
        started = time.monotonic()
        for start in range(1, rows + 1, step):
            stop = min(rows, start + step - 1)
            conn.execute(sql, {"start": start, "stop": stop, "rows": rows})
            conn.execute(ATTEMPTS, {"start": start, "stop": stop})
            print(
                f"\r  filled {stop:,} of {rows:,} rows ({time.monotonic() - started:.0f} s)",
                end="",
                flush=True,
            )
        print()
        conn.execute("ANALYZE outbox_message")
        conn.execute("ANALYZE outbox_attempt")
        conn.execute("ANALYZE outbox_batch")


def row_count(url: str) -> int:
    with connect(url) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox_message").fetchone()[0])  # type: ignore[index]


def _timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    fn()  # warm-up: plans cached, pages in shared buffers
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))]


def measure_queries(url: str, n: int) -> list[tuple[str, float, float]]:
    """p50/p95 of the read model's three users, and of ``outbox status --json`` as a process."""
    from outbox import metrics
    from outbox.dashboard import app as dashboard_app
    from outbox.dashboard import queries
    from outbox.db import make_engine
    from outbox.ops.inspect import status

    out = []
    dashboard_engine = make_engine(url)
    dashboard_app._session_settings(dashboard_engine)
    ops_engine = make_engine(url)
    try:

        def overview_counts() -> None:
            with dashboard_engine.connect() as conn:
                queries.counts(conn)

        def status_report() -> None:
            options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            with ops_engine.connect().execution_options(**options) as conn, conn.begin():
                status(conn)

        def metrics_reading() -> None:
            with connect(url) as conn:
                metrics.read_database(conn)

        env = {**os.environ, "OUTBOX_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}

        def status_process() -> None:
            subprocess.run(
                [sys.executable, "-m", "outbox", "status", "--json"],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )

        for name, fn, runs in (
            ("dashboard: overview counts", overview_counts, n),
            ("outbox status: ops.inspect.status", status_report, n),
            ("metrics: read_database", metrics_reading, n),
            ("outbox status --json (a process)", status_process, max(5, n // 4)),
        ):
            median, p95 = _timed(fn, runs)
            out.append((name, median, p95))
    finally:
        dashboard_engine.dispose()
        ops_engine.dispose()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(client: httpx.Client, method: str, path: str, n: int, **kw: object) -> tuple[float, float, int]:
    times = []
    status = 0
    for i in range(n + 1):
        started = time.perf_counter()
        r = client.request(method, path, **kw)  # type: ignore[arg-type]
        elapsed = (time.perf_counter() - started) * 1000
        status = r.status_code
        if i:  # the first is a warm-up (templates compiled, plans cached)
            times.append(elapsed)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))], status


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the database (and reuse a filled one)")
    parser.add_argument(
        "--database", default=DATABASE, help=f"the database to (re)create (default {DATABASE})"
    )
    parser.add_argument("--skip-pages", action="store_true", help="time the queries only, not the pages")
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument(
        "--embedded", action="store_true", help="embedded servers even if the machine's answer"
    )
    args = parser.parse_args()

    with servers(args, "redis://127.0.0.1:6379/14", "outbox-bench-dashboard-") as (admin_url, _redis, where):
        database = args.database
        url = with_database(admin_url, database)
        reuse = False
        if args.keep:
            try:
                reuse = row_count(url) == args.rows
            except Exception:
                reuse = False
        if not reuse:
            with connect(admin_url) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{database}"')
            migrate(url)
            print(f"filling {args.rows:,} rows ({where} PostgreSQL)")
            fill(url, args.rows)
        else:
            print(f"reusing {args.rows:,} rows in {database}")
        print(f"\n{'query':<44} {'median':>9} {'p95':>9}")
        for name, median, p95 in measure_queries(url, args.requests):
            print(f"{name:<44} {median:>7.1f}ms {p95:>7.1f}ms")
        if args.skip_pages:
            if not args.keep:
                drop_database(admin_url, database)
            return 0
        with connect(url) as conn:
            some = conn.execute(
                "SELECT (SELECT id FROM outbox_message WHERE state = 'failed' ORDER BY id LIMIT 1), "
                "(SELECT id FROM outbox_message WHERE state = 'sent' ORDER BY id DESC LIMIT 1), "
                "(SELECT key FROM outbox_message WHERE state = 'sent' ORDER BY id DESC LIMIT 1), "
                "(SELECT provider_ref FROM outbox_message WHERE state = 'sent' "
                " ORDER BY id LIMIT 1 OFFSET 5000)"
            ).fetchone()
            assert some is not None
            failed_id, sent_id, sent_key, ref = some
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            users = Path(tmp) / "users"
            users.write_text(f"bench operate {hash_password('bench-pw')}\n")
            env = {
                **os.environ,
                "OUTBOX_DATABASE_URL": url,
                "OUTBOX_DASHBOARD_SECRET": SECRET,
                "PYTHONPATH": str(ROOT),
            }
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "outbox",
                    "dashboard",
                    "--port",
                    str(port),
                    "--users",
                    str(users),
                    "--insecure-cookies",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            try:
                base = f"http://127.0.0.1:{port}"

                def up() -> bool:
                    try:
                        socket.create_connection(("127.0.0.1", port), 0.2).close()
                        return True
                    except OSError:
                        return False

                wait_for(up, 30, "the dashboard to listen")
                with httpx.Client(base_url=base, timeout=30, follow_redirects=False) as client:
                    page = client.get("/login")
                    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
                    r = client.post(
                        "/login", data={"user": "bench", "password": "bench-pw", "csrf_token": token}
                    )
                    assert r.status_code == 303, r.text
                    home = client.get("/")
                    token = re.search(r'name="csrf_token" value="([^"]+)"', home.text).group(1)  # type: ignore[union-attr]
                    deep = client.get("/rows?state=failed")
                    for _ in range(20):  # 20 pages deep: keyset, no OFFSET
                        m = re.search(r'rel="next" href="([^"]+)"', deep.text)
                        if not m:
                            break
                        deep = client.get(m.group(1).replace("&amp;", "&"))
                    cursor_page = deep.url.raw_path.decode()
                    pages = [
                        ("overview", "GET", "/", {}),
                        ("overview (htmx refresh)", "GET", "/", {"headers": {"HX-Request": "true"}}),
                        ("search: exact key", "GET", f"/search?q={sent_key}", {}),
                        ("search: provider ref", "GET", f"/search?q={ref}", {}),
                        ("search: key prefix", "GET", "/rows?key_prefix=order:12345", {}),
                        ("row (sent)", "GET", f"/rows/{sent_id}", {}),
                        ("row (failed)", "GET", f"/rows/{failed_id}", {}),
                        ("key steps", "GET", f"/keys?key={sent_key}", {}),
                        ("failed list", "GET", "/rows?state=failed", {}),
                        ("failed list, 21st page", "GET", cursor_page, {}),
                        (
                            "failed, one destination, >1h, error text",
                            "GET",
                            "/rows?state=failed&destination=mail.send&older_than=1h&error=insufficient",
                            {},
                        ),
                        ("unknown list", "GET", "/rows?state=unknown", {}),
                        ("all rows, newest first", "GET", "/rows", {}),
                        ("batches", "GET", "/batches", {}),
                        ("batch", "GET", "/batches/1", {}),
                        ("blocked ordering keys", "GET", "/blocked", {}),
                        (
                            "bulk replay preview (1,000 failed rows)",
                            "POST",
                            "/preview",
                            {
                                "data": {
                                    "action": "replay",
                                    "state": "failed",
                                    "destination": "mail.send",
                                    "csrf_token": token,
                                }
                            },
                        ),
                    ]
                    print(f"\n{'page':<44} {'median':>9} {'p95':>9}  status")
                    worst = 0.0
                    for name, method, path, kw in pages:
                        median, p95, status = measure(client, method, path, args.requests, **kw)
                        worst = max(worst, p95)
                        flag = "" if p95 <= BUDGET_MS else "  over budget"
                        print(f"{name:<44} {median:>7.1f}ms {p95:>7.1f}ms  {status}{flag}")
                    print(
                        f"\nworst p95 {worst:.1f} ms (budget {BUDGET_MS:.0f} ms) with {args.rows:,} rows, "
                        f"{args.requests} requests a page"
                    )
            finally:
                server.terminate()
                server.wait(10)
        if not args.keep:
            drop_database(admin_url, database)
    return 0


if __name__ == "__main__":
    sys.exit(main())
