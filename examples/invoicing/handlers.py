"""Invoice → accounting export → notification: a chain of three outbox steps.

Each step is its own outbox row under the same business key (``invoice:INV-7`` + ``issue``,
then ``+ export``, then ``+ notify``), and each handler, once its own call is confirmed, writes
the NEXT step's row in a transaction of its own. Run with::

    outbox worker examples.invoicing.handlers
    outbox reconcile examples.invoicing.handlers

Why this is safe (see README.md next to this file):

* The next row is written only after this step's call was confirmed, and before the handler
  returns, so "step N is sent" implies "step N+1 exists".
* Writing the same ``(key, step)`` with the same destination and payload again is a no-op
  (``outbox.write`` returns the existing row, ``created=False``). A handler re-run after a crash
  (or the lookup that settles it) therefore cannot create a second next step. That is why the
  next payload is derived from this step's payload only, never from anything that could differ
  between two runs (a timestamp, a random id).
* The lookup continues the chain too: if the worker died after the provider answered but
  before the next row was committed, the reconciler's lookup finds the effect, writes the
  next row, and only then is the step settled as sent.

The three external APIs (invoicing, accounting, mail) are stood in for by the payment provider
simulator's ``/charges`` endpoint at ``INVOICING_API_URL`` (default ``http://127.0.0.1:8099``):
it records one effect per Idempotency-Key, which is what lets the tests count them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

import outbox
from outbox import Confirmed, Delivery, PermanentError

#: step → destination (one queue per step, so a slow mail API never delays invoicing).
DESTINATIONS = {
    "issue": "invoicing.issue",
    "export": "invoicing.export",
    "notify": "invoicing.notify",
}
#: step → the step it feeds.
NEXT_STEP = {"issue": "export", "export": "notify"}


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


def next_payload(step: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The payload of ``step`` derived from the previous step's payload, and from it only, so
    that a re-run writes exactly the same row (a no-op) instead of a conflicting one."""
    if step == "export":
        return {
            "invoice": payload["invoice"],
            "amount_cents": payload["amount_cents"],
            "currency": payload["currency"],
            "ledger": "sales",
        }
    if step == "notify":
        return {"invoice": payload["invoice"], "template": "invoice-issued"}
    raise ValueError(f"no step {step!r} in the invoicing chain")


# -- the outbox's database, for writing the next step ----------------------------------------------

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _engine() -> Engine:
    # The next row must land in the outbox's own database, which the worker already knows.
    url = os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        raise outbox.ConfigError("examples.invoicing.handlers needs OUTBOX_DATABASE_URL")
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            from outbox.db import make_engine

            engine = _engines[url] = make_engine(url, pool_size=4, max_overflow=4)
        return engine


def continue_chain(d: Delivery) -> outbox.Written | None:
    """Write the step after ``d`` in a committed transaction of its own; a no-op when it exists."""
    step = NEXT_STEP.get(d.step)
    if step is None:
        return None
    # Committed before the handler returns: once this step is recorded as sent, the next
    # one is guaranteed to exist.
    with _engine().begin() as conn:
        return outbox.write(
            conn,
            key=d.key,
            step=step,
            destination=DESTINATIONS[step],
            payload=next_payload(step, d.payload),
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


def _run_step(d: Delivery) -> Confirmed:
    confirmed = _call(d)
    continue_chain(d)
    return confirmed


def _look_up_step(d: Delivery) -> Confirmed | None:
    found = _find(d)
    if found is not None:
        # The worker may have died between the provider's answer and the next row's commit.
        continue_chain(d)
    return found


_TIMINGS: dict[str, Any] = {"time_limit": 10, "max_attempts": 5, "backoff": (5, 30, 120)}


@outbox.handler(DESTINATIONS["issue"], **_TIMINGS)
def issue_invoice(d: Delivery) -> Confirmed:
    return _run_step(d)


@issue_invoice.lookup
def find_invoice(d: Delivery) -> Confirmed | None:
    return _look_up_step(d)


@outbox.handler(DESTINATIONS["export"], **_TIMINGS)
def export_to_accounting(d: Delivery) -> Confirmed:
    return _run_step(d)


@export_to_accounting.lookup
def find_export(d: Delivery) -> Confirmed | None:
    return _look_up_step(d)


@outbox.handler(DESTINATIONS["notify"], **_TIMINGS)
def notify_customer(d: Delivery) -> Confirmed:
    return _run_step(d)


@notify_customer.lookup
def find_notification(d: Delivery) -> Confirmed | None:
    return _look_up_step(d)
