"""The async twins outbox.write_async / outbox.cancel_async with AsyncSession and AsyncConnection
(SQLAlchemy asyncio on psycopg's async driver). They need greenlet, like any AsyncSession does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg.rows import dict_row
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine

import outbox
from outbox.settings import async_database_url, libpq_url

DESTINATION = "payments.charge"
PAYLOAD = {"amount_cents": 1000, "currency": "EUR", "meta": {"a": 1, "b": [1, 2]}}


@pytest_asyncio.fixture
async def async_engine(clean) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_database_url(clean.database_url))
    try:
        yield engine
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def session_tx(engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    async with AsyncSession(engine) as s:
        await s.begin()
        yield s


@contextlib.asynccontextmanager
async def connection_tx(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    async with engine.connect() as c:
        await c.begin()
        yield c


TARGETS = {"session": session_tx, "connection": connection_tx}


@pytest.fixture(params=sorted(TARGETS))
def open_tx(request: pytest.FixtureRequest) -> Callable[[AsyncEngine], Any]:
    return TARGETS[request.param]


def rows(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(libpq_url(url), autocommit=True, row_factory=dict_row) as conn:
        return conn.execute("SELECT * FROM outbox_message ORDER BY id").fetchall()


async def write(target: Any, key: str = "order:42", **changes: Any) -> outbox.Written:
    args: dict[str, Any] = {"key": key, "step": "charge", "destination": DESTINATION, "payload": PAYLOAD}
    args.update(changes)
    return await outbox.write_async(target, **args)


@pytest.mark.asyncio
async def test_write_async_does_not_commit(clean, async_engine, open_tx) -> None:
    async with open_tx(async_engine) as tx:
        written = await write(tx)
        assert written.created is True and written.id > 0
        assert rows(clean.database_url) == []
        await tx.commit()
    [row] = rows(clean.database_url)
    assert (row["id"], row["state"], row["attempts"], row["payload"]) == (written.id, "pending", 0, PAYLOAD)


@pytest.mark.asyncio
async def test_write_async_rollback_leaves_no_row(clean, async_engine, open_tx) -> None:
    async with open_tx(async_engine) as tx:
        assert (await write(tx)).created
        await tx.rollback()
    assert rows(clean.database_url) == []


@pytest.mark.asyncio
async def test_write_async_again_and_conflict(clean, async_engine, open_tx) -> None:
    deadline = datetime(2031, 1, 1, tzinfo=UTC)
    async with open_tx(async_engine) as tx:
        first = await write(tx, deadline=deadline)
        await tx.commit()
    async with open_tx(async_engine) as tx:
        reordered = {"meta": {"b": [1, 2], "a": 1}, "currency": "EUR", "amount_cents": 1000}
        assert await write(tx, payload=reordered, deadline=deadline) == outbox.Written(first.id, False)
        with pytest.raises(outbox.KeyConflict) as info:
            await write(tx, payload={**PAYLOAD, "amount_cents": 1})
        assert info.value.existing_id == first.id
        with pytest.raises(outbox.KeyConflict):
            await write(tx, destination="payments.refund")
        # Still usable.
        assert (await tx.execute(text("SELECT 1"))).scalar() == 1
        assert (await write(tx, key="order:43")).created
        await tx.commit()
    stored = rows(clean.database_url)
    assert [(r["key"], r["payload"]) for r in stored] == [("order:42", PAYLOAD), ("order:43", PAYLOAD)]
    assert stored[0]["deadline"] == deadline


@pytest.mark.asyncio
async def test_write_async_invalid_input_leaves_the_transaction_usable(clean, async_engine, open_tx) -> None:
    async with open_tx(async_engine) as tx:
        await write(tx, key="order:1")
        for change in (
            {"payload": {"at": datetime.now(UTC)}},
            {"payload": {"x": float("nan")}},
            {"destination": "a b"},
            {"key": " "},
            {"available_at": datetime(2030, 1, 1)},
        ):
            with pytest.raises(outbox.InvalidMessage):
                await write(tx, **{"key": "order:2", **change})
        assert (await write(tx, key="order:3")).created
        await tx.commit()
    assert [r["key"] for r in rows(clean.database_url)] == ["order:1", "order:3"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("state", "cancelled"), [("pending", True), ("dispatched", True), ("in_flight", False)]
)
async def test_cancel_async(clean, async_engine, open_tx, state, cancelled) -> None:
    async with open_tx(async_engine) as tx:
        await write(tx)
        await tx.commit()
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        # A state the product cannot reach (a claim token on a row never claimed): cancel must
        # still clear it, and refuse an in_flight row by its state alone.
        conn.execute(
            "UPDATE outbox_message SET state = %s, claim_token = gen_random_uuid(), "
            "lease_expires_at = now() + interval '1 minute'",
            (state,),
        )
    [before] = rows(clean.database_url)
    async with open_tx(async_engine) as tx:
        assert await outbox.cancel_async(tx, key="order:42", step="charge") is cancelled
        assert await outbox.cancel_async(tx, key="order:404", step="charge") is False
        assert rows(clean.database_url) == [before]  # not committed by cancel
        await tx.commit()
    [after] = rows(clean.database_url)
    if cancelled:
        assert after["state"] == "cancelled" and after["completed_at"] is not None
        assert after["claim_token"] is None
    else:
        assert after == before


@pytest.mark.asyncio
async def test_write_async_on_a_database_that_is_not_migrated(empty_database_url) -> None:
    url = empty_database_url
    engine = create_async_engine(async_database_url(url))
    try:
        for open_ in (session_tx, connection_tx):
            async with open_(engine) as tx:
                with pytest.raises(outbox.NotMigrated, match="outbox migrate"):
                    await write(tx)
                with pytest.raises(outbox.NotMigrated, match="outbox migrate"):
                    await outbox.cancel_async(tx, key="order:42", step="charge")
                assert (await tx.execute(text("SELECT 1"))).scalar() == 1
                await tx.commit()
    finally:
        await engine.dispose()
