"""Pausing a destination (issue 13 part 1): no claim while paused, nothing failed, no attempt
spent, everything sent once after the resume. Real PostgreSQL, Redis, Dramatiq worker threads and
the provider simulator, whose counters are the evidence."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from helpers import lookup_on, relay_once, wait_for, worker_thread
from sqlalchemy import text

from outbox import metrics, pauses, store
from outbox.cli import main
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.reconciler.jobs.redispatch import redispatch

from .reconciler.support import DEST, declare_charge, get, write_rows

pytestmark = pytest.mark.timeout(120)


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def pause(engine: Any, destination: str = DEST, **kw: Any) -> pauses.Pause:
    with engine.begin() as conn:
        return pauses.pause(conn, destination, by="test", reason="provider incident", **kw)


def resume(engine: Any, destination: str = DEST) -> pauses.Resumed:
    with engine.begin() as conn:
        return pauses.resume(conn, destination, by="test")


def paused_gauge(db: Any) -> float | None:
    reading = metrics.read_database(db)
    reading.destinations = [DEST]
    metrics.DATABASE.update(reading, fresh_for_seconds=60)
    try:
        return metrics.REGISTRY.get_sample_value("outbox_destination_paused", {"destination": DEST})
    finally:
        metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)


def states(db: Any) -> dict[str, int]:
    return dict(db.execute("SELECT state, count(*) FROM outbox_message GROUP BY state").fetchall())


def test_a_paused_destination_is_not_claimed_and_its_rows_keep_their_attempts(clean, engine, db, provider):
    declare_charge(provider)
    other = declare_charge(provider, destination="mail.send")
    [row] = write_rows(engine, 1)
    [mail] = write_rows(engine, 1, destination="mail.send", start=1)
    pause(engine)

    assert (
        store.delivery.claim(db, row_id=row, destination=DEST, lease_seconds=30, token=uuid.uuid4()) is None
    )
    assert pauses.held_reason(db, destination=DEST) == "is paused"
    assert pauses.held_reason(db, destination="mail.send") is None
    deliverer = Deliverer(clean.database_url, {**registry(), "mail.send": other})
    try:
        assert deliverer.deliver(row, DEST) is DeliveryResult.PAUSED
        assert deliverer.deliver(mail, "mail.send") is DeliveryResult.SENT  # another destination goes on
        assert get(db, row)["attempts"] == 0 and get(db, row)["state"] == "pending"
        assert (
            db.execute("SELECT count(*) FROM outbox_attempt WHERE message_id = %s", (row,)).fetchone()[0] == 0
        )
        assert provider.charges("order:0:charge") == 0

        assert resume(engine).pause is not None
        assert resume(engine).pause is None, "a second resume finds nothing paused"
        assert deliverer.deliver(row, DEST) is DeliveryResult.SENT
    finally:
        deliverer.close()
    assert provider.charges("order:0:charge") == 1


def test_pause_during_a_backlog_no_call_while_paused_all_sent_once_after_resume(
    clean, engine, db, provider, redis_client
):
    """Workers running, the relay publishing, the destination paused: the provider receives no
    request; the rows wait dispatched with no attempt spent; the reconciler leaves them alone
    until the resume, then re-queues them, and each is charged exactly once."""
    declare_charge(provider)
    pause(engine)
    ids = write_rows(engine, 30)
    assert relay_once(clean) == 30
    with worker_thread(clean, threads=4):
        wait_for(
            lambda: redis_client.llen(f"{clean.namespace}:{DEST}") == 0,
            30,
            "the workers to take every message",
        )
        time.sleep(0.5)  # any claim would have happened by now
        assert provider.stats()["requests"] == 0
        assert states(db) == {"dispatched": 30}
        assert db.execute("SELECT max(attempts) FROM outbox_message").fetchone()[0] == 0

        # Paused: the reconciler does not re-queue them, however long they wait.
        db.execute(
            "UPDATE outbox_message SET dispatched_at = dispatched_at - interval '1 hour'"
        )  # time passes
        kwargs = dict(namespace=clean.namespace, redispatch_after_seconds=300)
        assert redispatch(db, redis_client, registry(), **kwargs) == {}
        assert provider.stats()["requests"] == 0

        resume(engine)
        counts = redispatch(db, redis_client, registry(), **kwargs)
        assert counts == {"missing": 30}, counts
        assert relay_once(clean) == 30
        wait_for(lambda: states(db) == {"sent": 30}, 60, "every row sent after the resume")
    stats = provider.stats()
    assert stats["charges"] == 30 and stats["double_charged"] == []
    assert all(provider.charges(f"order:{i}:charge") == 1 for i in range(30))
    assert db.execute("SELECT max(attempts) FROM outbox_message").fetchone()[0] == 1
    assert len(ids) == 30


def test_a_pause_with_until_ends_by_itself_on_the_database_clock(clean, engine, db, provider):
    declare_charge(provider)
    [row] = write_rows(engine, 1)
    done = pause(engine, for_seconds=0.5)
    assert done.until is not None
    assert pauses.held_reason(db, destination=DEST) == "is paused"
    wait_for(lambda: pauses.held_reason(db, destination=DEST) is None, 5, "the pause to end")
    claimed = store.delivery.claim(db, row_id=row, destination=DEST, lease_seconds=30)
    assert claimed is not None and claimed.id == row


def test_pausing_a_paused_destination_keeps_its_start_and_replaces_its_end_and_reason(clean, engine):
    first = pause(engine)
    time.sleep(0.05)
    with engine.begin() as conn:
        again = pauses.pause(conn, DEST, by="someone else", reason="still down", for_seconds=3600)
    assert again.since == first.since
    assert again.until is not None and again.reason == "still down" and again.by == "someone else"
    resume(engine)
    time.sleep(0.05)
    later = pause(engine)
    assert later.since > first.since and later.until is None


def test_the_cli_pauses_and_resumes_and_status_and_the_metrics_show_it(clean, engine, db, capsys):
    code, out, err = cli(
        clean, capsys, "pause", DEST, "--reason", "INC-42 card 4242424242424242", "--by", "ana"
    )
    assert code == 0, err
    assert out.startswith(f"paused {DEST} until outbox resume") and "INC-42" in out
    assert "4242424242424242" not in out, "card numbers are masked in a stored reason"

    code, out, _ = cli(clean, capsys, "status", "--json")
    [shown] = json.loads(out)["paused"]
    assert shown["destination"] == DEST and shown["by"] == "ana" and shown["until"] is None
    code, out, _ = cli(clean, capsys, "status")
    assert f"paused: {DEST} since" in out and "by ana, until resumed: INC-42" in out

    assert paused_gauge(db) == 1.0

    code, out, err = cli(clean, capsys, "pause", DEST, "--reason", "window", "--until", "30m", "--json")
    assert code == 0, err
    until = json.loads(out)["until"]
    assert until is not None
    remaining = db.execute("SELECT EXTRACT(EPOCH FROM %s::timestamptz - now())", (until,)).fetchone()[0]
    assert 1790 < remaining <= 1800

    code, out, err = cli(clean, capsys, "doctor", "--json", "--redis-url", clean.redis_url)
    [pauses_check] = [c for c in json.loads(out)["checks"] if c["name"] == "pauses"]
    assert pauses_check["status"] == "WARN" and f"paused: {DEST}" in pauses_check["detail"], pauses_check

    code, out, err = cli(clean, capsys, "resume", DEST)
    assert code == 0 and f"resumed {DEST}" in out, err
    code, out, err = cli(clean, capsys, "resume", DEST)
    assert code == 1 and f"{DEST} is not paused" in err
    assert paused_gauge(db) == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pause", DEST], "--reason is required"),
        (["pause", DEST, "--reason", "  "], "--reason is required"),
        (["pause", "no spaces", "--reason", "x"], "destination"),
        (["pause", DEST, "--reason", "x", "--until", "soon"], "is not a duration"),
        (["pause", DEST, "--reason", "x", "--until", "0s"], "must be a positive duration"),
        (["pause", DEST, "--reason", "x", "--until", "2026-12-01T18:00:00"], "has no UTC offset"),
        (["pause", DEST, "--reason", "x", "--until", "2025-12-01T18:00:00+00:00"], "is not in the future"),
    ],
)
def test_the_cli_refuses_bad_input_with_one_line(clean, engine, capsys, argv, message):
    code, out, err = cli(clean, capsys, *argv)
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox_destination")).scalar_one() == 0


def test_a_retry_past_key_ttl_goes_unknown_instead_of_charging_again(clean, engine, db, provider):
    """(attack on issue 13, F1) An idempotent destination's call drops after charging; the retry
    is due, but the destination stays paused longer than key_ttl. The provider may have
    forgotten the Idempotency-Key, so the claim after the resume must not call again: the row
    goes unknown and the lookup finds the one charge."""
    from outbox.testing.delivery import deliver, pass_time, reconcile_once

    charge = lookup_on(declare_charge(provider, idempotent=True, lookup=False), provider)
    table = {DEST: charge}
    [row] = write_rows(engine, 1)
    provider.drop_after_charge(times=1)
    assert (
        deliver(table, database_url=clean.database_url)[row] is DeliveryResult.PENDING
    )  # an idempotent retry
    pause(engine)
    pass_time(charge.key_ttl + 3600, database_url=clean.database_url)  # the outage outlasts key_ttl
    assert deliver(table, database_url=clean.database_url)[row] is DeliveryResult.PAUSED
    resume(engine)

    assert deliver(table, database_url=clean.database_url)[row] is DeliveryResult.UNKNOWN
    moved = get(db, row)
    assert moved["state"] == "unknown" and "key_ttl" in moved["last_error"] and moved["attempts"] == 1
    assert provider.stats()["requests"] == 1, "no second call"
    assert reconcile_once(table, database_url=clean.database_url)["resolve_unknown"] == {"sent": 1}
    assert get(db, row)["state"] == "sent" and provider.charges("order:0:charge") == 1


def test_pausing_a_name_nobody_uses_warns_with_the_likely_one(clean, engine, capsys):
    """(attack F7) A typo pauses nothing real: say so, and name the destination meant."""
    write_rows(engine, 1)
    code, out, err = cli(clean, capsys, "pause", "payment.charge", "--reason", "INC-42")
    assert code == 0
    assert (
        "no worker seen in the last day serves payment.charge" in err
        and "did you mean payments.charge?" in err
    )
    code, out, err = cli(clean, capsys, "pause", DEST, "--reason", "INC-42", "--json")
    assert code == 0 and err == "" and json.loads(out)["warning"] is None
