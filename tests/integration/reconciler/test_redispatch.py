"""``redispatch`` against real PostgreSQL and Redis, and a Redis flush under 5,000 dispatched
rows."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import psycopg
import pytest
from helpers import elapse, relay_once, worker_thread

from outbox import transport
from outbox.handlers import registry
from outbox.reconciler.jobs.redispatch import redispatch
from outbox.schema import NOTIFY_CHANNEL
from outbox.settings import libpq_url

from .support import (
    DEST,
    declare_charge,
    get,
    write_rows,
)

# -- 3. redispatch ---------------------------------------------------------------------------------


def test_redispatch_requeues_lost_messages_and_leaves_waiting_ones_whatever_their_age(
    clean, engine, db, provider, redis_client, caplog
):
    declare_charge(provider)
    ids = write_rows(engine, 4)
    ids += write_rows(engine, 1, destination="ghost.dest", start=4)
    assert relay_once(clean) == 5
    # Forget what the relay published; publish again exactly the messages this test wants.
    redis_client.delete(*redis_client.keys(f"{clean.namespace}:*"))
    ages = {ids[0]: 60, ids[1]: 600, ids[2]: 60, ids[3]: 0, ids[4]: 60}
    for row_id, age in ages.items():
        elapse(db, age, [row_id])
    at = {r: get(db, r)["dispatched_at"] for r in ids}
    # Row 0: lost. Row 1: still in its queue, unclaimed for 10 min (issue 9 class 7: a message
    # waiting in its queue is never re-published, whatever its age). Row 2: waiting in a long queue.
    # Row 3: lost but dispatched just now (within the grace). Row 4: lost, and this module has no
    # handler for ghost.dest (a newer deploy's destination, say): re-queued like any other.
    transport.publish_rows(redis_client, clean.namespace, [(r, DEST, at[r]) for r in (ids[1], ids[2])])
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        counts = redispatch(
            db,
            redis_client,
            registry(),
            namespace=clean.namespace,
            redispatch_after_seconds=300,
            module="shop.handlers",
        )
        notified = list(listener.notifies(timeout=2, stop_after=1))

    assert counts == {"missing": 2, "waiting": 2, "no_handler": 1}
    assert len(notified) == 1
    for row_id in (ids[0], ids[4]):
        r = get(db, row_id)
        assert (r["state"], r["dispatched_at"]) == ("pending", None)
        assert r["available_at"] <= datetime.now(UTC)
    for row_id in (ids[1], ids[2]):
        assert get(db, row_id)["state"] == "dispatched" and get(db, row_id)["dispatched_at"] == at[row_id]
    assert get(db, ids[3])["state"] == "dispatched"
    assert "no handler in shop.handlers" in caplog.text and "ghost.dest" in caplog.text

    # Republished by the relay, the requeued rows are fresh messages waiting in their queue; once
    # the grace is over, row 3's lost message is requeued like any other.
    assert relay_once(clean) == 2
    again = redispatch(
        db, redis_client, registry(), namespace=clean.namespace, redispatch_after_seconds=300, grace_seconds=0
    )
    assert again == {"waiting": 4, "missing": 1, "no_handler": 1}
    assert get(db, ids[4])["state"] == "dispatched", "a row of another module's destination is never failed"
    assert get(db, ids[3])["state"] == "pending"


def test_an_unreachable_redis_never_means_the_message_is_gone(
    clean, engine, db, provider, reconcilers, caplog
):
    declare_charge(provider)
    (row_id,) = write_rows(engine, 1)
    assert relay_once(clean) == 1
    elapse(db, 3600, [row_id])
    reconciler = reconcilers(redis_url="redis://127.0.0.1:1/11")
    with caplog.at_level(logging.ERROR, logger="outbox.reconciler"):
        result = reconciler.run_once()
    assert result["redispatch"] == {"error": 1}
    assert result["expire_leases"] == {} and result["purge"] == {}  # the other jobs ran
    assert get(db, row_id)["state"] == "dispatched"
    assert "reconciler job redispatch failed: ConnectionError" in caplog.text


# -- Redis flushed under 5,000 dispatched rows -----------------------------------------------------


@pytest.mark.stress
@pytest.mark.timeout(90)
def test_redis_flushed_under_5000_dispatched_rows_loses_nothing_and_charges_once(
    clean, engine, db, provider, redis_client, reconcilers
):
    n = 5000
    declare_charge(provider)
    write_rows(engine, n)
    assert relay_once(clean) == n
    # Every queued message lost; the database OUTBOX_TEST_REDIS_URL names may hold others' keys.
    transport.delete_namespace(redis_client, clean.namespace)
    # The flush happened a while after the dispatch: past the grace, well within redispatch_after.
    elapse(db, 60)

    assert reconcilers().run_job("redispatch") == {"missing": n}
    assert db.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall() == [("pending", n)]
    assert relay_once(clean) == n

    with worker_thread(clean, threads=8):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sent = db.execute("SELECT count(*) FROM outbox_message WHERE state = 'sent'").fetchone()[0]
            if sent == n:
                break
            time.sleep(0.2)
    assert db.execute("SELECT state, count(*) FROM outbox_message GROUP BY 1").fetchall() == [("sent", n)]
    stats = provider.stats()
    assert stats["charges"] == n and stats["double_charged"] == []
    assert len(stats["effects"]) == n and set(stats["effects"].values()) == {1}
    assert db.execute("SELECT count(*), count(DISTINCT message_id) FROM outbox_attempt").fetchone() == (n, n)
    # Nothing left for the reconciler: every message was consumed and acked.
    assert reconcilers().run_job("redispatch") == {}
