"""A new row's step holds no ':' (attack finding F6): outbox.write refuses it before the
database, and migration 0007's CHECK refuses it from a plain-SQL writer, while rows stored before
the migration keep their step and keep moving. Real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from databases import fresh_database
from psycopg import errors
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox.db import make_engine
from outbox.exceptions import InvalidMessage
from outbox.migrate import upgrade
from outbox.settings import libpq_url

CHECK = "outbox_message_step_colon_check"
INSERT = (
    "INSERT INTO outbox_message (key, step, destination, payload) VALUES (%s, %s, 'd', '{}') RETURNING id"
)


def test_write_refuses_a_colon_in_the_step_before_the_database(clean, engine) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidMessage, match="contains ':'"):
            outbox.write(s, key="order:1", step="refund:2", destination="payments.refund", payload={})
        # The colliding pair's other half is fine: its key keeps its colons.
        outbox.write(s, key="order:1:refund", step="2", destination="payments.refund", payload={})
    with engine.connect() as conn:
        assert conn.execute(text("SELECT key, step FROM outbox_message")).all() == [("order:1:refund", "2")]


@pytest.fixture
def at_0006(services) -> Iterator[Engine]:
    with fresh_database(services.database_url) as url:
        eng = make_engine(url)
        upgrade(eng, "0006")
        try:
            yield eng
        finally:
            eng.dispose()


def _libpq(engine: Engine) -> str:
    return libpq_url(engine.url.render_as_string(hide_password=False))


def test_the_database_refuses_a_new_colon_step_and_old_rows_keep_working(at_0006) -> None:
    with psycopg.connect(_libpq(at_0006), autocommit=True) as conn:
        # Stored by an earlier version, which allowed it.
        [(old,)] = conn.execute(INSERT, ("order:1", "refund:2")).fetchall()
        [(claimed,)] = conn.execute(INSERT, ("order:2", "refund:3")).fetchall()
    upgrade(at_0006)
    with psycopg.connect(_libpq(at_0006), autocommit=True) as conn:
        # Old rows keep moving (NOT VALID alone would check every later UPDATE of them). Plain
        # SQL on purpose: what is tested is the schema's CHECK on any UPDATE of a legacy row.
        conn.execute(
            "UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() WHERE id = %s", (old,)
        )
        conn.execute(
            "UPDATE outbox_message SET state = 'in_flight', claim_token = gen_random_uuid(), "
            "claimed_at = now(), lease_expires_at = now() + interval '1 minute' WHERE id = %s",
            (claimed,),
        )
        conn.execute(
            "UPDATE outbox_message SET state = 'sent', provider_ref = 're_1' WHERE id = %s", (claimed,)
        )
        # A new one from a plain-SQL writer is refused by name; without ':' it is accepted.
        with pytest.raises(errors.CheckViolation) as info:
            conn.execute(INSERT, ("order:3", "refund:4"))
        assert info.value.diag.constraint_name == CHECK
        conn.execute(INSERT, ("order:3:refund", "4"))
        states = dict(
            conn.execute("SELECT id, state FROM outbox_message WHERE id IN (%s, %s)", (old, claimed))
        )
        assert states == {old: "dispatched", claimed: "sent"}
    # The application can still name an old row, e.g. to cancel it.
    with Session(at_0006) as s, s.begin():
        assert outbox.cancel(s, key="order:1", step="refund:2") is True


def test_the_constraint_is_not_valid_and_goes_with_a_downgrade(at_0006) -> None:
    upgrade(at_0006)
    query = "SELECT convalidated FROM pg_constraint WHERE conname = %s"
    with psycopg.connect(_libpq(at_0006), autocommit=True) as conn:
        assert conn.execute(query, (CHECK,)).fetchall() == [(False,)]
    from alembic import command

    from outbox.migrate import alembic_config

    with at_0006.begin() as connection:
        command.downgrade(alembic_config(connection), "0006")
    with psycopg.connect(_libpq(at_0006), autocommit=True) as conn:
        assert conn.execute(query, (CHECK,)).fetchall() == []
        conn.execute(INSERT, ("order:9", "refund:9"))
