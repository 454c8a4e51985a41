"""Issue 9 classes 4 and 10: replay refuses an ambiguous history, bulk replays preview and act on
exactly what was previewed, a lookup's "not found" settles only inside key_ttl, and `audit` finds
a call made after an unsettled ambiguous one. Real PostgreSQL, the real consumer and reconciler
jobs, and the provider simulator, which does NOT deduplicate: a second call is a second charge."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from helpers import elapse, lookup_on
from sqlalchemy.orm import Session

import outbox
from outbox import ops, store
from outbox.cli import main
from outbox.handlers import Handler
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.reconciler.jobs.send_alerts import send_alerts

DEST = "payments.charge"


def declare(provider: Any, *, key_ttl: float = 86400, max_attempts: int = 3, lookup: bool = True) -> Handler:
    @outbox.handler(DEST, time_limit=5, max_attempts=max_attempts, backoff=(1, 1), key_ttl=key_ttl)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return lookup_on(charge, provider) if lookup else charge


def write(engine: Any, key: str, amount: int = 1000) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=DEST, payload={"amount_cents": amount, "currency": "EUR"}
        ).id


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def plan_of(services: Any, capsys: Any, *argv: str) -> str:
    """The fingerprint a bulk replay's preview prints (what --yes --plan must name)."""
    code, out, err = cli(services, capsys, "replay", *argv, "--json")
    assert code == 0, err
    return str(json.loads(out)["preview"]["plan"])


def get(db: psycopg.Connection[Any], row_id: int) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
    names = [c.name for c in cur.description or ()]
    found = cur.fetchone()
    assert found is not None
    return dict(zip(names, found, strict=True))


def fence_rows(db: psycopg.Connection[Any], row_id: int) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT outcome, settled FROM outbox_attempt WHERE message_id = %s ORDER BY id", (row_id,)
    ).fetchall()


def charges(provider: Any, key: str) -> int:
    return int(provider.stats()["effects"].get(f"{key}:charge", 0))


def make_unknown(db: psycopg.Connection[Any], row_id: int) -> store.delivery.Claimed:
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="ReadTimeout"
    ).state
    elapse(db, 1, [row_id])  # its first lookup is due
    return claimed


def make_failed(db: psycopg.Connection[Any], row_id: int) -> None:
    """A certain failure through the claim and the record: the provider said no (402)."""
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="failed", outcome="failed", error="HTTP 402"
    ).state


# -- class 4: the runbook scenario ---------------------------------------------------------------


def test_runbook_resolve_failed_then_replay_destination_refuses_and_the_provider_charges_once(
    clean, engine, db, provider, consumer, capsys
):
    declare(provider)
    ambiguous = write(engine, "order:1")
    declined = write(engine, "order:2")
    worker = consumer()
    # The provider charges order:1, then the connection drops before the answer: unknown.
    provider.configure(fault_keys={"order:1:charge": "drop_after"})
    worker.deliver(ambiguous, DEST)
    assert get(db, ambiguous)["state"] == "unknown"
    assert charges(provider, "order:1") == 1
    make_failed(db, declined)  # e.g. a bad API key: certainly not charged

    # The runbook: the provider "cannot tell", the on-call fails the row out of unknown.
    code, _, err = cli(clean, capsys, "resolve", str(ambiguous), "--failed", "provider cannot tell")
    assert code == 0, err
    # Later, after fixing the API key, the whole destination is replayed.
    plan = plan_of(clean, capsys, "--destination", DEST)
    code, out, err = cli(
        clean, capsys, "replay", "--destination", DEST, "--yes", "--plan", plan, "--reason", "API key fixed"
    )
    assert code == 1
    assert f"row {ambiguous} refused: attempt 1 ended unknown" in out + err
    assert "failed it out of unknown" in out + err
    assert f"row {declined} replayed: failed -> pending" in out
    assert get(db, ambiguous)["state"] == "failed"
    assert get(db, declined)["state"] == "pending"

    # Whatever the workers do now, order:1 is never called again.
    worker.deliver(ambiguous, DEST)
    worker.deliver(declined, DEST)
    assert charges(provider, "order:1") == 1
    assert get(db, declined)["state"] == "sent"
    assert provider.stats()["double_charged"] == []

    # Named alone without --force it is refused too, and says how to force it.
    code, _, err = cli(clean, capsys, "replay", str(ambiguous))
    assert code == 1 and f"outbox replay {ambiguous} --force --reason" in err
    assert get(db, ambiguous)["state"] == "failed"


