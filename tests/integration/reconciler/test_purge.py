"""``purge`` against real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from helpers import elapse
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.reconciler.jobs.purge import FLOOR_RESET_SECONDS, Floors, purge

from .support import (
    settle,
    write_rows,
)

# -- 4. purge --------------------------------------------------------------------------------------


def test_purge_deletes_old_terminal_rows_in_bounded_batches(clean, engine, db):
    db.execute(
        """
        INSERT INTO outbox_message (key, step, destination, payload, state, provider_ref, completed_at)
        SELECT 'old:' || g, 'charge', 'payments.charge', '{}', 'sent', 'ch_' || g, now() - interval '2 hours'
        FROM generate_series(1, 2500) AS g
        """
    )
    old_sent = db.execute("SELECT min(id) FROM outbox_message").fetchone()[0]
    db.execute(
        "INSERT INTO outbox_attempt (message_id, attempt, claim_token) VALUES (%s, 1, %s)",
        (old_sent, uuid.uuid4()),
    )
    ids = write_rows(engine, 4)
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:0", step="charge")
    settle(db, ids[1], "sent", ref="x")
    settle(db, ids[2], "failed", error="card declined")
    elapse(db, 2 * 3600, [ids[0], ids[2]])

    assert purge(db, retention_seconds=3600, max_batches=2) == {"purged": 2000, "batches": 2}
    assert purge(db, retention_seconds=3600) == {"purged": 501, "batches": 1}
    assert purge(db, retention_seconds=3600) == {}
    left = db.execute("SELECT id, state FROM outbox_message ORDER BY id").fetchall()
    assert left == [(ids[1], "sent"), (ids[2], "failed"), (ids[3], "pending")]
    # The purged row's attempt row went with it; the kept rows' own claims remain.
    fenced = db.execute("SELECT message_id FROM outbox_attempt ORDER BY message_id").fetchall()
    assert fenced == [(ids[1],), (ids[2],)]


# -- where the statements resume (Floors) -----------------------------------------------------------


def _old_sent_rows(db, prefix: str, count: int, hours: float) -> None:
    db.execute(
        """
        INSERT INTO outbox_message (key, step, destination, payload, state, provider_ref, completed_at)
        SELECT %(prefix)s || g, 'charge', 'payments.charge', '{}', 'sent', 'ch_' || g,
               now() - %(hours)s * interval '1 hour' + g * interval '1 millisecond'
        FROM generate_series(1, %(count)s) AS g
        """,
        {"prefix": prefix, "count": count, "hours": hours},
    )


def test_a_floor_only_delays_a_row_behind_it_until_the_reset(clean, db):
    floors = Floors()
    _old_sent_rows(db, "newer:", 30, hours=2)
    assert purge(db, retention_seconds=3600, floors=floors) == {"purged": 30, "batches": 1}
    assert floors.message is not None
    # A row completed before the floor (a chain repaired, a batch finished late): the floor leaves
    # it where it is, and the next run after a reset takes it.
    _old_sent_rows(db, "behind:", 1, hours=3)
    assert purge(db, retention_seconds=3600, floors=floors) == {}
    assert db.execute("SELECT count(*) FROM outbox_message WHERE key = 'behind:1'").fetchone()[0] == 1
    floors.expire(floors.reset_at)
    assert floors.message is None
    assert purge(db, retention_seconds=3600, floors=floors) == {"purged": 1, "batches": 1}
    assert db.execute("SELECT count(*) FROM outbox_key_ledger WHERE key = 'behind:1'").fetchone()[0] == 1


def test_a_floor_never_purges_early(clean, db):
    floors = Floors()
    _old_sent_rows(db, "old:", 10, hours=2)
    _old_sent_rows(db, "young:", 10, hours=0.5)
    assert purge(db, retention_seconds=3600, floors=floors) == {"purged": 10, "batches": 1}
    assert purge(db, retention_seconds=3600, floors=floors) == {}
    left = db.execute("SELECT count(*) FROM outbox_message WHERE key LIKE 'young:%'").fetchone()[0]
    assert left == 10


def _ledger_entries(db, prefix: str, count: int, hours: float) -> None:
    db.execute(
        """
        INSERT INTO outbox_key_ledger (message_id, completed_at, attempts, confirmed, ambiguous, key, step,
                                       destination, payload_hash, state, provider_ref)
        SELECT g, now() - %(hours)s * interval '1 hour' + g * interval '1 millisecond', 1, 1, false,
               %(prefix)s || g, 'charge', 'payments.charge', sha256('x'), 'sent', 'ch_' || g
        FROM generate_series(1, %(count)s) AS g
        """,
        {"prefix": prefix, "count": count, "hours": hours},
    )


def _scan_buffers(db, after) -> int:
    """Buffers the ledger drop's oldest-first scan of the completed_at index touched (index and
    heap pages), in a transaction rolled back."""
    db.execute("BEGIN")
    try:
        (plan,) = db.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store.recovery._DROP_LEDGER,
            {"horizon": 3600.0, "limit": 100, "after": after},
        ).fetchone()
    finally:
        db.execute("ROLLBACK")

    def scans(node):
        if node.get("Index Name") == "outbox_key_ledger_completed_idx":
            yield node
        for child in node.get("Plans", ()):
            yield from scans(child)

    found = list(scans(plan[0]["Plan"]))
    assert found, "the drop no longer reads the completed_at index"
    return sum(int(n["Shared Hit Blocks"]) + int(n["Shared Read Blocks"]) for n in found)


def test_the_ledger_drop_resumes_past_the_entries_it_deleted(clean, db):
    """Entries a drop deleted stay in the completed_at index until a vacuum: without the floor,
    the next drop steps over every one of them; with it, it starts where the last one ended."""
    floors = Floors()
    _ledger_entries(db, "gone:", 20_000, hours=5)
    counts = purge(db, retention_seconds=60, ledger_horizon_seconds=3600, floors=floors)
    assert counts["ledger_dropped"] == 20_000
    assert floors.ledger is not None
    _ledger_entries(db, "next:", 100, hours=2)
    # A first scan marks the dead entries it meets, so that the next ones skip their heap pages:
    # both measured scans then read index pages only.
    _scan_buffers(db, None)
    from_the_oldest = _scan_buffers(db, None)
    from_the_floor = _scan_buffers(db, floors.ledger)
    # 20,000 dead entries fill some 50 index pages; 100 live ones one or two.
    assert from_the_floor * 5 < from_the_oldest, (from_the_floor, from_the_oldest)
    dropped = purge(db, retention_seconds=60, ledger_horizon_seconds=3600, floors=floors)
    assert dropped == {"ledger_dropped": 100}
    assert db.execute("SELECT count(*) FROM outbox_key_ledger").fetchone()[0] == 0


def _scans_buffers(db, after) -> int:
    """Buffers every scan of the completed_at index in the ledger drop touched (index and heap
    pages), the DELETE's re-check included, in a transaction rolled back."""
    db.execute("BEGIN")
    try:
        (plan,) = db.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store.recovery._DROP_LEDGER,
            {"horizon": 3600.0, "limit": 5000, "after": after},
        ).fetchone()
    finally:
        db.execute("ROLLBACK")

    def scans(node):
        if node.get("Index Name") == "outbox_key_ledger_completed_idx":
            yield node
        for child in node.get("Plans", ()):
            yield from scans(child)

    return sum(int(n["Shared Hit Blocks"]) + int(n["Shared Read Blocks"]) for n in scans(plan[0]["Plan"]))


