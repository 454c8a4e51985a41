"""outbox.write / outbox.cancel inside the caller's own transaction, against a real PostgreSQL."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from databases import fresh_database
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.db import make_engine
from outbox.settings import libpq_url

DESTINATION = "payments.charge"
PAYLOAD = {"amount_cents": 1000, "currency": "EUR", "lines": [{"sku": "A", "qty": 2}]}


# -- helpers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def session_tx(engine: Engine) -> Iterator[Session]:
    """A Session with an open transaction that the test commits or rolls back itself."""
    with Session(engine) as s:
        s.begin()
        yield s


@contextlib.contextmanager
def connection_tx(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as c:
        c.begin()
        yield c


TARGETS = {"session": session_tx, "connection": connection_tx}


@pytest.fixture(params=sorted(TARGETS))
def open_tx(request: pytest.FixtureRequest, engine: Engine) -> Callable[[], Any]:
    factory = TARGETS[request.param]
    return lambda: factory(engine)


def observe(url: str) -> psycopg.Connection[Any]:
    """A second, independent connection that sees only committed rows."""
    return psycopg.connect(libpq_url(url), autocommit=True, row_factory=dict_row)


def rows(url: str, where: str = "true", params: Any = ()) -> list[dict[str, Any]]:
    with observe(url) as conn:
        return conn.execute(f"SELECT * FROM outbox_message WHERE {where} ORDER BY id", params).fetchall()


def write(target: Any, key: str = "order:42", **changes: Any) -> outbox.Written:
    args: dict[str, Any] = {"key": key, "step": "charge", "destination": DESTINATION, "payload": PAYLOAD}
    args.update(changes)
    return outbox.write(target, **args)


@contextlib.contextmanager
def count_statements(target: Session | Connection) -> Iterator[list[str]]:
    engine = target.get_bind().engine if isinstance(target, Session) else target.engine
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


# -- write ---------------------------------------------------------------------------------------


def test_write_returns_written_and_never_commits(clean, open_tx) -> None:
    with open_tx() as tx:
        written = write(tx)
        assert isinstance(written, outbox.Written)
        assert written.created is True
        assert isinstance(written.id, int) and written.id > 0
        # Visible in the caller's transaction, invisible to everyone else until it commits.
        assert tx.execute(text("SELECT count(*) FROM outbox_message")).scalar() == 1
        assert rows(clean.database_url) == []
        tx.commit()
    [row] = rows(clean.database_url)
    assert row["id"] == written.id
    assert (row["key"], row["step"], row["destination"]) == ("order:42", "charge", DESTINATION)
    assert row["payload"] == PAYLOAD
    assert row["state"] == "pending"
    assert row["attempts"] == 0
    assert row["deadline"] is None
    assert abs(row["available_at"] - row["created_at"]) < timedelta(seconds=1)
    assert abs(row["created_at"] - datetime.now(UTC)) < timedelta(minutes=1)


def test_rollback_leaves_no_row(clean, open_tx) -> None:
    with open_tx() as tx:
        assert write(tx).created
        tx.rollback()
    assert rows(clean.database_url) == []


def test_business_row_and_outbox_row_commit_together(clean, engine) -> None:
    with Session(engine) as s, s.begin():
        s.execute(text("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text)"))
    for commit in (False, True):
        with session_tx(engine) as s:
            order_id = s.execute(text("INSERT INTO orders (customer) VALUES ('ada') RETURNING id")).scalar()
            write(s, key=f"order:{order_id}")
            s.commit() if commit else s.rollback()
    with observe(clean.database_url) as conn:
        orders = [r["id"] for r in conn.execute("SELECT id FROM orders").fetchall()]
    assert [r["key"] for r in rows(clean.database_url)] == [f"order:{i}" for i in orders]
    assert len(orders) == 1


def test_times_are_stored(clean, engine) -> None:
    available_at = datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone(timedelta(hours=2)))
    deadline = datetime(2031, 5, 7, tzinfo=UTC)
    with session_tx(engine) as s:
        write(s, available_at=available_at, deadline=deadline)
        s.commit()
    [row] = rows(clean.database_url)
    assert row["available_at"] == available_at
    assert row["deadline"] == deadline


def test_payload_round_trips_exactly(clean, engine) -> None:
    payload = {
        "text": "é€😀 \\u0000 is not a NUL",
        "int": 2**62,
        "float": 0.1,
        "nested": {"list": [True, False, None, [], {}]},
    }
    with connection_tx(engine) as c:
        write(c, payload=payload)
        c.commit()
    [row] = rows(clean.database_url)
    assert row["payload"] == payload


def test_payload_at_the_size_limit_is_stored(clean, engine) -> None:
    payload = {"d": "x" * (256 * 1024 - len('{"d":""}'))}
    with connection_tx(engine) as c:
        write(c, payload=payload)
        c.commit()
    with observe(clean.database_url) as conn:
        assert conn.execute("SELECT length(payload->>'d') AS n FROM outbox_message").fetchone()["n"] == len(
            payload["d"]
        )


def test_same_write_again_is_a_no_op(clean, open_tx) -> None:
    with open_tx() as tx:
        first = write(tx)
        # Same transaction.
        assert write(tx) == outbox.Written(first.id, False)
        tx.commit()
    with open_tx() as tx:
        # Later transaction; the payload's keys in another order (also nested) are the same payload.
        reordered = {"lines": [{"qty": 2, "sku": "A"}], "currency": "EUR", "amount_cents": 1000}
        assert list(reordered) != list(PAYLOAD)
        assert write(tx, payload=reordered) == outbox.Written(first.id, False)
        tx.commit()
    assert [r["id"] for r in rows(clean.database_url)] == [first.id]


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {**PAYLOAD, "amount_cents": 1001}},
        {"payload": {"amount_cents": 1000, "currency": "EUR"}},
        {"payload": {**PAYLOAD, "lines": [{"sku": "A", "qty": 3}]}},
        {"destination": "payments.refund"},
    ],
    ids=["amount", "missing-field", "nested", "destination"],
)
def test_different_payload_or_destination_is_a_conflict(clean, open_tx, change) -> None:
    with open_tx() as tx:
        first = write(tx)
        tx.commit()
    with open_tx() as tx:
        tx.execute(text("SELECT 1"))
        with pytest.raises(outbox.KeyConflict, match="order:42:charge already exists") as info:
            write(tx, **change)
        assert isinstance(info.value, outbox.OutboxError)
        assert (info.value.key, info.value.step, info.value.existing_id) == ("order:42", "charge", first.id)
        # The caller's transaction is still usable.
        other = write(tx, key="order:43")
        assert other.created and tx.execute(text("SELECT 2")).scalar() == 2
        tx.commit()
    stored = rows(clean.database_url)
    assert [(r["key"], r["destination"], r["payload"]) for r in stored] == [
        ("order:42", DESTINATION, PAYLOAD),
        ("order:43", DESTINATION, PAYLOAD),
    ]


def test_the_same_key_with_another_step_is_another_row(clean, engine) -> None:
    with session_tx(engine) as s:
        charge = write(s, step="charge")
        receipt = write(s, step="receipt", destination="mail.receipt", payload={"to": "a@example.com"})
        s.commit()
    assert charge.created and receipt.created and charge.id != receipt.id


INVALID: list[dict[str, Any]] = [
    {"payload": [1, 2]},
    {"payload": {"at": datetime.now(UTC)}},
    {"payload": {"tags": {"a"}}},
    {"payload": {"amount": Decimal("1.00")}},
    {"payload": {"pair": (1, 2)}},
    {"payload": {"x": math.nan}},
    {"payload": {"x": math.inf}},
    {"payload": {1: "x"}},
    {"payload": {"a": [{"b": {"c": datetime.now(UTC)}}]}},
    {"payload": {"d": "x" * (256 * 1024)}},
    {"payload": {"d": "x" * 100}, "max_payload_bytes": 50},
    {"payload": {"a": "\x00"}},
    {"key": ""},
    {"key": "   "},
    {"step": ""},
    {"key": "k" * 249, "step": "charge"},
    {"destination": "1payments"},
    {"destination": "payments charge"},
    {"destination": "payments/charge"},
    {"destination": ""},
    {"destination": None},
    {"available_at": datetime(2030, 1, 1)},
    {"deadline": datetime(2030, 1, 1)},
    {"deadline": "2030-01-01T00:00:00Z"},
]


def test_invalid_input_sends_nothing_and_leaves_the_transaction_usable(clean, open_tx) -> None:
    with open_tx() as tx:
        write(tx, key="order:1")
        for change in INVALID:
            with count_statements(tx) as statements, pytest.raises(outbox.InvalidMessage):
                write(tx, **{"key": "order:2", **change})
            assert statements == [], change
        assert tx.execute(text("SELECT 1")).scalar() == 1
        write(tx, key="order:3")
        tx.commit()
    assert [r["key"] for r in rows(clean.database_url)] == ["order:1", "order:3"]


def test_not_migrated_database(services) -> None:
    with fresh_database(services.database_url, "outbox_empty") as url:
        engine = make_engine(url)
        try:
            for open_ in (session_tx, connection_tx):
                with open_(engine) as tx:
                    tx.execute(text("CREATE TABLE business (id int)"))
                    with pytest.raises(outbox.NotMigrated, match="outbox migrate") as info:
                        write(tx)
                    assert isinstance(info.value, outbox.OutboxError)
                    with pytest.raises(outbox.NotMigrated, match="outbox migrate"):
                        outbox.cancel(tx, key="order:42", step="charge")
                    # Still usable: the check did not abort the transaction.
                    tx.execute(text("INSERT INTO business VALUES (1)"))
                    tx.commit()
                with engine.begin() as c:
                    assert c.execute(text("SELECT count(*) FROM business")).scalar() == 1
                    c.execute(text("DROP TABLE business"))
        finally:
            engine.dispose()


def test_row_inserted_by_plain_sql_gets_defaults(clean) -> None:
    with observe(clean.database_url) as conn:
        conn.execute(
            "INSERT INTO outbox_message (key, step, destination, payload) VALUES (%s, %s, %s, %s)",
            ("invoice:7", "export", "erp.export", '{"n": 7}'),
        )
    [row] = rows(clean.database_url)
    assert row["state"] == "pending"
    assert row["attempts"] == 0
    assert row["available_at"] is not None and row["created_at"] is not None
    assert abs(row["available_at"] - datetime.now(UTC)) < timedelta(minutes=1)
    assert row["deadline"] is None and row["claim_token"] is None and row["provider_ref"] is None


# -- concurrent writers --------------------------------------------------------------------------


def wait_for_lock_wait(url: str, timeout: float = 10.0) -> None:
    """Until some backend of this database waits on a lock while inserting an outbox row."""
    deadline = time.monotonic() + timeout
    with observe(url) as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO outbox_message%'"
            ).fetchone()["n"]
            if waiting:
                return
            time.sleep(0.01)
    raise AssertionError("the second writer never waited for the first")


@pytest.mark.parametrize(
    ("first_commits", "second_payload", "expected"),
    [
        (True, PAYLOAD, "same-id"),
        (True, {"amount_cents": 5}, "conflict"),
        (False, PAYLOAD, "created"),
        (False, {"amount_cents": 5}, "created"),
    ],
    ids=["commit-same", "commit-different", "rollback-same", "rollback-different"],
)
def test_concurrent_writers_of_the_same_key(clean, engine, first_commits, second_payload, expected) -> None:
    outcome: dict[str, Any] = {}

    def second() -> None:
        with engine.connect() as c:
            c.begin()
            try:
                outcome["written"] = write(c, payload=second_payload)
            except outbox.KeyConflict as exc:
                outcome["conflict"] = exc
            # Either way the transaction is usable and commits.
            outcome["usable"] = c.execute(text("SELECT 1")).scalar()
            c.commit()

    with engine.connect() as first_conn:
        first_conn.begin()
        first = write(first_conn)
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        wait_for_lock_wait(clean.database_url)
        time.sleep(0.05)
        assert thread.is_alive() and not outcome, "the second writer must block until the first ends"
        first_conn.commit() if first_commits else first_conn.rollback()
        thread.join(10)
    assert not thread.is_alive()
    assert outcome["usable"] == 1
    stored = rows(clean.database_url)
    assert len(stored) == 1
    if expected == "same-id":
        assert outcome["written"] == outbox.Written(first.id, False)
    elif expected == "conflict":
        assert outcome["conflict"].existing_id == first.id
        assert stored[0]["payload"] == PAYLOAD
    else:
        assert outcome["written"].created is True
        assert outcome["written"].id == stored[0]["id"] != first.id
        assert stored[0]["payload"] == second_payload


# -- cancel --------------------------------------------------------------------------------------


def written_in_state(url: str, engine: Engine, state: str) -> int:
    """A row taken to ``state`` by the product's own moves: the relay's, a consumer's claim and
    record, the application's cancel."""
    with connection_tx(engine) as c:
        row_id = write(c).id
        c.commit()
    if state == "cancelled":
        with session_tx(engine) as s:
            assert outbox.cancel(s, key="order:42", step="charge")
            s.commit()
        return row_id
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        if state == "pending":
            return row_id
        assert [r[0] for r in store.relay.dispatch_due(conn, limit=1)] == [row_id]
        if state == "dispatched":
            return row_id
        claimed = store.delivery.claim(conn, row_id=row_id, destination=DESTINATION, lease_seconds=60)
        assert claimed is not None
        if state == "in_flight":
            return row_id
        outcome = {"sent": {"ref": "ch_1"}, "failed": {"error": "card declined"}}.get(state, {})
        assert store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state=state, outcome=state, **outcome
        ).state
    return row_id


