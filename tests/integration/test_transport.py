"""Issue 9 class 6, second half: a destination whose publication Redis refuses never holds
back the rest of a relay batch. Real PostgreSQL, real Redis, a key of the broken destination
created with the wrong type by "somebody else"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from helpers import elapse
from sqlalchemy.orm import Session

import outbox
from outbox.relay import Relay
from outbox.relay.relay import PUBLISH_RETRY_SECONDS
from outbox.settings import libpq_url

GOOD = "payments.charge"
BROKEN = "mail.send"


@pytest.fixture
def db(clean: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        yield conn


def write_interleaved(engine: Any, n: int) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {GOOD: [], BROKEN: []}
    with Session(engine) as s, s.begin():
        for i in range(n):
            for destination in (BROKEN, GOOD):  # the broken destination's rows come first
                written = outbox.write(s, key=f"k:{i}", step=destination, destination=destination, payload={})
                ids[destination].append(written.id)
    return ids


def states(db: psycopg.Connection[Any], ids: list[int]) -> set[str]:
    return {r[0] for r in db.execute("SELECT state FROM outbox_message WHERE id = ANY(%s)", (ids,))}


def queued(client: Any, namespace: str, destination: str) -> list[str]:
    return [m.decode() for m in client.lrange(f"{namespace}:{destination}", 0, -1)]


def make_relay(clean: Any, **kw: Any) -> Relay:
    return Relay(database_url=clean.database_url, redis_url=clean.redis_url, namespace=clean.namespace, **kw)


@pytest.mark.parametrize("wrong", ["queue", "hash"])
def test_a_refused_destination_leaves_its_rows_pending_and_the_others_are_published(
    clean, engine, db, redis_client, caplog, wrong
):
    ns = clean.namespace
    ids = write_interleaved(engine, 5)
    # A key of the broken destination with a type Dramatiq does not give it: the RPUSH (queue)
    # or the HSET (hash) of its messages fails with WRONGTYPE, the other command succeeds.
    if wrong == "queue":
        redis_client.hset(f"{ns}:{BROKEN}", "somebody", "else")
    else:
        redis_client.rpush(f"{ns}:{BROKEN}.msgs", "somebody-else")
    relay = make_relay(clean)
    try:
        with caplog.at_level(logging.ERROR, logger="relay"):
            result = relay.run_once()
            # Due again (as if the retry delay had passed): refused again, not logged again.
            elapse(db, PUBLISH_RETRY_SECONDS)
            again = relay.run_once()
    finally:
        relay.close()

    assert result.published == 5 and dict(result.by_destination) == {GOOD: 5}
    assert dict(result.refused) == {BROKEN: 5}
    assert again.published == 0 and dict(again.refused) == {BROKEN: 5}
    assert states(db, ids[GOOD]) == {"dispatched"}
    assert states(db, ids[BROKEN]) == {"pending"}
    later = db.execute(
        "SELECT bool_and(available_at > now()) , bool_and(dispatched_at IS NULL) FROM outbox_message "
        "WHERE id = ANY(%s)",
        (ids[BROKEN],),
    ).fetchone()
    assert later == (True, True), "refused rows wait before the next try, so they do not head every batch"
    # The good destination's messages are all queued, with their bodies.
    good = queued(redis_client, ns, GOOD)
    assert len(good) == 5 and redis_client.hlen(f"{ns}:{GOOD}.msgs") == 5
    # Nothing of the refused destination's half-done commands stays behind.
    if wrong == "queue":
        assert redis_client.hgetall(f"{ns}:{BROKEN}.msgs") == {}
        assert redis_client.hgetall(f"{ns}:{BROKEN}") == {b"somebody": b"else"}
    else:
        assert queued(redis_client, ns, BROKEN) == []
        assert redis_client.lrange(f"{ns}:{BROKEN}.msgs", 0, -1) == [b"somebody-else"]
    lines = [r for r in caplog.records if "cannot publish to destination mail.send" in r.getMessage()]
    assert len(lines) == 1, "one line per destination per minute, not one per batch"
    assert "WRONGTYPE" in lines[0].getMessage()


def test_a_batch_full_of_refused_rows_does_not_starve_the_others(clean, engine, db, redis_client):
    ns = clean.namespace
    ids = write_interleaved(engine, 6)
    # The broken destination's rows are the oldest due: every batch would start with them.
    elapse(db, 3600, ids[BROKEN])
    redis_client.set(f"{ns}:{BROKEN}", "a cache entry")
    relay = make_relay(clean, batch_size=4, parallel=1)
    try:
        published = relay.drain()
    finally:
        relay.close()
    assert published == 6
    assert states(db, ids[GOOD]) == {"dispatched"}
    assert states(db, ids[BROKEN]) == {"pending"}
    assert len(queued(redis_client, ns, GOOD)) == 6
    assert db.execute(
        "SELECT min(available_at) > %s FROM outbox_message WHERE state = 'pending'", (datetime.now(UTC),)
    ).fetchone() == (True,)
