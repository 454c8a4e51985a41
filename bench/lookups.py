"""How fast the reconciler settles `unknown` rows against a slow provider: N rows made `unknown`
(claimed, then recorded ambiguous, as after a worker killed with its calls in flight), half of
them charged at the provider (found: sent) and half not (not found: retried), then one
``resolve_unknown`` pass after another until none is due, at each lookup concurrency asked.

Prints rows/s, the most lookups the provider served at once (its own count) and the passes, one
line per concurrency, in one run; the provider is the simulator (``outbox.testing.provider``)
on 127.0.0.1, answering each lookup ``--latency-ms`` late.

    python bench/lookups.py                                   # the machine's servers, else embedded
    python bench/lookups.py -n 400 --latency-ms 300 --concurrency 1,4,16,64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

import outbox  # noqa: E402
from bench.common import connect, drop_database, migrate, recreate_database, servers  # noqa: E402
from outbox import store  # noqa: E402
from outbox.db import make_engine  # noqa: E402
from outbox.settlement import LookupClients, resolve_unknown  # noqa: E402
from outbox.testing.provider import ProviderSimulator  # noqa: E402

DATABASE = "bench_lookups"
DESTINATION = "payments.charge"


def declare(api: str) -> outbox.Handler:
    @outbox.handler(DESTINATION, time_limit=10, max_attempts=5)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("the bench calls no handler")

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        r = d.http.get(f"{api}/charges", params={"idempotency_key": d.idempotency_key})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def unknown_rows(url: str, n: int, api: str) -> None:
    """``n`` rows `unknown` and due now; the even ones charged at the provider."""
    engine = make_engine(url)
    try:
        with Session(engine) as session, session.begin():
            ids = [
                outbox.write(
                    session, key=f"order:{i}", step="charge", destination=DESTINATION, payload={"i": i}
                ).id
                for i in range(n)
            ]
    finally:
        engine.dispose()
    with connect(url) as conn:
        for row_id in ids:
            claimed = store.delivery.claim(conn, row_id=row_id, destination=DESTINATION, lease_seconds=30)
            assert claimed is not None
            store.delivery.record(
                conn, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="bench"
            )
        conn.execute("UPDATE outbox_message SET available_at = now() WHERE state = 'unknown'")
    with httpx.Client() as client:
        for i in range(0, n, 2):
            client.post(f"{api}/charges", json={"i": i}, headers={"Idempotency-Key": f"order:{i}:charge"})


def one(admin_url: str, n: int, latency_ms: float, concurrency: int) -> dict[str, Any]:
    url = recreate_database(admin_url, DATABASE)
    migrate(url)
    with ProviderSimulator() as provider:
        unknown_rows(url, n, provider.url)
        provider.configure(latency_ms=latency_ms)
        handler = declare(provider.url)
        clients = LookupClients()
        passes = 0
        settled: dict[str, int] = {}
        started = time.monotonic()
        try:
            with connect(url) as conn:
                while True:
                    counts = resolve_unknown(
                        conn, {DESTINATION: handler}, clients=clients, lookup_concurrency=concurrency
                    )
                    if not counts:
                        break
                    passes += 1
                    for k, v in counts.items():
                        settled[k] = settled.get(k, 0) + v
        finally:
            clients.close()
        elapsed = time.monotonic() - started
        stats = provider.stats()
    drop_database(admin_url, DATABASE)
    return {
        "concurrency": concurrency,
        "rows_per_second": n / elapsed,
        "seconds": elapsed,
        "most_in_flight": stats["most_lookups_in_flight"],
        "lookups": stats["lookups"],
        "passes": passes,
        "settled": settled,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=400, help="unknown rows per run (default 400)")
    parser.add_argument(
        "--latency-ms", type=float, default=300.0, help="each lookup's answer this late (default 300)"
    )
    parser.add_argument(
        "--concurrency", default="1,16", help="comma-separated lookup concurrencies (default 1,16)"
    )
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url", help="unused: the servers helper asks for one")
    parser.add_argument(
        "--embedded", action="store_true", help="start an embedded PostgreSQL even if the machine's answers"
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.n < 2 or any(c < 1 for c in levels):
        parser.error("-n must be at least 2 and every concurrency at least 1")
    with servers(args, "redis://127.0.0.1:6379/11", "outbox-bench-lookups-") as (admin_url, _redis, where):
        print(f"{args.n} unknown rows, lookups answered after {args.latency_ms:g} ms, PostgreSQL: {where}")
        base = None
        for level in levels:
            r = one(admin_url, args.n, args.latency_ms, level)
            base = base or r["rows_per_second"]
            print(
                f"concurrency {r['concurrency']:>3}: {r['rows_per_second']:7.1f} rows/s "
                f"({r['rows_per_second'] / base:.1f}x), {r['seconds']:.1f} s, "
                f"most lookups in flight {r['most_in_flight']}, {r['lookups']} lookups, "
                f"{r['passes']} passes, {r['settled']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
