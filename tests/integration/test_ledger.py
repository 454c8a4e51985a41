"""Issue 9 class 3: the key ledger. A `(key, step)` whose row was purged stays known for the
ledger horizon: `write` answers as before the purge, plain SQL cannot insert it again, and a
writer racing the purge (READ COMMITTED or REPEATABLE READ, the purge committing before, during
or after the writer's snapshot) does not slip through. Two real connections each, ordered by
what PostgreSQL reports (pg_stat_activity), never by sleeps."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql, wait_for
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.reconciler.jobs import purge as purge_job
from outbox.settings import async_database_url, libpq_url

DESTINATION = "payments.charge"
PAYLOAD = {"amount_cents": 1000, "currency": "EUR", "meta": {"a": 1, "b": [1, 2]}}
RETENTION = 7 * 86400.0
HORIZON = 90 * 86400.0


def write_committed(engine: Engine, key: str, payload: dict[str, Any] | None = None) -> outbox.Written:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=DESTINATION, payload=payload or PAYLOAD)


def make_sent(
    services: Any, row_id: int, *, days_ago: float = 8, outcomes: tuple[str, ...] = ("sent",)
) -> None:
    """Settle a row `sent` long enough ago to be purged, with one attempt row per outcome."""
    # A state built directly, not through claims: whatever attempt rows the ledger must summarise,
    # some of which (a failed call on a sent row) the product cannot reach.
    for n, outcome in enumerate(outcomes, 1):
        sql(
            services,
            "INSERT INTO outbox_attempt (message_id, attempt, claim_token, outcome, finished_at) "
            "VALUES (%s, %s, gen_random_uuid(), %s, now())",
            (row_id, n, outcome),
        )
    sql(
        services,
        # chains_known_at: settled as this code settles (an older release's move is marked for
        # the chains job, and a marked row waits for it before its purge).
        "UPDATE outbox_message SET state = 'sent', chains_known_at = clock_timestamp(), provider_ref = %s,"
        " attempts = %s, completed_at = now() WHERE id = %s",
        (f"ch_{row_id}", len(outcomes), row_id),
    )
    elapse(services, days_ago * 86400, [row_id])


def purge(services: Any, **kwargs: Any) -> dict[str, int]:
    kwargs = {"retention_seconds": RETENTION, "ledger_horizon_seconds": HORIZON, **kwargs}
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        return purge_job.purge(conn, **kwargs)


def live_rows(services: Any, key: str) -> list[tuple[Any, ...]]:
    return sql(services, "SELECT id, state FROM outbox_message WHERE key = %s AND step = 'charge'", (key,))


def ledger(services: Any, key: str) -> dict[str, Any] | None:
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        return cur.execute(
            "SELECT * FROM outbox_key_ledger WHERE key = %s AND step = 'charge'", (key,)
        ).fetchone()


# -- the answer after the purge ----------------------------------------------------------------------


def test_write_of_a_purged_key_answers_as_before_the_purge(clean, engine) -> None:
    original = write_committed(engine, "order:1")
    make_sent(clean, original.id)
    assert purge(clean)["purged"] == 1
    assert live_rows(clean, "order:1") == []

    again = write_committed(engine, "order:1")

    assert again == outbox.Written(original.id, False)
    assert live_rows(clean, "order:1") == []


def test_payload_compared_by_its_jsonb_value_not_its_text(clean, engine) -> None:
    original = write_committed(engine, "order:2")
    make_sent(clean, original.id)
    purge(clean)
    # Same value, other key order: jsonb's canonical text (hence the hash) is the same.
    reordered = {"meta": {"b": [1, 2], "a": 1}, "currency": "EUR", "amount_cents": 1000}
    assert write_committed(engine, "order:2", reordered) == outbox.Written(original.id, False)


def test_numbers_compared_by_value_as_before_the_purge(clean, engine) -> None:
    payload = {"amount": 10, "rate": 1.5, "lines": [{"qty": 2}], "empty": {}, "none": []}
    same_value = {"amount": 10.0, "rate": 1.50, "lines": [{"qty": 2.0}], "empty": {}, "none": []}
    original = write_committed(engine, "order:2n", payload)
    # Before the purge jsonb equality decides: 10 = 10.0.
    assert write_committed(engine, "order:2n", same_value) == outbox.Written(original.id, False)
    make_sent(clean, original.id)
    purge(clean)
    assert write_committed(engine, "order:2n", same_value) == outbox.Written(original.id, False)
    with Session(engine) as s, s.begin(), pytest.raises(outbox.KeyConflict):
        outbox.write(
            s, key="order:2n", step="charge", destination=DESTINATION, payload={**payload, "amount": 10.5}
        )


@pytest.mark.parametrize(
    "change",
    [{"payload": {**PAYLOAD, "amount_cents": 1001}}, {"destination": "payments.refund"}],
    ids=["payload", "destination"],
)
def test_write_of_a_purged_key_with_other_content_conflicts(clean, engine, change) -> None:
    original = write_committed(engine, "order:3")
    make_sent(clean, original.id)
    purge(clean)
    args = {"key": "order:3", "step": "charge", "destination": DESTINATION, "payload": PAYLOAD, **change}
    with Session(engine) as s, s.begin(), pytest.raises(outbox.KeyConflict) as raised:
        outbox.write(s, **args)
    assert raised.value.existing_id == original.id
    assert live_rows(clean, "order:3") == []


def test_cancel_of_a_purged_key_is_false(clean, engine) -> None:
    original = write_committed(engine, "order:4")
    make_sent(clean, original.id)
    purge(clean)
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:4", step="charge") is False
    assert ledger(clean, "order:4")["state"] == "sent"


@pytest.mark.asyncio
async def test_write_async_of_a_purged_key(clean, engine) -> None:
    original = write_committed(engine, "order:5")
    make_sent(clean, original.id)
    purge(clean)
    async_engine = create_async_engine(async_database_url(clean.database_url))
    try:
        async with AsyncSession(async_engine) as s, s.begin():
            again = await outbox.write_async(
                s, key="order:5", step="charge", destination=DESTINATION, payload=PAYLOAD
            )
            with pytest.raises(outbox.KeyConflict):
                await outbox.write_async(
                    s, key="order:5", step="charge", destination=DESTINATION, payload={"x": 1}
                )
    finally:
        await async_engine.dispose()
    assert again == outbox.Written(original.id, False)


def test_plain_sql_insert_of_a_purged_key_inserts_nothing(clean, engine) -> None:
    original = write_committed(engine, "order:6")
    make_sent(clean, original.id)
    purge(clean)
    inserted = sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('order:6', 'charge', %s, %s::jsonb) RETURNING id",
        (DESTINATION, json.dumps(PAYLOAD)),
    )
    assert inserted == []
    assert live_rows(clean, "order:6") == []


def test_ledger_entry_records_the_history(clean, engine) -> None:
    plain = write_committed(engine, "order:7")
    make_sent(clean, plain.id, outcomes=("retry", "sent"))
    expired = write_committed(engine, "order:8")
    make_sent(clean, expired.id, outcomes=("lease_expired",))
    resolved = write_committed(engine, "order:9")
    make_sent(clean, resolved.id, outcomes=("failed",))
    # A state the product cannot reach: a failed call on a row an operator resolved as sent.
    sql(
        clean,
        """UPDATE outbox_message SET history = '[{"action": "resolve", "from": "unknown", "to": "sent"}]'
           WHERE id = %s""",
        (resolved.id,),
    )
    young = write_committed(engine, "order:10")
    make_sent(clean, young.id, days_ago=1)

    assert purge(clean) == {"purged": 3, "batches": 1}

    entry = ledger(clean, "order:7")
    assert entry is not None
    assert entry["message_id"] == plain.id
    assert (entry["state"], entry["provider_ref"], entry["destination"]) == (
        "sent",
        f"ch_{plain.id}",
        DESTINATION,
    )
    assert (entry["attempts"], entry["confirmed"], entry["ambiguous"]) == (2, 1, False)
    assert bytes(entry["payload_hash"]) == bytes(
        sql(clean, "SELECT sha256(convert_to(%s::jsonb::text, 'UTF8'))", (json.dumps(PAYLOAD, indent=1),))[0][
            0
        ]
    )
    assert ledger(clean, "order:8")["ambiguous"] is True
    assert ledger(clean, "order:9")["ambiguous"] is True
    # Younger than the retention: still a live row, not in the ledger.
    assert ledger(clean, "order:10") is None
    assert live_rows(clean, "order:10") == [(young.id, "sent")]
    # The attempt rows went with their rows; the ledger carries their count.
    assert sql(clean, "SELECT count(*) FROM outbox_attempt")[0][0] == 1


def test_horizon_drops_old_ledger_entries_then_the_key_is_new(clean, engine) -> None:
    old = write_committed(engine, "order:11")
    make_sent(clean, old.id, days_ago=91)
    kept = write_committed(engine, "order:12")
    make_sent(clean, kept.id, days_ago=89)

    assert purge(clean) == {"purged": 2, "batches": 1, "ledger_dropped": 1}

    assert ledger(clean, "order:11") is None
    assert ledger(clean, "order:12") is not None
    assert write_committed(engine, "order:12") == outbox.Written(kept.id, False)
    renewed = write_committed(engine, "order:11")
    assert renewed.created and renewed.id != old.id


# -- races with the purge: two real connections ------------------------------------------------------


@contextlib.contextmanager
def connection(services: Any, name: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(services.database_url), application_name=name) as conn:
        yield conn


def waiting_on_lock(services: Any, name: str) -> bool:
    rows = sql(
        services,
        "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
        (name,),
    )
    return bool(rows)


ISOLATIONS = ["READ COMMITTED", "REPEATABLE READ"]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_purge_committed_before_the_writer_snapshot(clean, engine, isolation) -> None:
    original = write_committed(engine, "race:1")
    make_sent(clean, original.id)
    purge(clean)
    with engine.connect() as c:
        c = c.execution_options(isolation_level=isolation)
        with c.begin():
            c.execute(text("SELECT 1"))
            result = outbox.write(c, key="race:1", step="charge", destination=DESTINATION, payload=PAYLOAD)
    assert result == outbox.Written(original.id, False)
    assert live_rows(clean, "race:1") == []


def test_purge_commits_after_a_repeatable_read_snapshot(clean, engine) -> None:
    """The writer's snapshot still shows the row; the unique index no longer does."""
    original = write_committed(engine, "race:2")
    make_sent(clean, original.id)
    with engine.connect() as c:
        c = c.execution_options(isolation_level="REPEATABLE READ")
        with c.begin():
            c.execute(text("SELECT count(*) FROM outbox_message"))  # takes the snapshot
            assert purge(clean)["purged"] == 1  # commits while the writer's snapshot is open
            result = outbox.write(c, key="race:2", step="charge", destination=DESTINATION, payload=PAYLOAD)
    assert result == outbox.Written(original.id, False)
    assert live_rows(clean, "race:2") == []
    assert ledger(clean, "race:2") is not None


