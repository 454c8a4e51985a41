"""Finding F4: the purge's hold-back for old REPEATABLE READ transactions reads xact_start from
pg_stat_activity, which hides other roles' sessions from a role without pg_read_all_stats. Such
a role must not purge blind: the purge skips (moves nothing), logs an error and counts it, and
`outbox doctor` fails its purge check."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from outbox.db import make_engine
from outbox.ops import doctor
from outbox.reconciler.jobs.purge import PURGE_SKIPPED_NO_PRIVILEGE, purge
from outbox.settings import Settings, libpq_url


@pytest.fixture
def role(clean: Any) -> Iterator[str]:
    """A role that may read and write the outbox tables, nothing more (no pg_read_all_stats)."""
    name = f"outbox_noprivs_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {name} NOLOGIN")
        admin.execute(f"GRANT USAGE ON SCHEMA public TO {name}")
        admin.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {name}")
        admin.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name}")
    try:
        yield name
    finally:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {name}")
            admin.execute(f"DROP ROLE {name}")


@pytest.fixture
def as_role(clean: Any, role: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute(f"SET ROLE {role}")
        yield conn


def old_sent_row(clean: Any) -> int:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        row = db.execute(
            "INSERT INTO outbox_message (key, step, destination, payload, state, provider_ref, "
            "completed_at) VALUES ('order:old', 'charge', 'payments.charge', '{}', 'sent', 'ch_1', "
            "now() - interval '30 days') RETURNING id"
        ).fetchone()
    assert row is not None
    return int(row[0])


def count_rows(clean: Any) -> int:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        row = db.execute("SELECT count(*) FROM outbox_message").fetchone()
    assert row is not None
    return int(row[0])


def test_purge_without_pg_read_all_stats_moves_nothing_and_says_so(
    clean: Any, role: str, as_role: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    old_sent_row(clean)
    with caplog.at_level(logging.ERROR, logger="outbox.reconciler.jobs.purge"):
        counts = purge(as_role, retention_seconds=3600)
    assert counts == {PURGE_SKIPPED_NO_PRIVILEGE: 1}
    assert count_rows(clean) == 1
    assert any("purge skipped" in r.getMessage() and role in r.getMessage() for r in caplog.records)

    # pg_monitor includes pg_read_all_stats: with it the purge runs.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as admin:
        admin.execute(f"GRANT pg_monitor TO {role}")
    assert purge(as_role, retention_seconds=3600) == {"purged": 1, "batches": 1}
    assert count_rows(clean) == 0


def test_doctor_fails_the_purge_checks(clean: Any, role: str) -> None:
    old_sent_row(clean)
    cfg = Settings(database_url=clean.database_url, retention_seconds=7 * 86400.0)
    engine = make_engine(clean.database_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"SET ROLE {role}"))
            checks = {c.name: c for c in doctor._purge_checks(conn, cfg)}
            conn.execute(text("RESET ROLE"))
            conn.rollback()
    finally:
        engine.dispose()
    assert checks["purge"].status == doctor.FAIL and "pg_read_all_stats" in checks["purge"].detail
    assert checks["retention"].status == doctor.FAIL and "1 sent/cancelled" in checks["retention"].detail
    assert not checks["purge"].ok and not checks["retention"].ok
