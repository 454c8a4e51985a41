"""Batches (issue 14): rows written in one transaction as a group; when every member is terminal
exactly one ``then`` (none failed) or ``catch`` (any failed) row is written, by one guarded
statement, even with two finishers at once, and never lost. Real PostgreSQL, the provider
simulator on 127.0.0.1, the CLI through ``outbox.cli.main``."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql
from sqlalchemy.orm import Session

import outbox
from outbox import ops, store
from outbox.cli import main
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.reconciler.jobs.batches import finish_batches
from outbox.reconciler.jobs.purge import purge
from outbox.settings import libpq_url

from .test_chains import declare

NAME = "import:7"
THEN = outbox.Next("report", "mail.notify", {"import": 7})
CATCH = outbox.Next("alert", "mail.notify", {"import": 7, "failed": True})


def write_batch(engine: Any, amounts: list[int], *, name: str = NAME) -> tuple[outbox.Batch, list[int]]:
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name=name, then=THEN, catch=CATCH)
        ids = [
            outbox.write(
                s,
                key=name,
                step=f"chunk-{n}",
                destination="crm.import",
                payload={"chunk": n, "amount_cents": amount},
                batch=b,
            ).id
            for n, amount in enumerate(amounts)
        ]
    return b, ids


def finish_in_thread(services: Any, batch_id: int, results: list[Any]) -> threading.Thread:
    def run() -> None:
        with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
            results.append(store.recovery.finish_batch(conn, batch_id=batch_id))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def rows(services: Any, key: str = NAME) -> dict[str, dict[str, Any]]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT * FROM outbox_message WHERE key = %s ORDER BY id", (key,))
        names = [c.name for c in cur.description]
        return {r[names.index("step")]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def handlers(provider: Any) -> None:
    declare(provider, "crm.import")
    declare(provider, "mail.notify")


def test_a_batch_whose_members_are_all_sent_writes_its_then_row_once(clean, engine, db, handlers, consumer):
    b, ids = write_batch(engine, [100, 200, 300])
    assert b.created and b.name == NAME
    assert {r["batch_id"] for r in rows(clean).values()} == {b.id}
    worker = consumer()
    assert worker.deliver(ids[0], "crm.import") is DeliveryResult.SENT
    assert finish_batches(db) == {}  # two members still open
    for row_id in ids[1:]:
        assert worker.deliver(row_id, "crm.import") is DeliveryResult.SENT
    assert finish_batches(db) == {"then": 1, "written": 1}
    assert finish_batches(db) == {}
    report = rows(clean)["report"]
    assert report["destination"] == "mail.notify" and report["payload"] == {"import": 7}
    assert report["via"] == "batch_then" and report["state"] == "pending" and report["batch_id"] is None
    assert "alert" not in rows(clean)
    [(outcome, total, sent, failed)] = sql(
        clean, "SELECT outcome, total, sent, failed FROM outbox_batch WHERE id = %s", (b.id,)
    )
    assert (outcome, total, sent, failed) == ("then", 3, 3, 0)


def test_a_failed_member_writes_the_catch_row(clean, engine, db, handlers, consumer):
    _, ids = write_batch(engine, [100, -1, 300])  # the simulator declines -1
    worker = consumer()
    assert [worker.deliver(i, "crm.import") for i in ids] == [
        DeliveryResult.SENT,
        DeliveryResult.FAILED,
        DeliveryResult.SENT,
    ]
    assert finish_batches(db) == {"catch": 1, "written": 1}
    assert rows(clean)["alert"]["via"] == "batch_catch" and "report" not in rows(clean)


def test_an_unknown_member_holds_the_batch_open(clean, engine, db, handlers, consumer, provider):
    _, ids = write_batch(engine, [100])
    provider.configure(fault_next=["drop_after"])
    assert consumer().deliver(ids[0], "crm.import") is DeliveryResult.UNKNOWN
    assert finish_batches(db) == {}
    with engine.begin() as conn:
        assert ops.resolve(conn, ids[0], sent_ref="ch_1").done
    assert finish_batches(db) == {"then": 1, "written": 1}


def test_two_finishers_at_once_write_one_row(clean, engine, handlers, consumer):
    _, ids = write_batch(engine, [100, 200])
    worker = consumer()
    for row_id in ids:
        assert worker.deliver(row_id, "crm.import") is DeliveryResult.SENT
    [(batch_id,)] = sql(clean, "SELECT id FROM outbox_batch")
    results: list[Any] = []
    with psycopg.connect(libpq_url(clean.database_url)) as first:
        # The first finisher has run its statement and not committed yet; the second one waits on
        # the batch row, then finds it finished.
        results.append(store.recovery.finish_batch(first, batch_id=batch_id))
        second = finish_in_thread(clean, batch_id, results)
        second.join(0.5)
        assert second.is_alive(), "the second finisher waits for the first one's lock"
        first.commit()
        second.join(10)
    assert results[0] is not None and results[0].outcome == "then"
    assert results[1] is None
    assert sql(clean, "SELECT count(*) FROM outbox_message WHERE key = %s AND via IS NOT NULL", (NAME,)) == [
        (1,)
    ]


def test_many_batches_finished_by_two_reconcilers_racing_get_one_row_each(clean, engine, handlers, consumer):
    worker = consumer()
    for n in range(12):
        _, ids = write_batch(engine, [100], name=f"import:{n}")
        assert worker.deliver(ids[0], "crm.import") is DeliveryResult.SENT
    counts: list[dict[str, int]] = []
    start = threading.Barrier(2)

    def reconciler() -> None:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            start.wait()
            counts.append(finish_batches(conn))

    threads = [threading.Thread(target=reconciler) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(c.get("then", 0) for c in counts) == 12
    assert sql(clean, "SELECT count(*) FROM outbox_message WHERE via = 'batch_then'") == [(12,)]
    assert sql(clean, "SELECT count(*) FROM outbox_batch WHERE finished_at IS NULL") == [(0,)]


def test_two_last_members_settling_at_once_still_finish_the_batch(clean, engine, db, handlers):
    _, ids = write_batch(engine, [100, 200])
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claims = [
            store.delivery.claim(conn, row_id=i, destination="crm.import", lease_seconds=30) for i in ids
        ]
    start = threading.Barrier(2)

    def settle(row_id: int, token: Any) -> None:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            start.wait()
            store.delivery.record(
                conn, row_id=row_id, token=token, state="sent", outcome="sent", ref=f"r{row_id}"
            )

    threads = [threading.Thread(target=settle, args=(i, c.token)) for i, c in zip(ids, claims, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {r["state"] for r in rows(clean).values()} == {"sent"}
    # Neither settling statement finishes the batch: the sweep, which sees both, does.
    assert finish_batches(db) == {"then": 1, "written": 1}


def test_a_member_replayed_while_the_batch_finishes_is_read_as_it_is_now(clean, engine, handlers, consumer):
    _, ids = write_batch(engine, [100, -1])
    worker = consumer()
    assert worker.deliver(ids[0], "crm.import") is DeliveryResult.SENT
    assert worker.deliver(ids[1], "crm.import") is DeliveryResult.FAILED
    [(batch_id,)] = sql(clean, "SELECT id FROM outbox_batch")
    results: list[Any] = []
    with engine.connect() as operator:
        tx = operator.begin()
        assert ops.replay(operator, [ids[1]], reason="card updated", by="alice")[0].done
        finisher = finish_in_thread(clean, batch_id, results)
        finisher.join(0.5)
        assert finisher.is_alive(), "the finisher waits for the replayed member's lock"
        tx.commit()
        finisher.join(10)
    # The member is pending again: the batch is not finished with `catch` behind its back.
    assert results == [None]
    assert sql(clean, "SELECT finished_at FROM outbox_batch") == [(None,)]


def test_rows_join_a_batch_only_in_its_own_transaction(clean, engine, handlers):
    b, ids = write_batch(engine, [100])
    with Session(engine) as s, s.begin():
        again = outbox.batch(s, name=NAME, then=THEN, catch=CATCH)
        assert again == outbox.Batch(b.id, NAME, False, ("report", "alert"))
        # A retry of the committed transaction: the same member is the usual no-op ...
        same = outbox.write(
            s,
            key=NAME,
            step="chunk-0",
            destination="crm.import",
            payload={"chunk": 0, "amount_cents": 100},
            batch=again,
        )
        assert same == outbox.Written(ids[0], False)
        # ... a new one is refused, and the transaction stays usable.
        with pytest.raises(outbox.BatchConflict, match="created by an earlier transaction"):
            outbox.write(s, key=NAME, step="chunk-9", destination="crm.import", payload={}, batch=again)
        with pytest.raises(outbox.BatchConflict, match="other then/catch steps"):
            outbox.batch(s, name=NAME, then=CATCH)
        outbox.write(s, key="other:1", step="charge", destination="crm.import", payload={})
    assert "chunk-9" not in rows(clean) and "charge" in rows(clean, "other:1")
    with Session(engine) as s, s.begin(), pytest.raises(outbox.InvalidMessage):
        outbox.batch(s, name=" ", then=THEN)


def test_an_open_batch_keeps_its_members_from_the_purge(
    clean, engine, db, handlers, consumer, provider, capsys
):
    _, ids = write_batch(engine, [100, 200])
    worker = consumer()
    assert worker.deliver(ids[0], "crm.import") is DeliveryResult.SENT
    provider.configure(fault_next=["drop_after"])
    assert worker.deliver(ids[1], "crm.import") is DeliveryResult.UNKNOWN
    elapse(clean, 30 * 86400)
    purge(db, retention_seconds=86400)
    assert set(rows(clean)) == {"chunk-0", "chunk-1"}
    with engine.begin() as conn:
        ops.resolve(conn, ids[1], sent_ref="ch_2", handlers=registry())
    assert finish_batches(db) == {"then": 1, "written": 1}
    elapse(clean, 30 * 86400, ids)
    assert purge(db, retention_seconds=86400)["purged"] == 2
    # The finished batch keeps its counts.
    code, out, _ = cli(clean, capsys, "batch", "show", NAME, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["total"] == 2 and doc["counts"]["sent"] == 2 and doc["outcome"] == "then"


def test_batch_show_and_watch(clean, engine, db, handlers, consumer, capsys, monkeypatch):
    from outbox.cli import batches as cli_batches

    b, ids = write_batch(engine, [100, -1, 300])
    worker = consumer()
    assert worker.deliver(ids[0], "crm.import") is DeliveryResult.SENT
    code, out, err = cli(clean, capsys, "batch", "show", NAME)
    assert code == 0, err
    assert f"batch {NAME} (id {b.id})" in out and "then: report -> mail.notify" in out
    assert "open: once every member is sent, failed or cancelled" in out
    code, out, _ = cli(clean, capsys, "batch", "show", str(b.id), "--json")
    doc = json.loads(out)
    assert doc["counts"] == {"sent": 1, "failed": 0, "unknown": 0, "waiting": 2, "cancelled": 0}

    # Off a terminal, watch prints one line a refresh until the batch is finished.
    monkeypatch.setattr(cli_batches, "_sleep", lambda s: None)
    code, out, _ = cli(clean, capsys, "batch", "watch", NAME, "--count", "2")
    assert code == 0 and out.splitlines() == [f"batch {NAME}: 1/3 done (1 sent, 0 failed, 2 waiting)"] * 2
    for row_id in ids[1:]:
        worker.deliver(row_id, "crm.import")
    finish_batches(db)
    code, out, _ = cli(clean, capsys, "batch", "watch", NAME)
    assert code == 1  # it ended with catch
    assert out.splitlines() == [
        f"batch {NAME}: 3/3 done (2 sent, 1 failed); finished catch: wrote step alert to mail.notify "
        f"(row {rows(clean)['alert']['id']}, pending)"
    ]
    code, _, err = cli(clean, capsys, "batch", "show", "import:404")
    assert code == 1 and "no batch 'import:404'" in err
    code, _, err = cli(clean, capsys, "batch", "show", NAME, "--count", "2")
    assert code == 2 and "go with watch" in err


# -- what a reviewer found (issue 14's attack on batches) ---------------------------------------------


def test_the_rows_a_batch_will_write_cannot_be_taken(clean, engine, handlers):
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name=NAME, then=THEN, catch=CATCH)
        # The documented pattern gives members the batch's name as key: the then step is not theirs.
        with pytest.raises(outbox.InvalidMessage, match="is the row batch 'import:7' writes"):
            outbox.write(s, key=NAME, step="report", destination="crm.import", payload={}, batch=b)
    with Session(engine) as s, s.begin():
        outbox.write(s, key="import:8", step="report", destination="mail.notify", payload={"old": 1})
    with Session(engine) as s, s.begin(), pytest.raises(outbox.BatchConflict, match="import:8:report exists"):
        outbox.batch(s, name="import:8", then=THEN)


def test_a_row_taking_the_then_step_after_the_batch_is_a_recorded_problem(
    clean, engine, db, handlers, consumer, capsys
):
    _, ids = write_batch(engine, [100])
    with Session(engine) as s, s.begin():  # plain write of the step, after the batch committed
        outbox.write(s, key=NAME, step="report", destination="mail.notify", payload={"someone": "else"})
    assert consumer().deliver(ids[0], "crm.import") is DeliveryResult.SENT
    seen: list[Any] = []
    assert finish_batches(db, alert_hook=seen.append) == {"then": 1, "problems": 1, "alerts": 1}
    assert [(a.key, a.step, a.state) for a in seen] == [(NAME, "report", "batch_broken")]
    assert "exists already" in seen[0].reason
    assert finish_batches(db, alert_hook=seen.append) == {} and len(seen) == 1  # once
    code, out, _ = cli(clean, capsys, "batch", "show", NAME)
    assert (
        code == 0 and "finished then, but its then step report was not written: import:7:report exists" in out
    )


def test_a_purged_member_answers_write_as_before_the_purge(clean, engine, db, handlers, consumer):
    with Session(engine) as s, s.begin():
        outbox.write(s, key="order:1", step="charge", destination="crm.import", payload={"a": 1})
    with engine.begin() as c:
        assert outbox.cancel(c, key="order:1", step="charge")
    elapse(clean, 30 * 86400)
    assert purge(db, retention_seconds=86400)["purged"] == 1

    def write_in_a_batch() -> Any:
        with Session(engine) as s, s.begin():
            b = outbox.batch(s, name="import:9")
            return outbox.write(
                s, key="order:1", step="charge", destination="crm.import", payload={"a": 1}, batch=b
            )

    # Not a member before the purge (KeyConflict), not one after it either.
    with pytest.raises(outbox.KeyConflict):
        write_in_a_batch()


def test_a_failed_member_waits_out_a_late_record_before_the_batch_ends(clean, engine, db, handlers):
    _, ids = write_batch(engine, [100])
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claim = store.delivery.claim(conn, row_id=ids[0], destination="crm.import", lease_seconds=30)
        store.delivery.record(
            conn, row_id=ids[0], token=claim.token, state="failed", outcome="failed", error="no"
        )
    # Its worker may still record a late answer under that claim: not yet (the batch is not even
    # selected, so it holds no other batch back); its own destination's wait, not the longest.
    waits = {"crm.import": 60.0, "reports.slow": 3600.0}
    assert finish_batches(db, late_record_after_seconds=waits, late_record_default_seconds=7200) == {}
    elapse(clean, 61, ids)
    assert finish_batches(db, late_record_after_seconds=waits, late_record_default_seconds=7200) == {
        "catch": 1,
        "written": 1,
    }


def test_the_sweep_goes_on_page_after_page(clean, engine, db, handlers):
    for n in range(7):
        with Session(engine) as s, s.begin():
            outbox.batch(s, name=f"empty:{n}", then=THEN)
    assert finish_batches(db, page_size=2) == {"then": 7, "written": 7}


def test_odd_batch_names_and_ids(clean, engine, handlers, capsys):
    with Session(engine) as s, s.begin():
        for bad in ("42", "a\x00b", " "):
            with pytest.raises(outbox.InvalidMessage):
                outbox.batch(s, name=bad)
        with pytest.raises(outbox.InvalidMessage, match=r"takes an outbox\.Next"):
            outbox.batch(s, name="x:1", then={"step": "report"}, catch=CATCH)  # type: ignore[arg-type]
    for target, message in (
        ("²", "no batch '²'"),
        ("99999999999999999999", "no batch '99999999999999999999'"),
    ):
        code, _, err = cli(clean, capsys, "batch", "show", target)
        assert code == 1 and message in err, err


def test_a_failed_member_nothing_compensates_stays_stalled(clean, engine, db, handlers, consumer, capsys):
    # A batch with a then step only: its failed member ends it `catch` with no row written, so
    # the failure is nobody's and chains --stalled keeps listing it; with its catch row, it is handled.
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name=NAME, then=THEN)
        member = outbox.write(
            s, key=NAME, step="chunk-0", destination="crm.import", payload={"amount_cents": -1}, batch=b
        )
    assert consumer().deliver(member.id, "crm.import") is DeliveryResult.FAILED
    assert finish_batches(db) == {"catch": 1}
    code, out, _ = cli(clean, capsys, "chains", "--stalled", "--older-than", "0", "--json")
    assert code == 0
    assert [k["step"] for k in json.loads(out)["keys"]] == ["chunk-0"]
    _, ids = write_batch(engine, [-1], name="import:8")
    assert consumer().deliver(ids[0], "crm.import") is DeliveryResult.FAILED
    assert finish_batches(db) == {"catch": 1, "written": 1}
    _code, out, _ = cli(clean, capsys, "chains", "--stalled", "--older-than", "0", "--json")
    assert {k["key"]: k["step"] for k in json.loads(out)["keys"]} == {NAME: "chunk-0", "import:8": "alert"}
    # `outbox show KEY` stops where `chains --stalled` does: the caught member is handled.
    for key, step in ((NAME, "chunk-0"), ("import:8", "alert")):
        _code, out, _ = cli(clean, capsys, "show", key, "--json")
        assert json.loads(out)["stopped"]["step"] == step, key
