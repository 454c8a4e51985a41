"""The handlers of ``bench/chains.py``: three steps on three destinations, each a call to the
local provider. With ``BENCH_CHAINED=1`` each step declares the next with ``@then`` (a chain per
key, outbox.chains); without, the bench writes the three rows of a key itself (independent)."""

from __future__ import annotations

import itertools
import os

import outbox
from outbox import Confirmed, Delivery, Next

PROVIDER_URL = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8099")
STEPS = ("charge", "export", "notify")
DESTINATIONS = {step: f"bench.{step}" for step in STEPS}


def _call(d: Delivery) -> Confirmed:
    r = d.http.post(f"{PROVIDER_URL}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"])


HANDLERS = {
    step: outbox.handler(DESTINATIONS[step], time_limit=10, max_attempts=5, backoff=(1, 5, 30))(_call)
    for step in STEPS
}

if os.environ.get("BENCH_CHAINED") == "1":
    for before, after in itertools.pairwise(STEPS):

        def then(d: Delivery, c: Confirmed, after: str = after) -> list[Next]:
            return [
                Next(after, DESTINATIONS[after], {"amount_cents": d.payload["amount_cents"], "after": c.ref})
            ]

        HANDLERS[before].then(then)