def test_the_ledger_drop_with_a_backlog_resumes_past_its_dead_entries_in_every_scan(clean, db):
    """With more due entries than one statement drops, the DELETE's own re-check of the horizon
    reads the completed_at index as well: it must start at the floor too, or it still steps over
    every dead entry from the oldest."""
    floors = Floors()
    _ledger_entries(db, "gone:", 100_000, hours=10)
    while purge(db, retention_seconds=60, ledger_horizon_seconds=3600, floors=floors).get("ledger_dropped"):
        pass
    _ledger_entries(db, "due:", 6000, hours=5)
    _ledger_entries(db, "young:", 50_000, hours=0.9)
    db.execute("ANALYZE outbox_key_ledger")
    _scans_buffers(db, None)
    from_the_oldest = _scans_buffers(db, None)
    from_the_floor = _scans_buffers(db, floors.ledger)
    # 100,000 dead entries fill some 270 index pages; 6000 due ones some 120 (index and heap).
    assert from_the_floor * 2 < from_the_oldest, (from_the_floor, from_the_oldest)


def test_floors_reset_after_their_interval():
    floors = Floors()
    floors.message = floors.ledger = datetime.now(UTC)
    floors.expire(floors.reset_at - 1)
    assert floors.message is not None and floors.ledger is not None
    at = floors.reset_at
    floors.expire(at)
    assert floors.message is None and floors.ledger is None
    assert floors.reset_at == at + FLOOR_RESET_SECONDS


def test_a_row_completed_at_minus_infinity_is_purged_without_a_floor(clean, db):
    """Only hand-written SQL makes one; it goes like any other, and sets no floor."""
    floors = Floors()
    _old_sent_rows(db, "inf:", 1, hours=2)
    db.execute("UPDATE outbox_message SET completed_at = '-infinity' WHERE key = 'inf:1'")
    assert purge(db, retention_seconds=3600, floors=floors) == {"purged": 1, "batches": 1}
    assert floors.message is None
    db.execute("UPDATE outbox_key_ledger SET completed_at = '-infinity' WHERE key = 'inf:1'")
    assert purge(db, retention_seconds=3600, ledger_horizon_seconds=3600, floors=floors) == {
        "ledger_dropped": 1
    }
    assert floors.ledger is None
