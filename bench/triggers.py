"""What migrations 0022's, 0023's and 0024's triggers cost a delivery (issue 30): the claim ->
record cycle of this code's own statements (``outbox.store``), with the triggers enabled and disabled, in one
run, alternating blocks, on one database:

* **plain** rows (no ordering key): the triggers' ``WHEN`` is all they meet;
* **ordered** rows (10 per ordering key, claimed head first): the ordered-claim trigger probes
  the key's earlier rows once more (the claim's own WHERE already did);
* **old settle**: a row moved to ``sent`` by a statement that does not set ``chains_known_at``
  (a release before 0022): the chains mark, per row;
* **limited**: plain rows of a destination with an in-flight limit (migration 0023; a limit no
  claim reaches): the limit trigger locks the destination's row and counts its calls in flight.
  A plain row's claim runs that function too (its WHEN cannot know the destination's limit): it
  reads the destination's row and returns.
* **paced**: plain rows of a destination with a calls-per-second limit (migration 0024; a rate so
  high that no claim waits): the trigger locks the destination's row and books each start,
  one more UPDATE of that row per claim.

Each figure is microseconds per row, median of the blocks; the ratio is enabled / disabled.
One connection, autocommit, as the worker sends them: round trips dominate both sides, so the
functions' own time is read from PostgreSQL too (``pg_stat_user_functions``).

    python bench/triggers.py                 # 4,000 rows per block, 6 blocks per side
    python bench/triggers.py -n 1000 --blocks 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import MACHINE_DATABASE_URL, connect, drop_database, migrate, recreate_database  # noqa: E402
from outbox import store  # noqa: E402

DATABASE = "bench_triggers"
DEST = "bench.charge"
TRIGGERS = (
    "outbox_message_ordered_claim",
    "outbox_message_failed_stands",
    "outbox_message_chains_unknown",
    "outbox_message_payload_versions_claim",
    "outbox_message_payload_versions_gate",
    "outbox_message_in_flight_limit",
)
#: The functions they call, as pg_stat_user_functions names them.
FUNCTIONS = [
    "outbox_message_ordered_claim",
    "outbox_message_failed_stands",
    "outbox_message_chains_unknown",
    "outbox_message_payload_versions_claim",
    "outbox_payload_versions_gate",
    "outbox_message_in_flight_limit",
]
ROWS_PER_KEY = 10
KINDS = ("plain", "ordered", "old settle", "limited", "paced")


def write(conn: Any, n: int, ordered: bool, tag: str) -> list[int]:
    """``n`` rows; ordered: row g on key g % (n / 10), so that each key's rows interleave."""
    keys = max(1, n // ROWS_PER_KEY)
    rows = conn.execute(
        "INSERT INTO outbox_message (key, step, destination, payload, ordering_key) "
        "SELECT %(tag)s || ':' || g, 'charge', %(d)s, '{}'::jsonb, "
        "CASE WHEN %(ordered)s THEN %(tag)s || ':c' || (g %% %(keys)s) END "
        "FROM generate_series(1, %(n)s) g RETURNING id",
        {"tag": tag, "d": DEST, "ordered": ordered, "keys": keys, "n": n},
    ).fetchall()
    return sorted(r[0] for r in rows)


def cycle(conn: Any, ids: list[int]) -> float:
    """Claim and record each row, in id order (a key's head before the rows behind it)."""
    started = time.perf_counter()
    for row_id in ids:
        claimed = store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30)
        assert claimed is not None, row_id
        done = store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref=f"ch_{row_id}"
        )
        assert done.state == "sent", done
    return (time.perf_counter() - started) / len(ids) * 1e6


def old_settle(conn: Any, ids: list[int]) -> float:
    """A release before 0022: claim and settle by plain statements without chains_known_at."""
    started = time.perf_counter()
    for row_id in ids:
        conn.execute(
            "UPDATE outbox_message SET state = 'in_flight', attempts = attempts + 1, "
            "claim_token = gen_random_uuid(), claimed_at = now(), "
            "lease_expires_at = now() + interval '30 seconds' WHERE id = %s AND state = 'pending'",
            (row_id,),
        )
        conn.execute(
            "UPDATE outbox_message SET state = 'sent', provider_ref = 'r', completed_at = now(), "
            "lease_expires_at = NULL WHERE id = %s AND state = 'in_flight'",
            (row_id,),
        )
    return (time.perf_counter() - started) / len(ids) * 1e6


def set_triggers(conn: Any, enabled: bool) -> None:
    verb = "ENABLE" if enabled else "DISABLE"
    for name in TRIGGERS:
        conn.execute(f"ALTER TABLE outbox_message {verb} TRIGGER {name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=4000, help="rows per block (default 4000)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per side and kind (default 6)")
    parser.add_argument(
        "--database-url", default=MACHINE_DATABASE_URL, help="a PostgreSQL to create the bench database on"
    )
    args = parser.parse_args()
    admin_url = args.database_url
    url = recreate_database(admin_url, DATABASE)
    try:
        migrate(url)
        results: dict[tuple[str, bool], list[float]] = {}
        with connect(url) as conn:
            # Superuser only: the functions' own time, which the wall clock of a busy machine hides.
            conn.execute("SET track_functions = 'pl'")
            for block in range(args.blocks):
                for kind in KINDS:
                    for enabled in (True, False) if block % 2 == 0 else (False, True):
                        set_triggers(conn, enabled)
                        limit = 1_000_000 if kind == "limited" else None
                        rate = 1_000_000 if kind == "paced" else None
                        conn.execute(
                            "INSERT INTO outbox_destination (destination, limit_in_flight, limit_per_second) "
                            "VALUES (%s, %s, %s) ON CONFLICT (destination) "
                            "DO UPDATE SET limit_in_flight = EXCLUDED.limit_in_flight, "
                            "limit_per_second = EXCLUDED.limit_per_second",
                            (DEST, limit, rate),
                        )
                        ids = write(
                            conn, args.n, kind == "ordered", f"b{block}{kind.replace(' ', '')}{int(enabled)}"
                        )
                        measure = old_settle if kind == "old settle" else cycle
                        results.setdefault((kind, enabled), []).append(measure(conn, ids))
                conn.execute("TRUNCATE outbox_message, outbox_attempt")
                conn.execute("VACUUM ANALYZE outbox_message")
            set_triggers(conn, True)
            conn.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(1.5)
        with connect(url) as conn:
            functions = conn.execute(
                "SELECT funcname, calls, self_time FROM pg_stat_user_functions WHERE funcname = ANY(%s)"
                " ORDER BY funcname",
                (FUNCTIONS,),
            ).fetchall()
        print(
            f"{args.n} rows per block, {args.blocks} blocks per side; µs per row (median), enabled / disabled"
        )
        for kind in KINDS:
            on = statistics.median(results[(kind, True)])
            off = statistics.median(results[(kind, False)])
            print(f"  {kind:<11} enabled {on:8.1f}  disabled {off:8.1f}  ratio {on / off:.3f}")
        print("the trigger functions themselves, timed by PostgreSQL (track_functions = 'pl'):")
        for name, calls, self_ms in functions:
            print(f"  {name:<40} {calls:7d} calls {self_ms * 1000 / max(calls, 1):8.1f} µs per call")
        print("  a plain row's claim calls outbox_message_in_flight_limit only (a primary-key read)")
    finally:
        drop_database(admin_url, DATABASE)


if __name__ == "__main__":
    main()