def test_a_snapshot_older_than_the_row_holds_its_purge_back(clean, engine) -> None:
    """A REPEATABLE READ snapshot taken before the row was even written sees neither the row nor
    its ledger entry: the purge waits for that transaction instead."""
    with engine.connect() as c:
        c = c.execution_options(isolation_level="REPEATABLE READ")
        with c.begin():
            c.execute(text("SELECT 1"))  # the snapshot, before the row exists
            original = write_committed(engine, "race:4")
            make_sent(clean, original.id, days_ago=0)
            # Completed after the writer's transaction began: not purged while it is open.
            assert purge(clean, retention_seconds=0.0) == {}
            assert live_rows(clean, "race:4") == [(original.id, "sent")]
    assert purge(clean, retention_seconds=0.0)["purged"] == 1
    assert write_committed(engine, "race:4") == outbox.Written(original.id, False)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_purge_in_progress_while_the_writer_inserts(clean, engine, isolation) -> None:
    """The purge has deleted the row but not committed; the writer inserts, then the purge
    commits. Without the guard the writer waits on the purge's row lock and inserts after it."""
    original = write_committed(engine, "race:3")
    make_sent(clean, original.id)
    name = f"ledger-writer-{isolation.replace(' ', '-').lower()}"
    outcome: dict[str, Any] = {}

    def writer() -> None:
        from sqlalchemy import create_engine

        from outbox.settings import normalize_database_url

        eng = create_engine(
            normalize_database_url(clean.database_url), connect_args={"application_name": name}
        )
        try:
            with eng.connect() as c:
                c = c.execution_options(isolation_level=isolation)
                with c.begin():
                    outcome["result"] = outbox.write(
                        c, key="race:3", step="charge", destination=DESTINATION, payload=PAYLOAD
                    )
        except Exception as exc:
            outcome["error"] = exc
        finally:
            eng.dispose()

    with psycopg.connect(libpq_url(clean.database_url)) as purger:
        moved = store.recovery.purge(purger, retention_seconds=RETENTION, limit=purge_job.PURGE_BATCH)
        assert moved.count == 1
        thread = threading.Thread(target=writer)
        thread.start()
        # Either the writer is done (it did not wait) or it waits on the purge's lock: both are
        # decided before the purge commits.
        wait_for(
            lambda: "result" in outcome or "error" in outcome or waiting_on_lock(clean, name),
            10,
            "the writer to finish or to wait on the purge",
        )
        purger.commit()
    thread.join(10)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] == outbox.Written(original.id, False)
    assert live_rows(clean, "race:3") == []
    assert ledger(clean, "race:3") is not None


