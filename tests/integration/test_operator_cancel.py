"""`outbox cancel` (the operator's) takes a pending or dispatched row whose every call is known not
to have taken effect: after a failover lost a claim, or for a retired destination whose row got a
503 once (attack findings F1, F5). A call that may have taken effect still refuses; the
application's outbox.cancel keeps "only before any claim". Real PostgreSQL."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

import outbox
from outbox import ops, store
from outbox.cli import main
from outbox.settings import libpq_url

DEST = "payments.charge"

# (outcome, settled) of the one attempt row of each row, and whether the operator may cancel it.
CASES = [
    ("retry", None, True),
    ("failed", None, True),
    ("released", None, True),
    ("superseded:retry", None, True),
    ("unknown", "lookup_not_found", True),
    ("lease_expired", "operator_not_sent", True),
    ("unknown", None, False),
    ("lease_expired", None, False),
    (None, None, False),
    ("sent", "operator_forced", False),
    ("unknown", "operator_forced", False),
    ("unknown", "idempotent_retry", False),
    ("some_new_outcome", None, False),
]


def _rows(engine: Any, destination: str = DEST) -> list[int]:
    """One pending row per case, each claimed once before (its attempt row as in CASES): built
    directly, since some cases (an outcome a newer release adds) the product cannot reach."""
    ids = []
    with Session(engine) as s, s.begin():
        for i, (outcome, settled, _) in enumerate(CASES):
            row_id = outbox.write(
                s, key=f"order:{i}", step="charge", destination=destination, payload={"n": i}
            ).id
            s.execute(
                text(
                    "INSERT INTO outbox_attempt (message_id, attempt, claim_token, outcome, settled, "
                    "settled_at, finished_at) VALUES (:id, 1, gen_random_uuid(), :outcome, :settled, "
                    "CASE WHEN CAST(:settled AS text) IS NULL THEN NULL ELSE now() END, now())"
                ),
                {"id": row_id, "outcome": outcome, "settled": settled},
            )
            s.execute(text("UPDATE outbox_message SET attempts = 1 WHERE id = :id"), {"id": row_id})
            ids.append(row_id)
    return ids


def _states(engine: Any, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, state FROM outbox_message WHERE id = ANY(:ids)"), {"ids": ids})
        return {int(r.id): r.state for r in rows}


def test_operator_cancels_rows_whose_calls_are_known_not_to_have_taken_effect(clean, engine) -> None:
    ids = _rows(engine)
    with engine.begin() as conn:
        plan = ops.cancel_rows(conn, ids, reason="charged before the failover", by="alice")
    expected = {i for i, (_, _, ok) in zip(ids, CASES, strict=True) if ok}
    assert {r[0] for r in plan.rows} == expected
    assert {i for i, _ in plan.refused} == set(ids) - expected
    assert all("may have taken effect" in why for _, why in plan.refused)
    states = _states(engine, ids)
    assert {i for i, s in states.items() if s == "cancelled"} == expected
    assert {i for i, s in states.items() if s == "pending"} == set(ids) - expected


def test_the_application_cancel_still_refuses_a_claimed_row(clean, engine) -> None:
    ids = _rows(engine)
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="order:0", step="charge") is False  # a safe retry, still refused
    assert _states(engine, ids[:1]) == {ids[0]: "pending"}


@pytest.mark.parametrize("state", ["pending", "dispatched"])
def test_cli_cancel_by_id_of_a_row_with_a_safe_attempt(clean, engine, capsys, state) -> None:
    """F1: after a failover lost attempt 2, the row is pending again with attempt 1 (a 503)."""
    ids = _rows(engine)
    if state == "dispatched":
        # The relay takes the oldest due row first: ids[0].
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
            assert [r[0] for r in store.relay.dispatch_due(db, limit=1)] == [ids[0]]
    url = ["--database-url", clean.database_url]
    assert main(["cancel", str(ids[0]), "--reason", "provider has ch_1 for order:0 charge", *url]) == 0
    assert _states(engine, ids[:1]) == {ids[0]: "cancelled"}
    # A row whose call may have charged is refused, with why and what to look at.
    assert main(["cancel", str(ids[6]), "--reason", "r", *url]) == 1
    err = capsys.readouterr().err
    assert f"row {ids[6]} is pending but a call for it may have taken effect" in err
    assert f"outbox show {ids[6]}" in err
    assert _states(engine, ids[6:7]) == {ids[6]: "pending"}


def test_cli_cancel_of_a_retired_destination_previews_then_cancels(clean, engine, capsys) -> None:
    """F5: a retired destination's row that got one 503 is no longer stuck."""
    ids = _rows(engine, "payments.old")
    url = ["--database-url", clean.database_url]
    assert main(["cancel", "--destination", "payments.old", "--reason", "retired", *url]) == 0
    out = capsys.readouterr().out
    expected = [i for i, (_, _, ok) in zip(ids, CASES, strict=True) if ok]
    assert f"would cancel {len(expected)} row(s) of payments.old" in out
    assert _states(engine, ids) == dict.fromkeys(ids, "pending")
    flags = ["--yes", "--max-id", str(max(ids))]
    # Exit 1: the rows whose call may have charged are refused (and said so).
    assert main(["cancel", "--destination", "payments.old", "--reason", "retired", *flags, *url]) == 1
    states = _states(engine, ids)
    assert sorted(i for i, s in states.items() if s == "cancelled") == expected
