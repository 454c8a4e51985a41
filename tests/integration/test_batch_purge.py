"""Batches under the retention and the ledger horizon, through the reconciler's purge job on real
PostgreSQL: a finished batch whose members are purged loses its then/catch payloads at the
retention (their SHA-256 kept) and its row at the horizon, after which its name is new again;
before that, its name answers as ``write`` answers for a ledgered key."""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.consumer import DeliveryResult
from outbox.logs import KeyValueFormatter
from outbox.reconciler.jobs.batches import finish_batches
from outbox.reconciler.jobs.purge import Purge, PurgeConfig, purge
from outbox.settings import libpq_url

from .test_batches import CATCH, NAME, THEN, cli, handlers, rows, write_batch

__all__ = ["handlers"]  # the fixture, used by name

DAY = 86400.0
RETENTION, HORIZON = 7 * DAY, 30 * DAY


def pass_days(services: Any, days: float) -> None:
    """Time passes for every row, ledger entry and batch."""
    elapse(services, days * DAY)
    for table, columns in (
        ("outbox_key_ledger", ("completed_at",)),
        ("outbox_batch", ("created_at", "finished_at")),
    ):
        moves = ", ".join(f"{c} = {c} - %(d)s * interval '1 day'" for c in columns)
        sql(services, f"UPDATE {table} SET {moves}", {"d": days})


def run_purge(db: Any, **kw: Any) -> dict[str, int]:
    """The reconciler's purge job, as it runs: retention 7 days, horizon 30."""
    config = PurgeConfig(retention_seconds=RETENTION, ledger_horizon_seconds=HORIZON, **kw)
    return Purge(config).run_once(db)


def batch_row(services: Any, name: str = NAME) -> dict[str, Any] | None:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_batch WHERE name = %s", (name,))
        found = cur.fetchone()
        return None if found is None else dict(zip([c.name for c in cur.description], found, strict=True))


def finished_batch(services: Any, engine: Any, db: Any, consumer: Any) -> tuple[outbox.Batch, list[int]]:
    """A batch of two members, both sent, finished `then`, its then row sent too."""
    b, ids = write_batch(engine, [100, 200])
    worker = consumer()
    assert [worker.deliver(i, "crm.import") for i in ids] == [DeliveryResult.SENT, DeliveryResult.SENT]
    assert finish_batches(db) == {"then": 1, "written": 1}
    assert worker.deliver(rows(services)["report"]["id"], "mail.notify") is DeliveryResult.SENT
    return b, ids


def write_member(s: Session, b: outbox.Batch, n: int, amount: int) -> outbox.Written:
    payload = {"chunk": n, "amount_cents": amount}
    return outbox.write(s, key=b.name, step=f"chunk-{n}", destination="crm.import", payload=payload, batch=b)