# -- operator commands -------------------------------------------------------------------------------


def run_cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    from outbox.cli import main

    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_of_a_purged_key_shows_its_ledger_entry(clean, engine, capsys) -> None:
    original = write_committed(engine, "order:20")
    make_sent(clean, original.id, outcomes=("lease_expired", "sent"))
    purge(clean)

    code, out, _ = run_cli(clean, capsys, "show", "order:20", "charge", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["purged"] is True
    entry = data["ledger"]
    assert (entry["id"], entry["state"], entry["provider_ref"]) == (original.id, "sent", f"ch_{original.id}")
    assert (entry["attempts"], entry["confirmed_attempts"], entry["ambiguous"]) == (2, 1, True)
    assert "amount_cents" not in out

    code, out, _ = run_cli(clean, capsys, "show", "order:20", "charge")
    assert code == 0 and "was purged" in out and f"ch_{original.id}" in out
    # By id the purged row is gone (the ledger is indexed by key only).
    code, _, err = run_cli(clean, capsys, "show", str(original.id))
    assert code == 1 and f"no outbox row with id {original.id}" in err


def test_audit_counts_purged_keys_and_fails_on_their_violations(clean, engine, capsys) -> None:
    clean_key = write_committed(engine, "order:21")
    make_sent(clean, clean_key.id, outcomes=("retry", "sent"))
    ambiguous = write_committed(engine, "order:22")
    make_sent(clean, ambiguous.id, outcomes=("lease_expired",))
    purge(clean)

    code, out, _ = run_cli(clean, capsys, "audit", "--json")
    assert code == 0, out
    purged = json.loads(out)["destinations"][DESTINATION]["purged_keys"]
    assert purged["keys"] == 2 and purged["by_state"]["sent"] == 2
    assert (purged["claimed_more_than_once"], purged["ambiguous"], purged["attempts"]) == (1, 1, 3)
    assert purged["confirmed_more_than_once"] == 0

    # A double charge found before the purge stays a finding after it.
    double = write_committed(engine, "order:23")
    make_sent(clean, double.id, outcomes=("sent", "superseded:sent"))
    purge(clean)
    code, out, _ = run_cli(clean, capsys, "audit", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["totals"]["purged_keys"]["confirmed_more_than_once"] == 1
    assert [(v["id"], v["kind"]) for v in report["violations"]] == [(double.id, "confirmed_more_than_once")]
    code, out, _ = run_cli(clean, capsys, "audit")
    assert code == 1 and "purged keys (key ledger)" in out and "row purged" in out


def test_horizon_setting_and_flag(clean, monkeypatch, capsys) -> None:
    from outbox import settings
    from outbox.cli import main
    from outbox.exceptions import ConfigError

    assert settings.from_env({}).ledger_horizon_seconds == 90 * 86400.0
    assert settings.from_env({"OUTBOX_LEDGER_HORIZON": "30d"}).ledger_horizon_seconds == 30 * 86400.0
    with pytest.raises(ConfigError, match="OUTBOX_LEDGER_HORIZON"):
        settings.from_env({"OUTBOX_LEDGER_HORIZON": "1d"})  # shorter than the 7 d retention
    # A long retention without a horizon of its own moves the default horizon up, not an error.
    assert settings.from_env({"OUTBOX_RETENTION": "180d"}).ledger_horizon_seconds == 180 * 86400.0
    monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
    monkeypatch.setenv("OUTBOX_REDIS_URL", clean.redis_url)
    assert main(["reconcile", "no.such.module", "--ledger-horizon", "2d", "--once"]) == 2
    assert "--ledger-horizon '2d' must be at least OUTBOX_RETENTION" in capsys.readouterr().err
