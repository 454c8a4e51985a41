"""What every part of ``outbox demo`` shares: its names, its timings, its options, its failure.

Standard library only: ``outbox.demo.arguments`` (imported to build the CLI) reads these.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ORDERS = 300
DEFAULT_RATE = 50.0
DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_SEED = 7
#: The provider's outage: every charge answered 503 for this long, while orders flow.
DEFAULT_OUTAGE_SECONDS = 8.0

#: Names of the demo's own: its rows, keys and queues never mix with an application's.
DEMO_NAMESPACE = "outbox-demo"
#: The database the demo creates on a PostgreSQL of yours: this, ``_`` and 10 hex digits.
DATABASE_PREFIX = "outbox_demo"
ORDERS_TABLE = "outbox_demo_orders"
KEY_PREFIX = "demo-order"
DESTINATION = "demo.payments.charge"
#: Shipped in the package (not examples/): the demo runs from an install, outside a checkout.
SHOP = "outbox.demo.shop"
HANDLERS = "outbox.demo.handlers"
#: The chain phase: invoices issued then notified, by the handlers of INVOICING.
INVOICING = "outbox.demo.invoicing"
CHAIN_KEY_PREFIX = "demo-invoice"
CHAIN_ISSUE = "demo.invoicing.issue"
CHAIN_NOTIFY = "demo.invoicing.notify"
#: Every destination the demo writes: its reconciler may sweep these and no other.
DEMO_DESTINATIONS = (DESTINATION, CHAIN_ISSUE, CHAIN_NOTIFY)
CHAIN_INVOICES = 3

WORKERS = 2
WORKER_THREADS = 4
#: Faults of the provider simulator: a few charges made and then left unanswered (the
#: connection is dropped: the worker cannot know), a few refused with 503 (certainly not made).
DROP_AFTER_RATE = 0.03
FAIL_BEFORE_RATE = 0.03

#: Short timings, so that a killed worker's row is taken over and an unknown outcome is looked
#: up within seconds rather than minutes.
FAST_ENV = {
    "SHOP_TIME_LIMIT": "2",
    "SHOP_LEASE_SECONDS": "3",
    "SHOP_BACKOFF": "0.5,1,2",
    # The destination's circuit breaker: 3 "not processed" outcomes within 10 s open it for 1 s,
    # then 2, 4 s between probes (failures,window_seconds,open_seconds,max_open_seconds): below
    # the handler's 5 attempts, so that a row alone in its retries trips it before it fails.
    "SHOP_BREAKER": "3,10,1,4",
    "OUTBOX_POLL_INTERVAL": "0.5",
    "OUTBOX_REDISPATCH_AFTER": "5",
    "OUTBOX_RECONCILE_INTERVAL": "0.5",
    # The reconciler purges old terminal rows; in a database of yours it must purge nothing.
    "OUTBOX_RETENTION": "3650d",
}

#: Seconds between two worker SIGKILLs.
WORKER_KILL_EVERY_SECONDS = 2.5
TICK_SECONDS = 0.25
#: Grace given to processes on SIGTERM before they are SIGKILLed.
STOP_GRACE_SECONDS = 5.0

EXIT_INTERRUPTED = 130


class DemoFailed(Exception):
    """The demo could not run to its audit (a process died, a server would not start)."""


@dataclass(frozen=True)
class Options:
    orders: int
    rate: float
    chaos: bool
    timeout_seconds: float
    seed: int
    namespace: str
    database_url: str | None
    redis_url: str | None
    keep_logs: bool
    plain: bool
    #: 0: no outage.
    outage_seconds: float = DEFAULT_OUTAGE_SECONDS
    #: The chain phase after the audit.
    chain: bool = True
