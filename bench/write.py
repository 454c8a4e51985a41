"""What does ``outbox.write`` add to a business transaction?

Times one business transaction through a SQLAlchemy ``Session`` -- an ``INSERT`` into a demo
``orders`` table, then ``COMMIT`` -- alone (variant A), and with ``outbox.write(...)`` added in the
same transaction (variant B). The variants are interleaved round by round (A/B, then B/A, ...), so
that machine noise hits both alike, after a warm-up. Prints median, p90 and p99 per variant, the
ratio of medians (target < 1.3) and the round trips per transaction. ``--floor`` adds a variant C,
A plus a ``SELECT 1``: what one more round trip costs by itself, the floor under any B/A.

    python bench/write.py --database-url postgresql://postgres@127.0.0.1:5432/bench_write -n 2000

Without ``--database-url`` or ``$OUTBOX_DATABASE_URL`` an embedded PostgreSQL (pgserver) is started
in a temporary directory. The script migrates the database (``outbox.migrate.upgrade``), creates
its ``orders`` table, and at the end empties ``outbox_message`` and drops ``orders`` again. Use a
throwaway database: it refuses to start when either table already holds rows, unless ``--reset``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session

import outbox
from outbox.db import make_engine
from outbox.migrate import upgrade
from outbox.settings import redact_url

TARGET_RATIO = 1.3

CREATE_ORDERS = """
CREATE TABLE orders (
    id bigserial PRIMARY KEY,
    customer text NOT NULL,
    amount_cents int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
SELECT_ONE = text("SELECT 1")
INSERT_ORDER = text(
    "INSERT INTO orders (customer, amount_cents) VALUES (:customer, :amount_cents) RETURNING id"
)


@dataclass
class RoundTrips:
    """Counts what goes over the wire: each statement, plus BEGIN and COMMIT."""

    statements: int = 0
    transactions: int = 0
    log: list[str] = field(default_factory=list)

    def attach(self, engine: Engine) -> None:
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "commit", self._commit)

    def detach(self, engine: Engine) -> None:
        event.remove(engine, "before_cursor_execute", self._statement)
        event.remove(engine, "commit", self._commit)

    def _statement(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements += 1

    def _commit(self, conn: Any) -> None:
        self.transactions += 1

    def per_transaction(self) -> float:
        # psycopg sends BEGIN before the first statement of a transaction, then COMMIT at the end.
        return (self.statements + 2 * self.transactions) / max(self.transactions, 1)


def business_only(engine: Engine, n: int) -> None:
    with Session(engine) as s, s.begin():
        s.execute(INSERT_ORDER, {"customer": f"customer-{n}", "amount_cents": 1000 + n % 500}).scalar_one()


def business_and_outbox(engine: Engine, n: int) -> None:
    with Session(engine) as s, s.begin():
        order_id = s.execute(
            INSERT_ORDER, {"customer": f"customer-{n}", "amount_cents": 1000 + n % 500}
        ).scalar_one()
        outbox.write(
            s,
            key=f"order:{order_id}",
            step="charge",
            destination="payments.charge",
            payload={"order_id": order_id, "amount_cents": 1000 + n % 500, "currency": "EUR"},
        )


def business_and_a_round_trip(engine: Engine, n: int) -> None:
    """The floor under B: one more statement that does nothing (``--floor``)."""
    with Session(engine) as s, s.begin():
        s.execute(INSERT_ORDER, {"customer": f"customer-{n}", "amount_cents": 1000 + n % 500}).scalar_one()
        s.execute(SELECT_ONE).scalar_one()


VARIANTS: dict[str, Callable[[Engine, int], None]] = {
    "A business tx alone": business_only,
    "B business tx + outbox.write": business_and_outbox,
}
FLOOR = {"C business tx + SELECT 1": business_and_a_round_trip}


def percentile(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    rank = max(1, min(len(sorted_ms), round(q / 100 * len(sorted_ms) + 0.5)))
    return sorted_ms[rank - 1]


def count_round_trips(engine: Engine, run: Callable[[Engine, int], None], n: int) -> float:
    counter = RoundTrips()
    counter.attach(engine)
    try:
        for i in range(n):
            run(engine, 10_000_000 + i)
    finally:
        counter.detach(engine)
    return counter.per_transaction()


def bench(engine: Engine, n: int, warmup: int, floor: bool = False) -> None:
    variants = {**VARIANTS, **(FLOOR if floor else {})}
    names = list(variants)
    for i in range(warmup):
        for name in names:
            variants[name](engine, i)
    trips = {name: count_round_trips(engine, variants[name], 20) for name in names}

    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for i in range(n):
        # A/B, then B/A: neither variant always runs right after the other.
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            run = variants[name]
            started = time.perf_counter_ns()
            run(engine, i)
            samples[name].append((time.perf_counter_ns() - started) / 1e6)

    print(f"{'variant':<32} {'median ms':>10} {'p90 ms':>10} {'p99 ms':>10} {'round trips':>12}")
    medians = {}
    for name in names:
        ms = sorted(samples[name])
        medians[name] = statistics.median(ms)
        print(
            f"{name:<32} {medians[name]:>10.3f} {percentile(ms, 90):>10.3f} {percentile(ms, 99):>10.3f} "
            f"{trips[name]:>12.1f}"
        )
    ratio = medians[names[1]] / medians[names[0]]
    verdict = "met" if ratio < TARGET_RATIO else "NOT met"
    print(f"ratio of medians B/A: {ratio:.3f} (target < {TARGET_RATIO}: {verdict})")
    print(f"outbox.write adds {medians[names[1]] - medians[names[0]]:.3f} ms at the median")
    if floor:
        extra = medians[names[2]] - medians[names[0]]
        print(
            f"one more round trip (C) adds {extra:.3f} ms: the floor of any B/A is "
            f"{medians[names[2]] / medians[names[0]]:.3f}"
        )


class NotAThrowawayDatabase(Exception):
    pass


def prepare(engine: Engine, reset: bool) -> str:
    """Migrate, check that the database holds nothing worth keeping, create ``orders``."""
    upgrade(engine)
    with engine.begin() as conn:
        outbox_rows = conn.execute(text("SELECT count(*) FROM outbox_message")).scalar_one()
        has_orders = conn.execute(text("SELECT to_regclass('orders') IS NOT NULL")).scalar_one()
        order_rows = conn.execute(text("SELECT count(*) FROM orders")).scalar_one() if has_orders else 0
        if (outbox_rows or order_rows) and not reset:
            raise NotAThrowawayDatabase(
                f"the database already holds {outbox_rows} outbox rows and {order_rows} orders; this "
                "benchmark empties both tables: point it at a throwaway database, or pass --reset"
            )
        conn.execute(text("TRUNCATE outbox_message, outbox_attempt"))
        conn.execute(text("DROP TABLE IF EXISTS orders"))
        conn.execute(text(CREATE_ORDERS))
        return str(conn.execute(text("SHOW server_version")).scalar())


def tidy(engine: Engine) -> None:
    """Leave no pending row for a relay to find, and no orders table."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox_message, outbox_attempt"))
        conn.execute(text("DROP TABLE IF EXISTS orders"))


@contextlib.contextmanager
def database(url: str | None) -> Iterator[tuple[str, str]]:
    if url:
        yield url, redact_url(url)
        return
    from outbox.testing.embedded import embedded_postgres

    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with embedded_postgres(directory) as embedded:
            yield embedded, "embedded pgserver (unix socket)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL (default: $OUTBOX_DATABASE_URL, else an embedded pgserver in a temp dir)",
    )
    parser.add_argument("-n", type=int, default=2000, help="measured transactions per variant (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured rounds first (default 200)")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run variant C, A plus a `SELECT 1`: what one more round trip costs by itself",
    )
    parser.add_argument(
        "--reset", action="store_true", help="empty outbox_message and drop orders even if they hold rows"
    )
    args = parser.parse_args(argv)
    if args.n < 1 or args.warmup < 0:
        parser.error("-n must be at least 1 and --warmup at least 0")

    with database(args.database_url) as (url, shown):
        # No pre-ping: it would add the same extra round trip to both variants and hide the cost.
        engine = make_engine(url, pool_pre_ping=False, pool_size=1, max_overflow=0)
        try:
            try:
                version = prepare(engine, args.reset)
            except NotAThrowawayDatabase as exc:
                print(f"bench/write.py: {exc}", file=sys.stderr)
                return 2
            print(
                f"database: {shown} (PostgreSQL {version}); python {platform.python_version()}, "
                f"SQLAlchemy {sqlalchemy.__version__}, outbox {outbox.__version__}"
            )
            print(f"{args.n} transactions per variant, interleaved, after {args.warmup} warm-up rounds")
            try:
                bench(engine, args.n, args.warmup, args.floor)
            finally:
                tidy(engine)
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
