"""The demo's chain: an invoice is issued, then its customer notified, each step a
call to the payment provider simulator (which does NOT deduplicate: a second call would be a
second effect). Loaded by the chain phase's workers (``outbox worker outbox.demo.invoicing``)
and by its ``outbox repair``. Names of the demo's own, like its charge destination.
"""

from __future__ import annotations

import os

import outbox
from outbox import Confirmed, Delivery, Next

from .base import CHAIN_ISSUE, CHAIN_NOTIFY


def provider_url() -> str:
    # As outbox.demo.handlers reads it; not imported from there, which would declare the charge.
    return os.environ.get("SHOP_PROVIDER_URL", "http://127.0.0.1:8099")


#: Short timings, like the charge's: a killed worker's claim is taken over within seconds.
TIME_LIMIT_SECONDS = 2.0
LEASE_SECONDS = 3.0


def _post(d: Delivery) -> Confirmed:
    r = d.http.post(
        f"{provider_url()}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
    )
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"])


def _find(d: Delivery) -> Confirmed | None:
    r = d.http.get(f"{provider_url()}/charges", params={"idempotency_key": d.idempotency_key})
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"])


@outbox.handler(
    CHAIN_ISSUE,
    time_limit=TIME_LIMIT_SECONDS,
    lease_seconds=LEASE_SECONDS,
    max_attempts=5,
    backoff=(0.5, 1, 2),
)
def issue(d: Delivery) -> Confirmed:
    return _post(d)


@outbox.handler(
    CHAIN_NOTIFY,
    time_limit=TIME_LIMIT_SECONDS,
    lease_seconds=LEASE_SECONDS,
    max_attempts=5,
    backoff=(0.5, 1, 2),
)
def notify(d: Delivery) -> Confirmed:
    return _post(d)


issue.lookup(_find)
notify.lookup(_find)


@issue.then
def then_notify(d: Delivery, c: Confirmed) -> list[Next]:
    return [Next("notify", CHAIN_NOTIFY, {"invoice": d.payload["invoice"], "issued": c.ref})]