def test_a_confirmed_call_on_a_failed_row_refuses_replay(clean, engine, db, capsys):
    row_id = write(engine, "order:1")
    old = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert old is not None
    # Its lease runs out, the reconciler expires it, and an operator settles it as not sent.
    elapse(db, 31, [row_id])
    assert expire_leases(db) == 1
    assert cli(clean, capsys, "resolve", str(row_id), "--not-sent")[0] == 0
    make_failed(db, row_id)  # a newer claim failed for certain...
    # ...and the old worker's call was confirmed after all (a late, superseded recording).
    assert not store.delivery.record(
        db, row_id=row_id, token=old.token, state="sent", outcome="sent", ref="ch_1"
    ).state
    code, _, err = cli(clean, capsys, "replay", str(row_id))
    assert code == 1 and "attempt 1 was confirmed by the provider (outcome superseded:sent)" in err
    assert get(db, row_id)["state"] == "failed"


# -- class 4: --force -----------------------------------------------------------------------------


def test_force_needs_one_named_row_and_a_reason_and_is_recorded(clean, engine, db, capsys):
    row_id, other = write(engine, "order:1"), write(engine, "order:2")
    for r in (row_id, other):
        make_unknown(db, r)
        assert cli(clean, capsys, "resolve", str(r), "--failed", "provider cannot tell")[0] == 0

    for argv in (
        ["replay", str(row_id), "--force"],  # no reason
        ["replay", str(row_id), "--force", "--reason", "  "],
        ["replay", str(row_id), str(other), "--force", "--reason", "checked", "--yes"],
        ["replay", "--destination", DEST, "--force", "--reason", "checked", "--yes"],
    ):
        code, _, err = cli(clean, capsys, *argv)
        assert code == 2, argv
        assert "--force" in err
    assert get(db, row_id)["state"] == get(db, other)["state"] == "failed"

    code, out, err = cli(
        clean,
        capsys,
        "replay",
        str(row_id),
        "--force",
        "--reason",
        "provider: no charge (ticket 981)",
        "--by",
        "alice",
    )
    assert code == 0, err
    assert f"row {row_id} replayed" in out
    after = get(db, row_id)
    assert after["state"] == "pending"
    entry = after["history"][-1]
    assert (entry["action"], entry["by"], entry["reason"], entry["forced"]) == (
        "replay",
        "alice",
        "provider: no charge (ticket 981)",
        True,
    )
    assert any("attempt 1 ended unknown" in o for o in entry["overrode"])
    assert any("failed it out of unknown" in o for o in entry["overrode"])
    assert fence_rows(db, row_id) == [("unknown", "operator_forced")]
    assert get(db, other)["state"] == "failed"

    # The forced row's next call is an accepted risk on record, not an audit finding.
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref="ch_2"
    ).state
    code, out, _ = cli(clean, capsys, "audit", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    assert data["totals"]["forced_replays"] == 1


# -- class 4: preview, --yes, acting on the previewed set only ------------------------------------


def test_bulk_replay_previews_and_acts_only_with_yes(clean, engine, db, capsys):
    ok = [write(engine, f"order:{i}") for i in range(2)]
    ambiguous = write(engine, "order:9")
    for r in ok:
        make_failed(db, r)
    make_unknown(db, ambiguous)
    cli(clean, capsys, "resolve", str(ambiguous), "--failed", "provider cannot tell")

    code, out, err = cli(clean, capsys, "replay", "--destination", DEST)
    assert code == 0, err
    assert "2 row(s) to replay, 1 refused" in out
    assert f"#{ambiguous} order:9 charge: row {ambiguous} refused" in out
    assert "nothing changed: this is a preview" in out
    plan = out.split("--plan ")[-1].split()[0]
    assert [get(db, r)["state"] for r in (*ok, ambiguous)] == ["failed"] * 3

    # Several ids preview too.
    code, out, _ = cli(clean, capsys, "replay", str(ok[0]), str(ok[1]))
    assert code == 0 and "nothing changed" in out and get(db, ok[0])["state"] == "failed"

    # A plan that no longer matches changes nothing.
    late = write(engine, "order:late")
    make_failed(db, late)
    code, _, err = cli(clean, capsys, "replay", "--destination", DEST, "--yes", "--plan", plan)
    assert code == 1 and "rows changed since your preview" in err
    assert get(db, late)["state"] == "failed" and get(db, ok[0])["state"] == "failed"

    code, out, _ = cli(clean, capsys, "replay", "--destination", DEST, "--json")
    plan = json.loads(out)["preview"]["plan"]
    code, out, err = cli(clean, capsys, "replay", "--destination", DEST, "--yes", "--plan", plan)
    assert code == 1  # the ambiguous row is refused
    assert "replayed 3 failed row(s)" in out
    assert [get(db, r)["state"] for r in (*ok, late)] == ["pending"] * 3
    assert get(db, ambiguous)["state"] == "failed"


def test_execute_acts_on_exactly_the_previewed_rows(clean, engine, db):
    rows = [write(engine, f"order:{i}") for i in range(4)]
    for r in rows:
        make_failed(db, r)
    with engine.begin() as conn:
        plan = ops.plan_replay(conn, destination=DEST)
    assert [c.id for c in plan.to_replay] == rows

    # After the preview: a new failed row, a previewed row that was replayed and failed again, and
    # one whose old call turns out confirmed (a late recording).
    newcomer = write(engine, "order:new")
    make_failed(db, newcomer)
    with engine.begin() as conn:
        assert ops.replay(conn, [rows[1]], by="bob", reason="retry it")[0].done
    make_failed(db, rows[1])
    db.execute("UPDATE outbox_attempt SET outcome = 'superseded:sent' WHERE message_id = %s", (rows[2],))

    with engine.begin() as conn:
        results = ops.execute_replay(conn, plan, by="alice", reason="provider fixed")
    by_id = {r.id: r for r in results}
    assert [r.id for r in results] == rows
    assert by_id[rows[0]].done and by_id[rows[3]].done
    assert not by_id[rows[1]].done and "failed again since the preview" in by_id[rows[1]].message
    assert not by_id[rows[2]].done and "confirmed by the provider" in by_id[rows[2]].message
    states = {r: get(db, r)["state"] for r in (*rows, newcomer)}
    assert states == {
        rows[0]: "pending",
        rows[1]: "failed",
        rows[2]: "failed",
        rows[3]: "pending",
        newcomer: "failed",
    }


# -- classes 4 and 10: what a lookup's "not found" may settle -------------------------------------


def test_lookup_not_found_within_key_ttl_settles_and_allows_replay(clean, engine, db, provider, capsys):
    handler = declare(provider, max_attempts=1)
    row_id = write(engine, "order:1")
    make_unknown(db, row_id)

    assert resolve_unknown(db, {DEST: handler}) == {"failed": 1}
    assert get(db, row_id)["state"] == "failed"
    assert fence_rows(db, row_id) == [("unknown", "lookup_not_found")]

    code, _, err = cli(clean, capsys, "replay", str(row_id), "--reason", "out of attempts")
    assert code == 0, err
    assert get(db, row_id)["state"] == "pending"


def test_not_found_past_key_ttl_parks_for_a_human_and_alerts(clean, engine, db, provider, consumer):
    handler = declare(provider, key_ttl=3600)
    row_id = write(engine, "order:1")
    make_unknown(db, row_id)
    # The first call is older than the provider's key lifetime (database clock).
    elapse(db, 3601, [row_id])
    assert store.recovery.mark_alerted(db, row_id=row_id, state="unknown")

    assert resolve_unknown(db, {DEST: handler}) == {"past_key_ttl": 1}
    parked = get(db, row_id)
    assert parked["state"] == "unknown"
    assert parked["last_error"].startswith("needs a human: a call is older than key_ttl (3600 s)")
    assert f"outbox resolve {row_id} --sent REF or --not-sent" in parked["last_error"]
    assert parked["alerted_at"] is None  # a new reason: alerted again
    assert fence_rows(db, row_id) == [("unknown", None)]
    # Not due again for a long while, and no worker can claim it.
    assert resolve_unknown(db, {DEST: handler}) == {}
    assert consumer().deliver(row_id, DEST).value == "empty"
    assert charges(provider, "order:1") == 0

    seen: list[Any] = []
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=0) == {"alerts": 1}
    assert "needs a human" in seen[0].reason
    # Looked up again an hour later, same answer: parked again, not alerted twice.
    elapse(db, 3600, [row_id])
    assert resolve_unknown(db, {DEST: handler}) == {"past_key_ttl": 1}
    assert send_alerts(db, seen.append, unknown_alert_after_seconds=0) == {}


