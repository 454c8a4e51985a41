"""``purge`` against real PostgreSQL."""

from __future__ import annotations

import uuid

from reconciler.jobs.purge import purge

from .support import (
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
    db.execute(
        "UPDATE outbox_message SET state = 'cancelled', completed_at = now() - interval '2 hours' "
        "WHERE id = %s",
        (ids[0],),
    )
    db.execute(
        "UPDATE outbox_message SET state = 'sent', provider_ref = 'x', completed_at = now() WHERE id = %s",
        (ids[1],),
    )
    db.execute(
        "UPDATE outbox_message SET state = 'failed', completed_at = now() - interval '2 hours' WHERE id = %s",
        (ids[2],),
    )

    assert purge(db, retention_seconds=3600, max_batches=2) == {"purged": 2000, "batches": 2}
    assert purge(db, retention_seconds=3600) == {"purged": 501, "batches": 1}
    assert purge(db, retention_seconds=3600) == {}
    left = db.execute("SELECT id, state FROM outbox_message ORDER BY id").fetchall()
    assert left == [(ids[1], "sent"), (ids[2], "failed"), (ids[3], "pending")]
    assert db.execute("SELECT count(*) FROM outbox_attempt").fetchone() == (0,)
