"""The example shop: an order and its charge, written in ONE transaction.

It lives in the package, not in ``examples/``, so that ``outbox demo`` runs from an install;
``examples/shop/app.py`` re-exports it under the name the docs and docker compose use.

This is the pattern the outbox exists for. The order row and the outbox row that will charge
for it are written by the same SQLAlchemy session inside the same transaction, which the
*caller* owns::

    with Session(engine) as session, session.begin():
        place_order(session, customer="ada", amount_cents=1999)
    # committed: the order exists AND its charge will happen (exactly once)
    # rolled back: neither exists, and nothing will ever be charged

So there is no window in which an order exists without its charge, or a charge without its
order, whatever crashes when. ``place_order`` never commits and never opens a transaction of its
own; ``outbox.write`` does not either. The outbox key is the business key (``order:42`` +
``charge``), never a random UUID: writing it twice is a no-op, and the provider's
Idempotency-Key is derived from it.

The charge itself happens later, in ``outbox worker examples.shop.handlers`` (the demo
names it ``outbox.demo.handlers``: the same module).

Run as a program, the shop places orders at a steady rate (``docker compose`` and
``outbox demo`` use this)::

    python -m examples.shop.app --rate 5                  # until SIGTERM / Ctrl-C
    python -m examples.shop.app --rate 50 --orders 300    # then exit 0
    python -m outbox.demo.shop --setup-only               # the same program, from an install

The database URL comes from ``--database-url`` or ``OUTBOX_DATABASE_URL`` (the shop and the
outbox share one database: that is what makes the single transaction possible).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from types import FrameType

from sqlalchemy import BigInteger, DateTime, Engine, Identity, Integer, Text, func, inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox

logger = logging.getLogger("examples.shop")

# These three come from the environment only so that `outbox demo` can run against a database
# of yours without touching an `orders` table or outbox keys of yours; an application would
# simply write the names down.
ORDERS_TABLE = os.environ.get("SHOP_ORDERS_TABLE", "orders")
KEY_PREFIX = os.environ.get("SHOP_KEY_PREFIX", "order")
#: The queue the charge handler of outbox/demo/handlers.py consumes (it reads the same variable).
CHARGE_DESTINATION = os.environ.get("SHOP_DESTINATION", "payments.charge")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = ORDERS_TABLE

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    customer: Mapped[str] = mapped_column(Text)
    amount_cents: Mapped[int] = mapped_column(Integer)
    currency: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


def charge_key(order: Order) -> str:
    """The business key of the order's charge; the provider sees ``f"{key}:charge"``."""
    return f"{KEY_PREFIX}:{order.id}"


def place_order(session: Session, customer: str, amount_cents: int, currency: str = "EUR") -> Order:
    """Add an order and the outbox row that charges it to the caller's transaction.

    Never commits: if the caller's transaction rolls back, neither row exists.
    """
    order = Order(customer=customer, amount_cents=amount_cents, currency=currency)
    session.add(order)
    # The flush assigns the order's id, which the business key is made of. Still uncommitted.
    session.flush()
    outbox.write(
        session,
        key=charge_key(order),
        step="charge",
        destination=CHARGE_DESTINATION,
        payload={"order_id": order.id, "amount_cents": amount_cents, "currency": currency},
    )
    return order


# -- the program -----------------------------------------------------------------------------------


class SchemaMismatch(Exception):
    """The orders table exists but is not the shop's: refuse rather than write into it."""


def create_orders_table(engine: Engine) -> None:
    """Create the orders table, or check that an existing one has exactly the shop's columns."""
    existing = inspect(engine)
    if not existing.has_table(ORDERS_TABLE):
        Base.metadata.create_all(engine, checkfirst=True)
        return
    found = {c["name"] for c in existing.get_columns(ORDERS_TABLE)}
    wanted = {c.name for c in Order.__table__.columns}
    if found != wanted:
        raise SchemaMismatch(
            f"table {ORDERS_TABLE!r} already exists with columns {sorted(found)}, not the shop's "
            f"{sorted(wanted)}; it is not ours to write into (set SHOP_ORDERS_TABLE to another name)"
        )


_CUSTOMERS = ("ada", "grace", "alan", "edsger", "barbara", "donald", "frances", "ken", "margaret")


def run_shop(
    engine: Engine,
    *,
    rate: float,
    orders: int | None,
    stop: threading.Event,
    seed: int | None = None,
) -> int:
    """Place orders at ``rate`` per second until ``orders`` are placed or ``stop`` is set."""
    rng = random.Random(seed)
    interval = 1.0 / rate
    placed = 0
    next_at = time.monotonic()
    while not stop.is_set() and (orders is None or placed < orders):
        # One transaction per order, as a web request would do it.
        with Session(engine) as session, session.begin():
            order_id = place_order(session, rng.choice(_CUSTOMERS), rng.randrange(500, 20_000)).id
        placed += 1
        logger.debug("placed order %s", order_id)
        if placed % 100 == 0:
            logger.info("placed %s orders", placed)
        # Paced against the schedule, not the previous write, so a slow commit does not lower
        # the rate for good.
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif delay < -1.0:
            next_at = time.monotonic()
    return placed


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than zero, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than zero, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.shop.app",
        description=(
            "The example shop: places orders at a steady rate, each order row and its charge "
            "outbox row in one transaction. Creates its orders table if missing (and refuses "
            "to use one with other columns). SIGTERM or Ctrl-C stops it after the order in hand."
        ),
    )
    parser.add_argument("--rate", type=_positive_float, default=5.0, help="orders per second (default 5)")
    parser.add_argument(
        "--orders", type=_positive_int, default=None, help="stop after this many (default: never)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed customers and amounts")
    parser.add_argument("--database-url", help="PostgreSQL URL (default: $OUTBOX_DATABASE_URL)")
    parser.add_argument(
        "--setup-only", action="store_true", help="create or check the orders table, then exit"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Alembic narrates the one-off schema check outbox.write makes; the shop's lines matter here.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from outbox.db import make_engine

    url = args.database_url or os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        print("shop: set OUTBOX_DATABASE_URL or pass --database-url", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        engine = make_engine(url)
    except outbox.ConfigError as exc:
        print(f"shop: {exc}", file=sys.stderr)
        return 2
    try:
        create_orders_table(engine)
        if args.setup_only:
            print(f"shop: table {ORDERS_TABLE!r} ready")
            return 0
        logger.info(
            "shop placing orders: rate=%s/s orders=%s table=%s destination=%s",
            args.rate,
            args.orders or "unlimited",
            ORDERS_TABLE,
            CHARGE_DESTINATION,
        )
        placed = run_shop(engine, rate=args.rate, orders=args.orders, stop=stop, seed=args.seed)
    except SchemaMismatch as exc:
        print(f"shop: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    logger.info("shop stopped after placing %s orders", placed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