def test_idempotent_destination_without_lookup_is_not_retried_past_key_ttl(clean, engine, db, provider):
    @outbox.handler(DEST, time_limit=5, backoff=(1,), idempotent=True, key_ttl=3600)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("never called here")

    young, old = write(engine, "order:1"), write(engine, "order:2")
    make_unknown(db, young)
    make_unknown(db, old)
    db.execute(
        "UPDATE outbox_attempt SET started_at = now() - interval '2 hours' WHERE message_id = %s", (old,)
    )
    assert resolve_unknown(db, {DEST: charge}) == {"pending": 1, "past_key_ttl": 1}
    assert get(db, young)["state"] == "pending"
    assert fence_rows(db, young) == [("unknown", "idempotent_retry")]
    assert get(db, old)["state"] == "unknown"


def test_resolve_not_sent_settles_and_refuses_a_confirmed_call(clean, engine, db, capsys):
    row_id, confirmed = write(engine, "order:1"), write(engine, "order:2")
    make_unknown(db, row_id)
    code, _, err = cli(clean, capsys, "resolve", str(row_id), "--not-sent", "--reason", "provider: none")
    assert code == 0, err
    assert fence_rows(db, row_id) == [("unknown", "operator_not_sent")]

    make_unknown(db, confirmed)
    db.execute("UPDATE outbox_attempt SET outcome = 'superseded:sent' WHERE message_id = %s", (confirmed,))
    code, _, err = cli(clean, capsys, "resolve", str(confirmed), "--not-sent")
    assert code == 1 and "confirmed by the provider" in err and "--sent REF" in err
    assert get(db, confirmed)["state"] == "unknown"


