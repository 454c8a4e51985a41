"""``purge`` against real PostgreSQL."""

from __future__ import annotations

import uuid

from helpers import elapse
from sqlalchemy.orm import Session

import outbox
from outbox.reconciler.jobs.purge import purge

from .support import (
    settle,
    write_rows,
)

# -- 4. purge --------------------------------------------------------------------------------------


def test_purge_deletes_old_terminal_rows_in_bounded_batches(clean, engine, db):
    db.execute(
        """
        INSERT INTO outbox_message (key, step, destination, payload, state, provider_ref, completed_at)
        SELECT 'old:' || g, 'charge', 'payments.charge', '{}', 'sent', 'ch_' || g, now() - interval '2 hours'
        FROM generate_series(1, 2500) AS g
        """
    )
    old_sent = db.execute("SELECT min(id) FROM outbox_message").fetchone()[0]
    db.execute(
        "INSERT INTO outbox_attempt (message_id, attempt, claim_token) VALUES (%s, 1, %s)",
        (old_sent, uuid.uuid4()),
    )
    ids = write_rows(engine, 4)
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:0", step="charge")
    settle(db, ids[1], "sent", ref="x")
    settle(db, ids[2], "failed", error="card declined")
    elapse(db, 2 * 3600, [ids[0], ids[2]])

    assert purge(db, retention_seconds=3600, max_batches=2) == {"purged": 2000, "batches": 2}
    assert purge(db, retention_seconds=3600) == {"purged": 501, "batches": 1}
    assert purge(db, retention_seconds=3600) == {}
    left = db.execute("SELECT id, state FROM outbox_message ORDER BY id").fetchall()
    assert left == [(ids[1], "sent"), (ids[2], "failed"), (ids[3], "pending")]
    # The purged row's attempt row went with it; the kept rows' own claims remain.
    fenced = db.execute("SELECT message_id FROM outbox_attempt ORDER BY message_id").fetchall()
    assert fenced == [(ids[1],), (ids[2],)]