@pytest.mark.parametrize("state", ["pending", "dispatched"])
def test_cancel_before_any_claim(clean, engine, open_tx, state) -> None:
    row_id = written_in_state(clean.database_url, engine, state)
    with open_tx() as tx:
        assert outbox.cancel(tx, key="order:42", step="charge") is True
        # Not committed by cancel.
        assert rows(clean.database_url)[0]["state"] == state
        # A second cancel in the same transaction finds nothing left to cancel.
        assert outbox.cancel(tx, key="order:42", step="charge") is False
        tx.commit()
    [row] = rows(clean.database_url)
    assert (row["id"], row["state"]) == (row_id, "cancelled")
    assert row["completed_at"] is not None


def test_cancel_rolled_back_leaves_the_row_pending(clean, engine) -> None:
    written_in_state(clean.database_url, engine, "pending")
    with session_tx(engine) as s:
        assert outbox.cancel(s, key="order:42", step="charge") is True
        s.rollback()
    assert rows(clean.database_url)[0]["state"] == "pending"


@pytest.mark.parametrize("state", ["in_flight", "unknown", "sent", "failed", "cancelled"])
def test_cancel_after_a_claim_or_at_the_end_changes_nothing(clean, engine, open_tx, state) -> None:
    written_in_state(clean.database_url, engine, state)
    [before] = rows(clean.database_url)
    with open_tx() as tx:
        assert outbox.cancel(tx, key="order:42", step="charge") is False
        tx.commit()
    [after] = rows(clean.database_url)
    assert after == before


def test_cancel_unknown_key(clean, engine, open_tx) -> None:
    written_in_state(clean.database_url, engine, "pending")
    with open_tx() as tx:
        assert outbox.cancel(tx, key="order:404", step="charge") is False
        assert outbox.cancel(tx, key="order:42", step="refund") is False
        tx.commit()
    assert rows(clean.database_url)[0]["state"] == "pending"
