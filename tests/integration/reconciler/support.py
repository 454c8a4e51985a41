"""What the reconciler's job tests share: a charge handler on the provider simulator, rows
written through ``outbox.write``, and ways to read and age them."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
from helpers import elapse, lookup_on
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.handlers import Handler

DEST = "payments.charge"
MODULE = "tests.reconciler_handlers"
#: The charge handler's time_limit, and the lease of every claim in these tests.
TIME_LIMIT = 5
LEASE_SECONDS = 30

# -- helpers ---------------------------------------------------------------------------------------


def declare_charge(
    provider: Any,
    *,
    destination: str = DEST,
    lookup: bool = True,
    idempotent: bool = False,
    max_attempts: int = 3,
    lookup_calls: list[int] | None = None,
) -> Handler:
    @outbox.handler(
        destination, time_limit=TIME_LIMIT, max_attempts=max_attempts, backoff=(30, 60), idempotent=idempotent
    )
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})

    return lookup_on(charge, provider, keep_response=True, calls=lookup_calls) if lookup else charge


def write_rows(engine: Any, n: int, *, destination: str = DEST, start: int = 0, **kw: Any) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination=destination,
                payload={"amount_cents": 1000 + i, "currency": "EUR", "card_number": "4242424242424242"},
                **kw,
            ).id
            for i in range(start, start + n)
        ]


def charge_at_provider(provider: Any, key: str) -> str:
    """Make the provider hold a charge for `key`, as a call whose answer was lost would."""
    with httpx.Client() as client:
        r = client.post(f"{provider.url}/charges", json={"amount_cents": 1}, headers={"Idempotency-Key": key})
        r.raise_for_status()
        return str(r.json()["id"])


def get(db: psycopg.Connection[Any], row_id: int) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
    names = [c.name for c in cur.description or ()]
    found = cur.fetchone()
    assert found is not None, f"row {row_id} does not exist"
    return dict(zip(names, found, strict=True))


def fence_outcomes(db: psycopg.Connection[Any], row_id: int) -> list[str | None]:
    rows = db.execute("SELECT outcome FROM outbox_attempt WHERE message_id = %s ORDER BY id", (row_id,))
    return [r[0] for r in rows.fetchall()]


def make_unknown(db: psycopg.Connection[Any], row_id: int, destination: str = DEST) -> store.delivery.Claimed:
    """Claim the row and record an ambiguous outcome, as a consumer whose read timed out does."""
    claimed = store.delivery.claim(db, row_id=row_id, destination=destination, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="ReadTimeout"
    ).state
    return claimed


def expire_lease_now(db: psycopg.Connection[Any], row_id: int) -> None:
    """The claim's lease (``LEASE_SECONDS``) runs out."""
    elapse(db, LEASE_SECONDS + 1, [row_id])


def settle(
    db: psycopg.Connection[Any], row_id: int, state: str, *, ref: str | None = None, error: str | None = None
) -> None:
    """Claim the row and record a certain outcome (``sent`` or ``failed``), as a consumer does."""
    claimed = store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=LEASE_SECONDS)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state=state, outcome=state, ref=ref, error=error
    ).state
