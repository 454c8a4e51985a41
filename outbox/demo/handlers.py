"""Handlers of the example shop: charge a card through the payment provider, and find a charge.

They live in the package, not in ``examples/``, so that ``outbox demo`` runs from an install;
``examples/shop/handlers.py`` re-exports them under the name the docs and docker compose use.
``SHOP_ASYNC=1`` declares their ``async def`` twins instead. Run them with
``outbox worker examples.shop.handlers`` (``outbox.demo.handlers`` from an install). The
provider's address comes from ``SHOP_PROVIDER_URL`` (the demo and the tests start a simulator on
127.0.0.1). The destination is ``payments.charge`` unless ``SHOP_DESTINATION`` says
otherwise: ``outbox demo`` uses a name of its own so that its rows can never reach the handlers
of a real deployment sharing the database.
"""

from __future__ import annotations

import os

import httpx

import outbox
from outbox import Confirmed, Delivery, PermanentError


def provider_url() -> str:
    return os.environ.get("SHOP_PROVIDER_URL", "http://127.0.0.1:8099")


def _time_limit() -> float:
    return float(os.environ.get("SHOP_TIME_LIMIT", "10"))


def _lease_seconds() -> float | None:
    # Tests and the demo shorten the lease so that a killed worker's row is taken over quickly.
    raw = os.environ.get("SHOP_LEASE_SECONDS")
    return float(raw) if raw else None


def _breaker() -> outbox.Breaker | None:
    # "failures,window_seconds,open_seconds,max_open_seconds", or "off"; unset: the default.
    raw = os.environ.get("SHOP_BREAKER", "").strip()
    if not raw:
        return outbox.Breaker()
    if raw == "off":
        return None
    failures, window, opened, most = (float(x) for x in raw.split(","))
    return outbox.Breaker(
        failures=int(failures), window_seconds=window, open_seconds=opened, max_open_seconds=most
    )


#: Must match what outbox/demo/shop.py writes (it reads the same variable).
DESTINATION = os.environ.get("SHOP_DESTINATION", "payments.charge")


def _charge(d: Delivery) -> Confirmed:
    # The Idempotency-Key comes from the business operation, never from the attempt number.
    r = d.http.post(
        f"{provider_url()}/charges",
        json=d.payload,
        headers={"Idempotency-Key": d.idempotency_key},
    )
    return _confirmed(r)


def _find_charge(d: Delivery) -> Confirmed | None:
    r = d.http.get(f"{provider_url()}/charges", params={"idempotency_key": d.idempotency_key})
    return None if r.status_code == 404 else _confirmed(r)


# The same two as `async def` (d.http is then an httpx.AsyncClient): SHOP_ASYNC=1.
async def _charge_async(d: Delivery) -> Confirmed:
    r = await d.http.post(
        f"{provider_url()}/charges",
        json=d.payload,
        headers={"Idempotency-Key": d.idempotency_key},
    )
    return _confirmed(r)


async def _find_charge_async(d: Delivery) -> Confirmed | None:
    r = await d.http.get(f"{provider_url()}/charges", params={"idempotency_key": d.idempotency_key})
    return None if r.status_code == 404 else _confirmed(r)


def _confirmed(r: httpx.Response) -> Confirmed:
    if r.status_code == 402:
        # A short reason of ours (the outbox adds the status), never the provider's body: it
        # often echoes the request, and error texts reach people without payload rights.
        raise PermanentError("card declined")
    r.raise_for_status()
    body = r.json()
    return Confirmed(ref=body["id"], response={"id": body["id"], "status": body.get("status")})


_ASYNC = os.environ.get("SHOP_ASYNC", "") == "1"

charge = outbox.handler(
    DESTINATION,
    time_limit=_time_limit(),
    max_attempts=5,
    backoff=tuple(float(x) for x in os.environ.get("SHOP_BACKOFF", "1,5,30").split(",")),
    idempotent=os.environ.get("SHOP_IDEMPOTENT", "") == "1",
    lease_seconds=_lease_seconds(),
    breaker=_breaker(),
)(_charge_async if _ASYNC else _charge)
find_charge = charge.lookup(_find_charge_async if _ASYNC else _find_charge)