def test_payloads_go_at_the_retention_the_row_at_the_horizon_then_the_name_is_new(
    clean, engine, db, handlers, consumer, capsys
):
    b, ids = finished_batch(clean, engine, db, consumer)
    pass_days(clean, 6)
    assert run_purge(db) == {}  # younger than the retention: nothing moves
    pass_days(clean, 2)
    counts = run_purge(db)
    assert counts == {"purged": 3, "batches": 1, "batches_stripped": 1}
    # The reconciler logs its counts as fields, and a field named like a payload is masked.
    record = logging.LogRecord("outbox.reconciler", logging.INFO, __file__, 0, "purge", None, None)
    record.__dict__.update(counts)
    assert "batches_stripped=1" in KeyValueFormatter().format(record)
    assert run_purge(db) == {}
    found = batch_row(clean)
    assert found is not None and found["id"] == b.id and found["outcome"] == "then" and found["total"] == 2
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        [(then_hash, catch_hash)] = conn.execute(
            "SELECT encode(outbox_payload_digest(CAST(%s AS jsonb)), 'hex'),"
            " encode(outbox_payload_digest(CAST(%s AS jsonb)), 'hex')",
            (json.dumps(THEN.payload), json.dumps(CATCH.payload)),
        ).fetchall()
    where = {"destination": "mail.notify"}
    assert found["then_step"] == {"step": "report", **where, "payload_sha256": then_hash}
    assert found["catch_step"] == {"step": "alert", **where, "payload_sha256": catch_hash}

    # Before the horizon the name answers as write() answers for a ledgered key: the same
    # definition is the old batch (a retry of its committed transaction, members and all) ...
    with Session(engine) as s, s.begin():
        again = outbox.batch(s, name=NAME, then=THEN, catch=CATCH)
        assert (again.id, again.created) == (b.id, False)
        members = [write_member(s, again, 0, 100), write_member(s, again, 1, 200)]
        assert [(w.id, w.created) for w in members] == [(ids[0], False), (ids[1], False)]
    # ... and another definition is a conflict, whichever payload differs.
    for then, catch in (
        (outbox.Next("report", "mail.notify", {"import": 8}), CATCH),
        (THEN, outbox.Next("alert", "mail.notify", {"import": 7})),
        (THEN, None),
    ):
        with Session(engine) as s, s.begin(), pytest.raises(outbox.BatchConflict, match="other then/catch"):
            outbox.batch(s, name=NAME, then=then, catch=catch)
    code, out, _ = cli(clean, capsys, "batch", "show", NAME, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["outcome"] == "then" and doc["total"] == 2 and doc["then"]["step"] == "report"
    code, out, _ = cli(clean, capsys, "batch", "show", NAME)
    assert code == 0 and "then: report -> mail.notify" in out

    pass_days(clean, 21)
    assert run_purge(db) == {}  # 29 days: before the horizon
    pass_days(clean, 2)
    assert run_purge(db) == {"ledger_dropped": 3, "batches_dropped": 1}
    assert batch_row(clean) is None
    code, _, err = cli(clean, capsys, "batch", "show", NAME)
    assert code == 1 and f"no batch {NAME!r}" in err
    # Past the horizon the name is new, its steps free again.
    with Session(engine) as s, s.begin():
        fresh = outbox.batch(s, name=NAME, then=outbox.Next("report", "mail.notify", {"import": 8}))
        assert fresh.created and fresh.id != b.id
        assert write_member(s, fresh, 0, 100).created


def test_an_open_batch_and_one_with_a_live_member_are_kept(clean, engine, db, handlers, consumer):
    write_batch(engine, [100], name="import:open")  # never delivered
    _, failed_ids = write_batch(engine, [-1, 100], name="import:failed")
    worker = consumer()
    assert [worker.deliver(i, "crm.import") for i in failed_ids] == [
        DeliveryResult.FAILED,
        DeliveryResult.SENT,
    ]
    assert finish_batches(db) == {"catch": 1, "written": 1}
    # One being written while the purge runs: not finished, not even visible, and kept.
    with Session(engine) as s, s.begin():
        writing = outbox.batch(s, name="import:writing", then=THEN)
        write_member(s, writing, 0, 100)
        pass_days(clean, 100)
        counts = run_purge(db)
    assert "batches_stripped" not in counts and "batches_dropped" not in counts, counts
    for name in ("import:open", "import:failed", "import:writing"):
        found = batch_row(clean, name)
        assert found is not None and found["then_step"]["payload"] == {"import": 7}, name
    # The failed member stays (a human's), and so does its batch: its catch is what handled it.
    assert set(rows(clean, "import:failed")) == {"chunk-0", "alert"}
    assert set(rows(clean, "import:open")) == {"chunk-0"}
    assert set(rows(clean, "import:writing")) == {"chunk-0"}


def test_the_row_written_at_the_end_holds_the_name(clean, engine, db, handlers, consumer):
    # The then row was never delivered (pending for 100 days): the batch keeps its name, since a
    # new batch of that name could never write that step.
    b, ids = write_batch(engine, [100])
    assert consumer().deliver(ids[0], "crm.import") is DeliveryResult.SENT
    assert finish_batches(db) == {"then": 1, "written": 1}
    pass_days(clean, 100)
    # The member's ledger entry is held by its batch (below).
    assert run_purge(db) == {"purged": 1, "batches": 1, "batches_stripped": 1}
    found = batch_row(clean)
    assert found is not None and "payload" not in found["then_step"]
    with Session(engine) as s, s.begin():
        assert outbox.batch(s, name=NAME, then=THEN, catch=CATCH).id == b.id


def test_a_held_batch_keeps_its_members_answering(clean, engine, db, handlers, consumer):
    # The then row failed and waits for a human: the batch keeps its name past the horizon, and
    # a retry of its transaction must still get its old rows, not "created by an earlier
    # transaction" for members whose ledger entries went at their own horizon.
    b, ids = write_batch(engine, [100, 200])
    worker = consumer()
    assert [worker.deliver(i, "crm.import") for i in ids] == [DeliveryResult.SENT, DeliveryResult.SENT]
    assert finish_batches(db) == {"then": 1, "written": 1}
    sql(clean, "UPDATE outbox_message SET state = 'failed', completed_at = now() WHERE step = 'report'")
    pass_days(clean, 31)
    counts = run_purge(db)
    assert counts.get("batches_stripped") == 1 and "batches_dropped" not in counts, counts
    with Session(engine) as s, s.begin():
        again = outbox.batch(s, name=NAME, then=THEN, catch=CATCH)
        assert (again.id, again.created) == (b.id, False)
        members = [write_member(s, again, 0, 100), write_member(s, again, 1, 200)]
        assert [(w.id, w.created) for w in members] == [(ids[0], False), (ids[1], False)]
    # Once the then row is replayed, sent and gone past the horizon, the batch and its members'
    # entries go together, and the name is new.
    sql(
        clean,
        "UPDATE outbox_message SET state = 'sent', chains_known_at = clock_timestamp(), provider_ref = 'r'"
        " WHERE step = 'report'",
    )
    pass_days(clean, 31)
    assert run_purge(db) == {"purged": 1, "batches": 1, "ledger_dropped": 3, "batches_dropped": 1}
    with Session(engine) as s, s.begin():
        fresh = outbox.batch(s, name=NAME, then=THEN, catch=CATCH)
        assert fresh.created and write_member(s, fresh, 0, 100).created


def test_the_batch_purge_goes_in_bounded_pages_along_an_index(clean, db):
    db.execute(
        """
        INSERT INTO outbox_batch (name, then_step, finished_at, outcome, total, sent, failed, cancelled)
        SELECT 'bulk:' || g,
               jsonb_build_object('step', 'report', 'destination', 'mail.notify',
                                  'payload', jsonb_build_object('n', g, 'pad', repeat('x', 200))),
               now() - interval '40 days', 'then', 0, 0, 0, 0
        FROM generate_series(1, 2500) AS g
        """
    )
    assert purge(db, retention_seconds=RETENTION, max_batches=2) == {"batches_stripped": 2000}
    assert purge(db, retention_seconds=RETENTION) == {"batches_stripped": 500}
    assert purge(db, retention_seconds=RETENTION, ledger_horizon_seconds=HORIZON, max_batches=2) == {
        "batches_dropped": 2000
    }
    assert purge(db, retention_seconds=RETENTION, ledger_horizon_seconds=HORIZON) == {"batches_dropped": 500}
    assert db.execute("SELECT count(*) FROM outbox_batch").fetchone() == (0,)
    # Neither statement reads the whole table to find its page.
    db.execute("SET enable_seqscan = off")
    try:
        for statement, params in (
            (store.recovery.STRIP_BATCHES_SQL, {"retention": RETENTION, "limit": 10}),
            (store.recovery.DROP_BATCHES_SQL, {"horizon": HORIZON, "limit": 10}),
        ):
            plan = "\n".join(r[0] for r in db.execute("EXPLAIN " + statement, params).fetchall())
            assert "Seq Scan on outbox_batch" not in plan, plan
            assert "outbox_batch_finished_idx" in plan or "outbox_batch_payload_idx" in plan, plan
    finally:
        db.execute("RESET enable_seqscan")
