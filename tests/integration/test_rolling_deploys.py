"""Rolling deploys (migration 0022, outbox.features): the rules hold for statements of a release
that does not know them, because the database enforces them or refuses the feature until an
operator enables it. The older release's statements are written here as it sends them (plain
SQL, no rule of this code in them); tests/integration/test_previous_release_beside.py runs an
older release's relay and worker for real. Real PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

import outbox
from outbox import chains, features, store
from outbox.exceptions import ConfigError, FeatureNotEnabled, FeatureRefused
from outbox.heartbeat import Heartbeat
from outbox.migrate import FLOOR_TABLE, schema_status, upgrade
from outbox.reconciler.jobs.chains import write_uncomputed
from outbox.settings import libpq_url

DEST = "payments.charge"

# What a release before 0017 sends to claim a row: no ordering in it.
OLD_CLAIM = """
UPDATE outbox_message
SET state = 'in_flight', attempts = attempts + 1, claim_token = gen_random_uuid(),
    claimed_at = now(), lease_expires_at = now() + interval '30 seconds'
WHERE id = %s AND state IN ('pending', 'dispatched')
RETURNING id
"""
# What an older worker sends to record a confirmed call: no chains in it.
OLD_SENT = """
UPDATE outbox_message
SET state = 'sent', provider_ref = %s, completed_at = now(), lease_expires_at = NULL
WHERE id = %s AND state = 'in_flight'
RETURNING id
"""
# An older release's replay: failed -> pending, with a history entry but none of today's rules.
OLD_REPLAY = """
UPDATE outbox_message
SET state = 'pending', attempts = 0, available_at = now(), completed_at = NULL,
    history = history || '[{"action": "replay", "by": "old-cli"}]'::jsonb