# -- class 4: the audit finding -------------------------------------------------------------------


def test_audit_finds_a_call_after_an_unsettled_ambiguous_one(clean, engine, db, capsys):
    settled, recalled = write(engine, "order:1"), write(engine, "order:2")
    for r in (settled, recalled):
        make_unknown(db, r)
    # A settled ambiguity, then a new call: fine.
    assert cli(clean, capsys, "resolve", str(settled), "--not-sent")[0] == 0
    # An unsettled one, then a new call (what replay after `resolve --failed` used to do).
    assert cli(clean, capsys, "resolve", str(recalled), "--failed", "provider cannot tell")[0] == 0
    # A state the product cannot reach any more: what replay after `resolve --failed` used to do.
    # Since 0022 the database refuses it too (outbox_message_failed_stands); written past the
    # triggers, as a release before that revision left it.
    with db.transaction():
        db.execute("SET LOCAL session_replication_role = replica")
        db.execute(
            "UPDATE outbox_message SET state = 'pending', available_at = now(), attempts = 0 WHERE id = %s",
            (recalled,),
        )
    for r in (settled, recalled):
        claimed = store.delivery.claim(db, row_id=r, destination=DEST, lease_seconds=30)
        assert claimed is not None
        assert store.delivery.record(
            db, row_id=r, token=claimed.token, state="sent", outcome="sent", ref=f"ch_{r}"
        ).state

    code, out, _ = cli(clean, capsys, "audit", "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["totals"]["called_again_after_an_unsettled_ambiguous_call"] == 1
    [violation] = data["violations"]
    assert (violation["id"], violation["kind"]) == (
        recalled,
        "called_again_after_an_unsettled_ambiguous_call",
    )
    code, out, _ = cli(clean, capsys, "audit")
    assert code == 1 and "called again after 1 call(s) that may have taken effect" in out


def test_force_on_a_row_with_nothing_to_override_and_rows_failed_without_a_time(clean, engine, db, capsys):
    forced, bulk = write(engine, "order:1"), [write(engine, f"order:{i}") for i in (2, 3)]
    make_failed(db, forced)
    for r in bulk:
        # A state the product cannot reach: failed by plain SQL, with no completed_at; still
        # replayed by id, exactly once.
        db.execute("UPDATE outbox_message SET state = 'failed', completed_at = NULL WHERE id = %s", (r,))
    code, _, err = cli(clean, capsys, "replay", str(forced), "--force", "--reason", "re-run it")
    assert code == 0, err
    assert get(db, forced)["history"][-1]["overrode"] == []
    plan = plan_of(clean, capsys, *map(str, bulk))
    code, _, err = cli(clean, capsys, "replay", *map(str, bulk), "--yes", "--plan", plan)
    assert code == 0, err
    assert [get(db, r)["state"] for r in bulk] == ["pending", "pending"]
