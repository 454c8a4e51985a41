"""Invoice → accounting export → notification: a chain of three outbox steps.

Each step is its own outbox row under the same business key (``invoice:INV-7`` + ``issue``,
then ``+ export``, then ``+ notify``). The application writes the first; each handler declares
the step that follows it with ``@handler.then``, and the outbox writes that row in the very
statement that records this step as ``sent`` (``outbox.chains``). Run with::

    outbox worker examples.invoicing.handlers
    outbox reconcile examples.invoicing.handlers

Why this is safe (see README.md next to this file):

* "step N is sent" and "step N+1 exists" commit together, whoever settles step N: the worker's
  record, the reconciler's lookup after a crash, or an operator's
  ``outbox resolve examples.invoicing.handlers ID --sent REF``.
* Writing the same ``(key, step)`` again is a no-op: ``outbox repair`` may rewrite a missing
  step without creating a second one. A next step whose payload differs from an existing row's
  is not written; the confirmed step is still recorded, flagged and alerted.
* ``next_steps`` is a pure function of the delivery and the provider's answer: the invoice
  number from the payload, the provider's reference from the answer, nothing from the clock.

The three external APIs (invoicing, accounting, mail) are stood in for by the payment provider
simulator's ``/charges`` endpoint at ``INVOICING_API_URL`` (default ``http://127.0.0.1:8099``):
it records one effect per Idempotency-Key, which is what lets the tests count them.
``INVOICING_TIME_LIMIT`` / ``INVOICING_LEASE_SECONDS`` shorten the timings for the crash tests.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.orm import Session

import outbox
from outbox import Confirmed, Delivery, Next, PermanentError

#: step → destination (one queue per step, so a slow mail API never delays invoicing).
DESTINATIONS = {
    "issue": "invoicing.issue",
    "export": "invoicing.export",
    "notify": "invoicing.notify",
}


def api_url() -> str:
    return os.environ.get("INVOICING_API_URL", "http://127.0.0.1:8099")


def invoice_key(invoice: str) -> str:
    return f"invoice:{invoice}"


def start_invoice(
    session: Session, *, invoice: str, customer: str, amount_cents: int, currency: str = "EUR"
) -> outbox.Written:
    """Write the chain's first step in the caller's transaction (next to the invoice's own row)."""
    return outbox.write(
        session,
        key=invoice_key(invoice),
        step="issue",
        destination=DESTINATIONS["issue"],
        payload={
            "invoice": invoice,
            "customer": customer,
            "amount_cents": amount_cents,
            "currency": currency,
        },
    )


# -- the calls -------------------------------------------------------------------------------------


def _call(d: Delivery) -> Confirmed:
    r = d.http.post(
        f"{api_url()}/charges",
        json={**d.payload, "step": d.step},
        headers={"Idempotency-Key": d.idempotency_key},
    )
    if r.status_code in (400, 402, 404, 422):
        raise PermanentError(f"{d.step} refused with HTTP {r.status_code}")
    r.raise_for_status()
    body = r.json()
    return Confirmed(ref=body["id"], response={"id": body["id"], "status": body.get("status")})


def _find(d: Delivery) -> Confirmed | None:
    r = d.http.get(f"{api_url()}/charges", params={"idempotency_key": d.idempotency_key})
    if r.status_code == 404:
        return None
    r.raise_for_status()
    body = r.json()
    return Confirmed(ref=body["id"], response={"id": body["id"], "status": body.get("status")})


def _timings() -> dict[str, Any]:
    lease = os.environ.get("INVOICING_LEASE_SECONDS")
    return {
        "time_limit": float(os.environ.get("INVOICING_TIME_LIMIT", "10")),
        "lease_seconds": float(lease) if lease else None,
        "max_attempts": 5,
        "backoff": (5, 30, 120),
    }


@outbox.handler(DESTINATIONS["issue"], **_timings())
def issue_invoice(d: Delivery) -> Confirmed:
    return _call(d)


@outbox.handler(DESTINATIONS["export"], **_timings())
def export_to_accounting(d: Delivery) -> Confirmed:
    return _call(d)


@outbox.handler(DESTINATIONS["notify"], **_timings())
def notify_customer(d: Delivery) -> Confirmed:
    return _call(d)


for _step in (issue_invoice, export_to_accounting, notify_customer):
    _step.lookup(_find)


# -- the chain: pure functions of the delivery and the provider's answer ---------------------------


@issue_invoice.then
def export_after_issue(d: Delivery, c: Confirmed) -> list[Next]:
    return [
        Next(
            "export",
            DESTINATIONS["export"],
            {
                "invoice": d.payload["invoice"],
                "invoice_ref": c.ref,
                "amount_cents": d.payload["amount_cents"],
                "currency": d.payload["currency"],
                "ledger": "sales",
            },
        )
    ]


@export_to_accounting.then
def notify_after_export(d: Delivery, c: Confirmed) -> list[Next]:
    return [
        Next(
            "notify", DESTINATIONS["notify"], {"invoice": d.payload["invoice"], "template": "invoice-issued"}
        )
    ]


@issue_invoice.on_failure
def tell_sales(d: Delivery, error: str) -> list[Next]:
    """The invoicing provider refused the invoice for good: sales hears of it (compensation)."""
    return [
        Next(
            "refused-mail",
            DESTINATIONS["notify"],
            {"invoice": d.payload["invoice"], "template": "invoice-refused", "reason": error},
        )
    ]