WHERE id = %s AND state = 'failed'
RETURNING id
"""


def write(engine: Any, key: str, **kw: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step=kw.pop("step", "charge"), destination=DEST, payload={}, **kw).id


def state(db: psycopg.Connection[Any], row_id: int) -> str:
    row = db.execute("SELECT state FROM outbox_message WHERE id = %s", (row_id,)).fetchone()
    assert row is not None
    return str(row[0])


def fail(db: psycopg.Connection[Any], row_id: int, history: list[dict[str, Any]] | None = None) -> None:
    """A row failed for certain, as the worker leaves it (claimed, recorded failed)."""
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="failed", outcome="failed", error="declined"
    ).state
    if history:
        db.execute("UPDATE outbox_message SET history = %s WHERE id = %s", (json.dumps(history), row_id))


@pytest.fixture
def gate_off(clean: Any) -> Iterator[Any]:
    """payload_versions off, as an upgrade made while older workers ran leaves it; no heartbeats."""
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_process")
        saved = conn.execute("SELECT name, needs_code, enabled_by FROM outbox_feature").fetchall()
        conn.execute("DELETE FROM outbox_feature")
        conn.execute(f"DELETE FROM {FLOOR_TABLE} WHERE migration LIKE 'feature:%%'")
    yield clean
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_process")
        conn.execute("DELETE FROM outbox_feature")
        conn.execute(f"DELETE FROM {FLOOR_TABLE} WHERE migration LIKE 'feature:%%'")
        for row in saved:
            conn.execute("INSERT INTO outbox_feature (name, needs_code, enabled_by) VALUES (%s, %s, %s)", row)


def old_heartbeat(db: psycopg.Connection[Any], kind: str = "worker") -> uuid.UUID:
    """The beat of a release before 0022: no schema range."""
    pid = uuid.uuid4()
    db.execute(
        "INSERT INTO outbox_process (id, kind, hostname, pid, queues, interval_seconds, started_at,"
        " last_seen_at, process_clock) VALUES (%s, %s, 'old-host', 4242, %s, 5, now(), now(), now())",
        (pid, kind, [DEST]),
    )
    return pid


# -- ordering: the claim of a row behind its key's head does not happen ---------------------------


def test_an_older_claim_of_a_row_behind_its_head_moves_nothing(clean, engine, db) -> None:
    head = write(engine, "order:1", ordering_key="customer:7")
    behind = write(engine, "order:2", ordering_key="customer:7")
    other = write(engine, "order:3", ordering_key="customer:8")
    assert db.execute(OLD_CLAIM, (behind,)).fetchall() == []
    assert state(db, behind) == "pending"
    # The head, and another key's row, go as before.
    assert db.execute(OLD_CLAIM, (head,)).fetchall() == [(head,)]
    assert db.execute(OLD_CLAIM, (other,)).fetchall() == [(other,)]
    # While the head is in flight, still nothing; once it settles, the next row goes.
    assert db.execute(OLD_CLAIM, (behind,)).fetchall() == []
    assert db.execute(OLD_SENT, ("ch_1", head)).fetchall() == [(head,)]
    assert db.execute(OLD_CLAIM, (behind,)).fetchall() == [(behind,)]


def test_a_failed_head_holds_its_key_against_older_claims_too(clean, engine, db) -> None:
    head = write(engine, "order:1", ordering_key="customer:7")
    behind = write(engine, "order:2", ordering_key="customer:7")
    fail(db, head)
    assert db.execute(OLD_CLAIM, (behind,)).fetchall() == []
    # An operator's skip lets it go (this code's statement); then the older claim moves it.
    with engine.begin() as conn:
        assert store.operator.skip_head(
            conn,
            row_id=head,
            history={"by": "op", "action": "skip", "reason": "r", "to_state": "failed", "extra": "{}"},
        )
    assert db.execute(OLD_CLAIM, (behind,)).fetchall() == [(behind,)]


# -- failed stands: replays and late confirmations of older releases -------------------------------

RESOLVED_FAILED = [{"action": "resolve", "from": "unknown", "to": "failed", "by": "support"}]


def test_an_operators_resolve_failed_stands_against_older_statements(clean, engine, db) -> None:
    row = write(engine, "order:1")
    fail(db, row, RESOLVED_FAILED)
    assert db.execute(OLD_REPLAY, (row,)).fetchall() == []
    assert (
        db.execute("UPDATE outbox_message SET state = 'sent' WHERE id = %s RETURNING id", (row,)).fetchall()
        == []
    )
    assert state(db, row) == "failed"
    # A forced replay, by name, still goes (this code writes "forced" in the same statement).
    forced = db.execute(
        "UPDATE outbox_message SET state = 'pending', history = history || "
        """'[{"action": "replay", "forced": true, "by": "op"}]'::jsonb WHERE id = %s RETURNING id""",
        (row,),
    ).fetchall()
    assert forced == [(row,)]


def test_an_older_replay_of_a_row_out_of_its_keys_line_moves_nothing(clean, engine, db) -> None:
    head = write(engine, "order:1", ordering_key="customer:7")
    behind = write(engine, "order:2", ordering_key="customer:7")
    fail(db, head)
    with engine.begin() as conn:
        store.operator.skip_head(
            conn,
            row_id=head,
            history={"by": "op", "action": "skip", "reason": "r", "to_state": "failed", "extra": "{}"},
        )
    claimed = store.delivery.claim(db, row_id=behind, destination=DEST, lease_seconds=30)
    assert claimed is not None
    # Replayed now, the head would go after the row behind it.
    assert db.execute(OLD_REPLAY, (head,)).fetchall() == []
    assert state(db, head) == "failed"


def test_an_older_replay_of_a_compensated_step_moves_nothing(clean, engine, db) -> None:
    row = write(engine, "order:1")
    fail(db, row)
    db.execute(
        "INSERT INTO outbox_message (key, step, destination, payload, parent_id, via)"
        " VALUES ('order:1', 'refund', %s, '{}', %s, %s)",
        (DEST, row, chains.ON_FAILURE),
    )
    assert db.execute(OLD_REPLAY, (row,)).fetchall() == []
    # A failed row with neither is replayed by an older statement as before.
    plain = write(engine, "order:2")
    fail(db, plain)
    assert db.execute(OLD_REPLAY, (plain,)).fetchall() == [(plain,)]


# -- chains: a row an older release settled sent gets its then steps from the reconciler ------------


def declare_chain() -> None:
    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called here
        raise AssertionError("no call in this test")

    @charge.then
    def ship(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("ship", "warehouse.ship", {"charge": c.ref})]


def test_a_row_an_older_release_settled_sent_is_followed_once(clean, engine, db) -> None:
    declare_chain()
    row = write(engine, "order:1")
    assert db.execute(OLD_CLAIM, (row,)).fetchall() == [(row,)]
    assert db.execute(OLD_SENT, ("ch_1", row)).fetchall() == [(row,)]
    problem = db.execute("SELECT chain_problem FROM outbox_message WHERE id = %s", (row,)).fetchone()
    assert problem == (chains.NOT_COMPUTED,)
    handlers = outbox.handlers.registry()
    assert write_uncomputed(db, handlers) == {"followed": 1, "steps": 1}
    assert write_uncomputed(db, handlers) == {}
    steps = db.execute(
        "SELECT step, payload, parent_id FROM outbox_message WHERE key = 'order:1' ORDER BY id"
    )
    assert steps.fetchall() == [("charge", {}, None), ("ship", {"charge": "ch_1"}, row)]
    assert db.execute("SELECT chain_problem FROM outbox_message WHERE id = %s", (row,)).fetchone() == (None,)


def claim_and_plan(db: psycopg.Connection[Any], row: int) -> tuple[Any, chains.Plan]:
    """This code's claim of ``row`` and the then plan its worker records with ``ch_1``."""
    claimed = store.delivery.claim(db, row_id=row, destination=DEST, lease_seconds=30)
    assert claimed is not None
    stored = db.execute(
        "SELECT id, key, step, destination, payload, attempts, deadline, payload_version FROM outbox_message"
        " WHERE id = %s",
        (row,),
    )
    names = [c.name for c in stored.description or ()]
    stored_row = dict(zip(names, stored.fetchone() or (), strict=True))
    return claimed, chains.then_plan_for_row(
        outbox.handlers.registry()[DEST], stored_row, outbox.Confirmed("ch_1")
    )


