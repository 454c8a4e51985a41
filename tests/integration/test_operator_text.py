"""Finding F3: what an operator types (every --reason) is stored by the sanitiser's rules, like
any error text: a card number pasted into a reason never reaches history or last_error."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import sql
from sqlalchemy.orm import Session

import outbox
from outbox import cli, ops, store
from outbox.settings import libpq_url

DEST = "payments.charge"
PAN = "4111111111111111"
SAID = "customer says card 4111 1111 1111 1111 was charged"


def write(engine: Any, key: str) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=DEST, payload={}).id


def stored_text(services: Any, row_id: int) -> str:
    found = sql(
        services,
        "SELECT coalesce(last_error, ''), history::text FROM outbox_message WHERE id = %s",
        (row_id,),
    )
    return " ".join(found[0])


def no_pan(text: str) -> bool:
    return PAN not in re.sub(r"[^0-9]", "", text)


@pytest.fixture
def db(clean: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        yield conn


def test_cancel_reason_is_masked_in_last_error_and_history(clean: Any, engine: Any) -> None:
    row_id = write(engine, "order:1")
    assert cli.main(["cancel", str(row_id), "--database-url", clean.database_url, "--reason", SAID]) == 0
    stored = stored_text(clean, row_id)
    assert "cancelled" in sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row_id,))[0]
    assert no_pan(stored), stored
    assert "[card ****1111]" in stored


def test_replay_and_resolve_reasons_are_masked(clean: Any, engine: Any, db: Any) -> None:
    failed = write(engine, "order:2")
    declined = store.delivery.claim(db, row_id=failed, destination=DEST, lease_seconds=30)
    assert declined is not None
    assert store.delivery.record(
        db, row_id=failed, token=declined.token, state="failed", outcome="failed", error="card declined"
    ).state
    unknown = write(engine, "order:3")
    claimed = store.delivery.claim(db, row_id=unknown, destination=DEST, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=unknown, token=claimed.token, state="unknown", outcome="unknown"
    ).state
    with engine.begin() as conn:
        assert ops.replay(conn, [failed], by="test", reason=SAID)[0].done
        ops.resolve(conn, unknown, sent_ref="ch_1", by="test", reason=SAID)
    for row_id in (failed, unknown):
        stored = stored_text(clean, row_id)
        assert no_pan(stored), stored
        assert "[card ****1111]" in stored


def test_failover_accept_reason_is_masked(clean: Any) -> None:
    try:
        assert cli.main(["failover", "--database-url", clean.database_url, "--accept", "--reason", SAID]) == 0
        note = sql(clean, "SELECT note FROM outbox_db_identity")[0][0]
        assert no_pan(note) and "[card ****1111]" in note, note
    finally:
        sql(clean, "DELETE FROM outbox_db_identity")
