"""The packaged Alembic migrations: `outbox migrate` on an empty database, twice, concurrently; the
resulting schema against outbox.schema.metadata; its constraints and its NOTIFY trigger."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from importlib import resources
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from databases import fresh_database
from psycopg import errors
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SAWarning

from outbox.db import make_engine
from outbox.exceptions import NotMigrated
from outbox.migrate import (
    FLOOR_TABLE,
    SCHEMA_OLDEST,
    alembic_config,
    check_schema,
    current_revision,
    head_revision,
    upgrade,
)
from outbox.schema import NOTIFY_CHANNEL, VERSION_TABLE, metadata
from outbox.settings import libpq_url

TABLES = {"outbox_message", "outbox_attempt", "outbox_key_ledger"}
TABLES |= {"outbox_process", "outbox_no_consumer"}  # 0005_transport
TABLES |= {"outbox_db_identity"}  # 0006_integrity
TABLES |= {"outbox_destination"}  # 0009_destination_pause
TABLES |= {"outbox_batch"}  # 0014_batches
# 0022_rolling_deploys: the features, and the floor (its requirement: code from 0010).
TABLES |= {"outbox_feature", "outbox_schema_floor"}
TABLES |= {"outbox_dashboard_session_end"}  # 0020_dashboard_sessions


@pytest.fixture
def empty_url(empty_database_url: str) -> str:
    return empty_database_url


@pytest.fixture(scope="module")
def migrated(services) -> Iterator[Engine]:
    """A database of its own, migrated once for this module (nothing else writes to it)."""
    with fresh_database(services.database_url) as url:
        engine = make_engine(url)
        upgrade(engine)
        try:
            yield engine
        finally:
            engine.dispose()


def migrate(url: str, services) -> subprocess.Popen[str]:
    # The environment points at the shared test database: the flag must win over it.
    return subprocess.Popen(
        [sys.executable, "-m", "outbox", "migrate", "--database-url", url],
        env=services.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def tables(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        found = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {name for (name,) in found}


def test_migrate_creates_the_tables_then_is_a_no_op(empty_url, services) -> None:
    head = head_revision()
    assert tables(empty_url) == set()
    code, out, err = finish(migrate(empty_url, services))
    assert code == 0, err
    assert f"migrated from empty to revision {head}" in out
    assert tables(empty_url) == TABLES | {VERSION_TABLE}
    code, out, err = finish(migrate(empty_url, services))
    assert code == 0, err
    assert f"already at revision {head}" in out
    assert tables(empty_url) == TABLES | {VERSION_TABLE}


def test_concurrent_migrations_both_succeed(empty_url, services) -> None:
    procs = [migrate(empty_url, services) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    outs = sorted(out for _, out, _ in results)
    head = head_revision()
    # Exactly one of them did the work; the other waited for it and found the schema in place.
    assert f"already at revision {head}" in outs[0], outs
    assert f"migrated from empty to revision {head}" in outs[1], outs
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            check_schema(conn)
            assert conn.execute(text(f"SELECT count(*) FROM {VERSION_TABLE}")).scalar() == 1
    finally:
        engine.dispose()


def test_check_schema_on_an_empty_database(empty_url) -> None:
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            with pytest.raises(NotMigrated, match=r"run `outbox migrate`.*outbox_message does not exist"):
                check_schema(conn)
            assert current_revision(conn) is None
            assert conn.execute(text("SELECT 1")).scalar() == 1  # the connection is still usable
    finally:
        engine.dispose()


def test_check_schema_at_another_revision(migrated) -> None:
    # The range this code accepts is tested in test_schema_compat.py; here, what it refuses.
    with migrated.connect() as conn:
        check_schema(conn)
        assert current_revision(conn) == head_revision()
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0000'"))
        with pytest.raises(
            NotMigrated, match=f"at revision 0000, this version needs {SCHEMA_OLDEST} or later"
        ):
            check_schema(conn)
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'abc123'"))
        with pytest.raises(NotMigrated, match="at revision abc123, which this version does not know"):
            check_schema(conn)
        conn.rollback()


def test_downgrade_then_upgrade_again(empty_url) -> None:
    engine = make_engine(empty_url)
    try:
        assert upgrade(engine) == (None, head_revision())
        assert upgrade(engine) == (head_revision(), head_revision())
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        assert tables(empty_url) == {VERSION_TABLE}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT to_regproc('outbox_message_notify')")).scalar() is None
        assert upgrade(engine) == (None, head_revision())
    finally:
        engine.dispose()


def test_schema_matches_the_metadata(migrated) -> None:
    with migrated.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        with warnings.catch_warnings():
            # SQLAlchemy reflects a NOT VALID check (0007's) with a 'dialect_options' argument
            # it then warns it cannot validate; check constraints are not compared anyway.
            warnings.filterwarnings("ignore", "Can't validate argument 'dialect_options'", SAWarning)
            diff = compare_metadata(context, metadata)
    # Neither table is in the metadata: Alembic's, and the one contract migrations create.
    diff = [d for d in diff if not (d[0] == "remove_table" and d[1].name in (VERSION_TABLE, FLOOR_TABLE))]
    assert diff == []
    assert set(inspect(migrated).get_table_names()) == TABLES | {VERSION_TABLE}


def test_partial_indexes_exist(migrated) -> None:
    with migrated.connect() as conn:
        found = conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox_message'")
        ).all()
    indexes = {name: definition for name, definition in found}
    assert "WHERE (state = 'pending'::text)" in indexes["outbox_message_pending_idx"]
    assert "WHERE (state = 'in_flight'::text)" in indexes["outbox_message_in_flight_idx"]
    assert "WHERE (state = 'dispatched'::text)" in indexes["outbox_message_dispatched_idx"]


def libpq_of(engine: Engine) -> str:
    return libpq_url(engine.url.render_as_string(hide_password=False))


def raw_insert(engine: Engine, **columns: Any) -> None:
    values = {"key": "order:1", "step": "charge", "destination": "payments.charge", "payload": "{}"}
    values.update(columns)
    names = ", ".join(values)
    placeholders = ", ".join(f"%({name})s" for name in values)
    with psycopg.connect(libpq_of(engine)) as conn:
        conn.execute(f"INSERT INTO outbox_message ({names}) VALUES ({placeholders})", values)
        conn.rollback()


@pytest.mark.parametrize(
    ("columns", "error", "constraint"),
    [
        ({"state": "bogus"}, errors.CheckViolation, "outbox_message_state_check"),
        ({"state": "sent"}, errors.CheckViolation, "outbox_message_sent_ref_check"),
        ({"state": "in_flight"}, errors.CheckViolation, "outbox_message_in_flight_check"),
        ({"key": ""}, errors.CheckViolation, "outbox_message_key_step_check"),
        ({"attempts": -1}, errors.CheckViolation, "outbox_message_attempts_check"),
        ({"payload": "not json"}, errors.InvalidTextRepresentation, None),
        ({"destination": None}, errors.NotNullViolation, None),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_constraints_reject_bad_rows(migrated, columns, error, constraint) -> None:
    raw_insert(migrated)  # a good row passes
    with pytest.raises(error) as info:
        raw_insert(migrated, **columns)
    if constraint:
        assert info.value.diag.constraint_name == constraint


def test_sent_with_provider_ref_is_accepted(migrated) -> None:
    raw_insert(migrated, state="sent", provider_ref="ch_123", attempts=1)


def test_unique_key_step(migrated) -> None:
    with psycopg.connect(libpq_of(migrated)) as conn:
        insert = "INSERT INTO outbox_message (key, step, destination, payload) VALUES (%s, %s, 'd', '{}')"
        conn.execute(insert, ("order:1", "charge"))
        conn.execute(insert, ("order:1", "refund"))
        conn.execute(insert, ("order:2", "charge"))
        # The key guard (migration 0003) skips an insert of a key the statement sees, so a plain
        # INSERT of a duplicate inserts nothing; the unique constraint still backs it up.
        assert conn.execute(insert + " RETURNING id", ("order:1", "charge")).fetchall() == []
        assert conn.execute("SELECT count(*) FROM outbox_message WHERE key = 'order:1'").fetchone() == (2,)
        conn.execute("ALTER TABLE outbox_message DISABLE TRIGGER outbox_message_key_guard")
        with pytest.raises(errors.UniqueViolation) as info:
            conn.execute(insert, ("order:1", "charge"))
        assert info.value.diag.constraint_name == "outbox_message_key_step_key"
        conn.rollback()


def test_insert_notifies_at_commit(migrated) -> None:
    url = libpq_of(migrated)
    with psycopg.connect(url, autocommit=True) as listener, psycopg.connect(url) as writer:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        writer.execute(
            "INSERT INTO outbox_message (key, step, destination, payload) "
            "VALUES ('invoice:1', 'export', 'erp.export', '{}'), ('invoice:2', 'export', 'erp.export', '{}')"
        )
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == [], "NOTIFY before commit"
        writer.commit()
        received = list(listener.notifies(timeout=2, stop_after=1))
        assert [n.channel for n in received] == [NOTIFY_CHANNEL]
        writer.execute("DELETE FROM outbox_message")
        writer.commit()


def test_migrations_are_packaged() -> None:
    root = resources.files("outbox.migrations")
    assert root.joinpath("env.py").is_file()
    assert root.joinpath("script.py.mako").is_file()
    versions = [p.name for p in root.joinpath("versions").iterdir() if p.name.endswith(".py")]
    assert "0001_initial.py" in versions
    cfg = alembic_config()
    assert cfg.get_main_option("script_location") == str(root)
    script = ScriptDirectory.from_config(cfg)
    revisions = list(script.walk_revisions())
    assert len(revisions) == len([v for v in versions if v != "__init__.py"])
    assert script.get_heads() == [head_revision()]
    assert revisions[-1].down_revision is None


def test_an_interrupted_concurrent_index_build_is_retried_to_the_head(services) -> None:
    """(attack on issue 13, F2) `outbox migrate` waits in CREATE INDEX CONCURRENTLY for an open
    writing transaction (the previous release's application); the deploy gives up on it. The
    next `outbox migrate` must get to the head, not fail on what the interrupted run committed."""
    import threading
    import time

    import psycopg

    with fresh_database(services.database_url) as url:
        engine = make_engine(url)
        try:
            upgrade(engine, "0009")
            blocker = psycopg.connect(libpq_url(url))
            blocker.execute(
                "INSERT INTO outbox_message (key, step, destination, payload) "
                "VALUES ('order:2', 'charge', 'payments.charge', '{}')"
            )
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    upgrade(engine)
                except Exception as exc:
                    errors.append(exc)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            with psycopg.connect(libpq_url(url), autocommit=True) as admin:
                pid = None
                for _ in range(200):
                    row = admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE query ILIKE 'CREATE INDEX CONCURRENTLY%%' "
                        "AND datname = current_database()"
                    ).fetchone()
                    if row:
                        pid = row[0]
                        break
                    time.sleep(0.05)
                assert pid is not None, "the index build did not start"
                admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
                thread.join(30)
            assert errors, "the cancelled upgrade did not fail"
            blocker.rollback()
            blocker.close()
            with engine.connect() as conn:
                assert current_revision(conn) == "0010", "the revision before the index committed"
            upgrade(engine)
            with engine.connect() as conn:
                assert current_revision(conn) == head_revision()
                valid = conn.execute(
                    text(
                        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                        "WHERE c.relname = 'outbox_message_deadline_idx'"
                    )
                ).scalar_one()
                assert valid
        finally:
            engine.dispose()