def test_this_codes_settlements_leave_no_mark(clean, engine, db) -> None:
    declare_chain()
    row = write(engine, "order:1")
    claimed, plan = claim_and_plan(db, row)
    done = store.delivery.record(
        db, row_id=row, token=claimed.token, state="sent", outcome="sent", ref="ch_1", follow=plan
    )
    assert done.state == "sent"
    assert db.execute("SELECT chain_problem FROM outbox_message WHERE id = %s", (row,)).fetchone() == (None,)
    assert write_uncomputed(db, outbox.handlers.registry()) == {}


def test_a_release_that_wrote_the_steps_itself_has_only_its_mark_cleared(clean, engine, db) -> None:
    declare_chain()
    row = write(engine, "order:1")
    assert db.execute(OLD_CLAIM, (row,)).fetchall() == [(row,)]
    # A release that knows chains, not the mark: it writes the step in the same statement.
    db.execute(
        "WITH moved AS (" + OLD_SENT.replace("RETURNING id", "RETURNING id, key") + ")"
        " INSERT INTO outbox_message (key, step, destination, payload, parent_id, via)"
        " SELECT key, 'ship', 'warehouse.ship', '{\"charge\": \"other\"}', id, 'then' FROM moved",
        ("ch_1", row),
    )
    # Marked all the same (the trigger runs no query); the chains job only takes the mark off.
    assert write_uncomputed(db, outbox.handlers.registry()) == {"cleared": 1}
    rows = db.execute(
        "SELECT step, payload, chain_problem FROM outbox_message WHERE key = 'order:1' ORDER BY id"
    )
    assert rows.fetchall() == [("charge", {}, None), ("ship", {"charge": "other"}, None)]


def test_rows_an_older_release_settled_without_a_then_are_cleared_many_at_a_time(clean, engine, db) -> None:
    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called here
        raise AssertionError("no call in this test")

    rows = [write(engine, f"order:{i}") for i in range(300)]
    for row in rows:
        db.execute(OLD_CLAIM, (row,))
        db.execute(OLD_SENT, ("ch", row))
    marked = db.execute(
        "SELECT count(*) FROM outbox_message WHERE chain_problem = %s", (chains.NOT_COMPUTED,)
    )
    assert marked.fetchone() == (300,)
    # One run, whatever its batch of rows to compute: no step to compute for a handler without @then.
    assert write_uncomputed(db, outbox.handlers.registry(), batch_size=10) == {"cleared": 300}
    assert db.execute("SELECT count(*) FROM outbox_message WHERE chain_problem IS NOT NULL").fetchone() == (
        0,
    )


def test_a_row_alerted_while_unknown_then_settled_by_an_older_resolve_is_followed(clean, engine, db) -> None:
    """An older `outbox resolve --sent` leaves alerted_at as the alert left it; the mark takes it
    away, or the chains job (which takes rows not alerted) would never see the row."""
    declare_chain()
    row = write(engine, "order:1")
    assert db.execute(OLD_CLAIM, (row,)).fetchall() == [(row,)]
    db.execute(
        "UPDATE outbox_message SET state = 'unknown', unknown_since = now(), lease_expires_at = NULL,"
        " alerted_at = now() WHERE id = %s",
        (row,),
    )
    db.execute(
        "UPDATE outbox_message SET state = 'sent', provider_ref = 'ch_1', completed_at = now() WHERE id = %s",
        (row,),
    )
    assert write_uncomputed(db, outbox.handlers.registry()) == {"followed": 1, "steps": 1}
    assert db.execute("SELECT count(*) FROM outbox_message WHERE step = 'ship'").fetchone() == (1,)


