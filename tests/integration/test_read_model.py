"""Rows by destination and state (outbox.store.counts), the one read model behind ``outbox
status``, the dashboard's overview and the metrics, against real PostgreSQL: exact counts and
ages, the planner's estimates above a size (marked), and the three readers agreeing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql
from sqlalchemy.orm import Session

import outbox
from outbox import metrics, states, store
from outbox.dashboard import queries
from outbox.ops.inspect import status
from outbox.settings import libpq_url
from outbox.store.counts import AGE_STATES, Estimates, exact_sql, rows_by_destination

CHARGE, MAIL, LATER = "payments.charge", "mail.welcome", "crm.later"


def write(engine: Any, key: str, destination: str = CHARGE, available_at: datetime | None = None) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="send", destination=destination, payload={"n": 1}, available_at=available_at
        ).id


def settle(db: psycopg.Connection[Any], row_id: int, state: str) -> None:
    """The row claimed and recorded in ``state``, as a worker does."""
    [(destination,)] = db.execute(
        "SELECT destination FROM outbox_message WHERE id = %s", (row_id,)
    ).fetchall()
    claimed = store.delivery.claim(db, row_id=row_id, destination=destination, lease_seconds=60)
    assert claimed is not None
    if state == states.IN_FLIGHT:
        return
    ref = "ch_1" if state == states.SENT else None
    moved = store.delivery.record(
        db, row_id=row_id, token=claimed.token, state=state, outcome=state, error="x", ref=ref
    ).state
    assert moved == state


@pytest.fixture
def mixed(clean: Any, engine: Any, db: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    """Rows of both destinations in most states; the expected counts, by a plain GROUP BY."""
    charge = [write(engine, f"order:{i}") for i in range(7)]
    charge.append(write(engine, "order:7", available_at=datetime.now(UTC) + timedelta(minutes=10)))
    charge.append(write(engine, "order:8"))
    mail = [write(engine, f"user:{i}", MAIL) for i in range(3)]
    write(engine, "crm:1", LATER, available_at=datetime.now(UTC) + timedelta(minutes=10))
    for row_id, state in zip(charge, ["sent", "sent", "failed", "unknown", "in_flight"], strict=False):
        settle(db, row_id, state)
    settle(db, mail[0], "sent")
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:8", step="send")
    # Two pending rows due for a while, one of them longer; one (order:7) written for later.
    elapse(db, 300, [charge[5]])
    elapse(db, 120, [charge[6]])
    expected: dict[str, dict[str, int]] = {}
    for d, s, n in sql(clean, "SELECT destination, state, count(*) FROM outbox_message GROUP BY 1, 2"):
        expected.setdefault(d, dict.fromkeys(states.ALL, 0))[s] = n
    return expected


def test_exact_counts_every_state_and_the_oldest_rows_ages(
    mixed: dict[str, dict[str, int]], db: psycopg.Connection[Any], engine: Any
) -> None:
    with engine.connect() as conn:
        through_sqlalchemy = rows_by_destination(conn)
    through_psycopg = rows_by_destination(db)
    for counts in (through_sqlalchemy, through_psycopg):
        assert counts.by_destination == mixed
        assert list(counts.by_destination) == [LATER, MAIL, CHARGE]  # in order
        assert counts.estimated == set()
        assert counts.totals()["sent"] == 3 and counts.totals()["cancelled"] == 1
        # Pending from when it became due: the row written for later is not the oldest.
        assert 300 <= counts.age(CHARGE, "pending") < 360  # type: ignore[operator]
        assert counts.age(CHARGE, "unknown") is not None and counts.age(CHARGE, "in_flight") is not None
        assert counts.age(MAIL, "pending") is not None and counts.age(MAIL, "failed") is None
        # A pending row not yet due is counted, and has no age: nothing is late there.
        assert counts.by_destination[LATER]["pending"] == 1 and counts.age(LATER, "pending") is None


def test_the_states_asked_and_their_ages_only(mixed: dict[str, dict[str, int]], db: Any) -> None:
    waiting = rows_by_destination(db, asked=("failed", "pending"), ages=("pending",))
    assert waiting.by_destination == {
        d: {"pending": c["pending"], "failed": c["failed"]} for d, c in mixed.items()
    }
    assert set(waiting.ages) == {(CHARGE, "pending"), (MAIL, "pending"), (LATER, "pending")}
    settled = rows_by_destination(db, asked=("sent",), ages=())
    assert settled.by_destination == {CHARGE: {"sent": 2}, MAIL: {"sent": 1}} and settled.ages == {}
    with pytest.raises(ValueError, match="not row states"):
        exact_sql(("pending", "lost"))


def test_waiting_states_read_their_partial_indexes_and_settled_ones_one_scan(clean: Any) -> None:
    # On an empty, unanalysed table the planner would scan anyway: what is checked is the shape.
    waiting = exact_sql(store.counts.WAITING)
    assert waiting.count("UNION ALL") == 4 and "state = 'pending'" in waiting
    everything = exact_sql(states.ALL, AGE_STATES)
    assert "UNION" not in everything and "WHERE state IN" not in everything
    assert "GROUP BY 1, 2" in everything


def test_estimates_above_a_size_are_the_planners_and_marked(
    mixed: dict[str, dict[str, int]], clean: Any, db: Any
) -> None:
    sql(clean, "ANALYZE outbox_message")
    # Below the table size, exact: the same as without estimates.
    small = rows_by_destination(db, estimates=Estimates(table_rows=1_000, state_rows=1_000))
    assert small.by_destination == mixed and small.estimated == set()
    # Above it: the settled states estimated for every destination, the waiting ones counted.
    big = rows_by_destination(db, estimates=Estimates(table_rows=1, state_rows=1_000))
    assert big.estimated == {(d, s) for d in (CHARGE, MAIL, LATER) for s in ("sent", "cancelled")}
    for d, c in mixed.items():
        for s in store.counts.WAITING:
            assert big.by_destination[d][s] == c[s], (d, s)
        for s in store.counts.SETTLED:
            assert big.by_destination[d][s] >= 1  # the planner's, never 0
    assert big.is_estimate(None, "sent") and big.is_estimate(MAIL, "cancelled")
    assert not big.is_estimate(CHARGE, "pending")
    # A waiting state the planner puts above state_rows is estimated too.
    crowded = rows_by_destination(db, estimates=Estimates(table_rows=1, state_rows=0))
    assert (CHARGE, "pending") in crowded.estimated and (MAIL, "failed") in crowded.estimated


def test_status_the_dashboard_and_the_metrics_read_the_same_counts(
    mixed: dict[str, dict[str, int]], clean: Any, engine: Any
) -> None:
    options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
    with engine.connect().execution_options(**options) as conn, conn.begin():
        report = status(conn)
    with engine.connect() as conn:
        overview = queries.counts(conn)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        reading = metrics.read_database(conn)
    assert report.counts == mixed == overview.by_destination
    gauges = {k: v for k, v in reading.rows.items()}
    assert gauges == {
        (d, s): n for d, c in mixed.items() for s, n in c.items() if s in metrics.GAUGE_STATES and n
    }
    assert report.oldest_pending_age[CHARGE] == pytest.approx(reading.ages[(CHARGE, "pending")], abs=2)
    assert set(metrics.AGE_STATES) == {"pending", "dispatched", "in_flight", "unknown"}