# -- payload versions: gated --------------------------------------------------------------------


def test_a_payload_version_is_refused_until_enabled(gate_off, engine, db) -> None:
    with pytest.raises(FeatureNotEnabled, match="outbox features enable payload_versions") as info:
        write(engine, "order:1", payload_version=2)
    assert info.value.feature == "payload_versions"
    with pytest.raises(psycopg.Error) as raw:
        db.execute(
            "INSERT INTO outbox_message (key, step, destination, payload, payload_version)"
            " VALUES ('order:2', 'charge', %s, '{}', 2)",
            (DEST,),
        )
    assert raw.value.sqlstate == features.SQLSTATE
    with pytest.raises(FeatureNotEnabled), Session(engine) as s, s.begin():
        outbox.batch(s, name="batch:1", then=outbox.Next("done", DEST, {}, payload_version=3))
    # Version 1 rows are not concerned.
    assert write(engine, "order:3") > 0
    done = features.enable(
        engine, "payload_versions", by="ops", reason="all workers on this release", settle_seconds=0
    )
    assert done.enabled
    assert write(engine, "order:1", payload_version=2) > 0


def test_enabling_waits_for_every_older_process(gate_off, engine, db) -> None:
    old = old_heartbeat(db, "worker")
    current = Heartbeat(gate_off.database_url.replace("+psycopg", ""), kind="relay")
    current.beat()
    try:
        with pytest.raises(FeatureRefused) as info:
            features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
        assert info.value.processes == ["worker old-host:4242 (a release before schema ranges)"]
        with engine.connect() as conn:
            (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
        assert not listed.enabled and listed.holdouts == (
            "worker old-host:4242 (a release before schema ranges)",
        )
        # A process whose code predates the feature counts too, by its range.
        db.execute(
            "UPDATE outbox_process SET schema_oldest = '0010', schema_newest = '0015' WHERE id = %s", (old,)
        )
        with pytest.raises(FeatureRefused, match=r"code up to revision 0015"):
            features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
        # Stopped (a clean stop marks it), it no longer counts; this code's relay never did.
        db.execute("UPDATE outbox_process SET stopped_at = now() WHERE id = %s", (old,))
        features.enable(engine, "payload_versions", by="ops", reason="rolled", settle_seconds=0)
    finally:
        current.stop()
    # The floor: code older than 0016 no longer starts here.
    with engine.connect() as conn:
        assert schema_status(conn).floor == "0016"
        floor = conn.execute(
            text(f"SELECT needs_code FROM {FLOOR_TABLE} WHERE migration = 'feature:payload_versions'")
        )
        assert floor.scalar() == "0016"
        (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
    assert listed.enabled and listed.enabled_by == "ops" and listed.reason == "rolled"
    # Enabling again changes nothing.
    assert (
        features.enable(engine, "payload_versions", by="someone else", settle_seconds=0).enabled_by == "ops"
    )


def test_an_unknown_feature_is_a_clear_error(gate_off, engine) -> None:
    with pytest.raises(ConfigError, match="the features are: fairness, payload_versions"):
        features.enable(engine, "payload_version", by="ops", settle_seconds=0)


def test_a_chain_step_with_a_version_is_written_and_waits_at_its_claim_until_enabled(
    gate_off, engine, db
) -> None:
    """The settling statement (this release's or an older one's) never fails after a charge: the
    step is written, and no worker claims it until the feature is on."""

    @outbox.handler(DEST, time_limit=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:  # pragma: no cover - never called here
        raise AssertionError("no call in this test")

    @charge.then
    def ship(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("ship", "warehouse.ship", {"charge": c.ref}, payload_version=2)]

    row = write(engine, "order:1")
    claimed, plan = claim_and_plan(db, row)
    done = store.delivery.record(
        db, row_id=row, token=claimed.token, state="sent", outcome="sent", ref="ch_1", follow=plan
    )
    assert done.state == "sent" and done.followed == 1
    (step,) = db.execute(
        "SELECT id FROM outbox_message WHERE step = 'ship' AND payload_version = 2"
    ).fetchone()
    # No claim of it, this code's or an older one's, while the feature is off.
    assert store.delivery.claim(db, row_id=step, destination="warehouse.ship", lease_seconds=30) is None
    assert db.execute(OLD_CLAIM, (step,)).fetchall() == []
    assert state(db, step) == "pending"
    features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
    assert store.delivery.claim(db, row_id=step, destination="warehouse.ship", lease_seconds=30) is not None


def test_an_older_process_is_seen_by_its_connection_before_it_beats(gate_off, engine, db) -> None:
    """Relays and reconcilers before 0022 do not beat, and a worker beats only once it consumes;
    each holds its failover check's connection from its start ("outbox-failover")."""
    from outbox.settings import libpq_url as plain

    url = plain(gate_off.database_url)
    with psycopg.connect(url, autocommit=True, application_name="outbox-failover"):
        with pytest.raises(FeatureRefused, match=r"connected from .* \(a release before 0022\)"):
            features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
        # A release that names its revision, older than the feature: refused by number.
        with psycopg.connect(url, autocommit=True, application_name="outbox-failover/0015"):
            with engine.connect() as conn:
                (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
            assert sorted(listed.holdouts)[0].endswith("(a release before 0022)")
            assert sorted(listed.holdouts)[1].endswith("(code up to revision 0015)")
    # This release's own connection does not count.
    with psycopg.connect(url, autocommit=True, application_name="outbox-failover/0022"):
        assert features.enable(engine, "payload_versions", by="ops", settle_seconds=0).enabled


def test_an_older_process_appearing_while_enabling_settles_takes_the_floor_back(gate_off, engine, db) -> None:
    """Between raising the floor and the last look, a process that passed its start-up check just
    before shows itself: enabling refuses, and the floor goes back down."""
    import threading

    from outbox.settings import libpq_url as plain

    appeared = threading.Event()
    done = threading.Event()

    def start_old_worker() -> None:
        with psycopg.connect(
            plain(gate_off.database_url), autocommit=True, application_name="outbox-failover"
        ):
            appeared.set()
            done.wait(10)

    threading.Timer(0.3, start_old_worker).start()
    try:
        with pytest.raises(FeatureRefused, match="a release before 0022"):
            features.enable(engine, "payload_versions", by="ops", settle_seconds=1.5)
        assert appeared.is_set()
    finally:
        done.set()
    with engine.connect() as conn:
        (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
        floor = conn.execute(text(f"SELECT count(*) FROM {FLOOR_TABLE} WHERE migration LIKE 'feature:%'"))
        assert floor.scalar() == 0
    assert not listed.enabled


# -- the migration's own choice --------------------------------------------------------------------


def test_migration_0022_enables_only_what_no_live_process_can_break(empty_database_url) -> None:
    from outbox.db import make_engine

    url = empty_database_url
    engine = make_engine(url)
    try:
        upgrade(engine, revision="0021")
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            old_heartbeat(conn, "worker")
        upgrade(engine)
        with engine.connect() as conn:
            (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
        assert not listed.enabled and listed.holdouts
    finally:
        engine.dispose()


def test_migration_0022_keeps_a_feature_the_rows_use_on(empty_database_url) -> None:
    from outbox.db import make_engine

    engine = make_engine(empty_database_url)
    try:
        upgrade(engine, revision="0021")
        with psycopg.connect(libpq_url(empty_database_url), autocommit=True) as conn:
            old_heartbeat(conn, "worker")
            conn.execute(
                "INSERT INTO outbox_message (key, step, destination, payload, payload_version)"
                " VALUES ('order:1', 'charge', %s, '{}', 2)",
                (DEST,),
            )
        upgrade(engine)
        with engine.connect() as conn:
            (listed,) = [f for f in features.states(conn) if f.feature.name == "payload_versions"]
        assert listed.enabled and listed.reason == "rows used it already"
    finally:
        engine.dispose()


# -- the command --------------------------------------------------------------------------------


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    from outbox.cli import main

    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_features_command_lists_refuses_and_enables(gate_off, db, capsys) -> None:
    old = old_heartbeat(db, "reconciler")
    code, out, _ = cli(gate_off, capsys, "features")
    assert code == 0
    assert "payload_versions: off (needs code from revision 0016" in out
    assert "kept off by reconciler old-host:4242 (a release before schema ranges)" in out
    code, _, err = cli(gate_off, capsys, "features", "enable", "payload_versions")
    assert code != 0 and "--reason is required" in err
    code, out, err = cli(
        gate_off, capsys, "features", "enable", "payload_versions", "--reason", "rolled", "--settle", "0"
    )
    assert code == 1 and "cannot enable payload_versions: 1 live process(es)" in err
    assert "reconciler old-host:4242" in err and out == ""
    code, out, _ = cli(
        gate_off, capsys, "features", "enable", "payload_versions", "--reason", "x", "--json", "--settle", "0"
    )
    assert code == 1 and json.loads(out)["holdouts"] == [
        "reconciler old-host:4242 (a release before schema ranges)"
    ]
    db.execute("UPDATE outbox_process SET stopped_at = now() WHERE id = %s", (old,))
    code, out, _ = cli(
        gate_off,
        capsys,
        "features",
        "enable",
        "payload_versions",
        "--reason",
        "rolled",
        "--by",
        "ann",
        "--settle",
        "0.2",
    )
    assert code == 0, out
    assert "payload_versions: on since" in out and "by ann" in out
    assert "code older than revision 0016 no longer starts on this database" in out
    code, out, _ = cli(gate_off, capsys, "features", "--json")
    (listed,) = [f for f in json.loads(out)["features"] if f["name"] == "payload_versions"]
    assert listed["enabled"] and listed["enabled_by"] == "ann" and listed["reason"] == "rolled"
    code, _, err = cli(gate_off, capsys, "features", "enable", "ordering", "--reason", "x")
    assert code != 0 and "no feature named 'ordering'" in err


def test_the_relay_and_the_reconciler_beat_with_their_range(gate_off, db) -> None:
    """A relay or reconciler of a release before ranges is invisible to `features enable`; this
    release's beat, so that the next feature waits for them too."""
    import signal
    import subprocess
    import sys
    import time

    from outbox.migrate import SCHEMA_OLDEST, head_revision

    env = gate_off.env(OUTBOX_HEARTBEAT_INTERVAL="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outbox", "relay"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "outbox", "reconcile", "examples.shop.handlers"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        deadline = time.monotonic() + 30
        seen: list[tuple[Any, ...]] = []
        while time.monotonic() < deadline and len(seen) < 2:
            seen = db.execute(
                "SELECT kind, schema_oldest, schema_newest FROM outbox_process"
                " WHERE stopped_at IS NULL ORDER BY kind"
            ).fetchall()
            time.sleep(0.2)
        assert seen == [
            ("reconciler", SCHEMA_OLDEST, head_revision()),
            ("relay", SCHEMA_OLDEST, head_revision()),
        ]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=30)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # A clean stop marks them stopped: nobody waits for them to go stale.
    assert db.execute("SELECT count(*) FROM outbox_process WHERE stopped_at IS NULL").fetchone() == (0,)


def test_doctor_fails_an_enabled_feature_that_a_live_process_does_not_know(
    gate_off, db, engine, capsys
) -> None:
    features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
    code, out, _ = cli(gate_off, capsys, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["features"]["status"] == "ok"
    assert checks["features"]["detail"].startswith("payload_versions on, fairness off")
    # A worker of older code that passed its start-up check in the instant of enabling.
    old_heartbeat(db, "worker")
    code, out, _ = cli(gate_off, capsys, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1 and checks["features"]["status"] == "FAIL"
    assert (
        "payload_versions is on, but worker old-host:4242 (a release before schema ranges) does not know it"
        in (checks["features"]["detail"])
    )


def test_an_older_reconcilers_job_connection_and_an_older_workers_beat_connection_count(
    gate_off, engine
) -> None:
    """An older process's failover connection can drop between its checks (every 30 s): its
    other connections, named without a revision, still show it."""
    from outbox.settings import libpq_url as plain

    url = plain(gate_off.database_url)
    for name in ("outbox-reconcile-resolve_unknown", "outbox-worker"):
        with psycopg.connect(url, autocommit=True, application_name=name):
            with pytest.raises(FeatureRefused, match=f"as {name} \\(a release before 0022\\)"):
                features.enable(engine, "payload_versions", by="ops", settle_seconds=0)
    # This release names its own with the revision.
    with (
        psycopg.connect(url, autocommit=True, application_name="outbox-reconcile-resolve_unknown/0022"),
        psycopg.connect(url, autocommit=True, application_name="outbox-worker/0022"),
    ):
        assert features.enable(engine, "payload_versions", by="ops", settle_seconds=0).enabled
