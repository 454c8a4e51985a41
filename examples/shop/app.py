"""The example shop: an order and its charge, written in ONE transaction.

Its code is ``outbox/demo/shop.py``: ``outbox demo`` drives this shop, and ships it in the package
so that it runs from an install. This module keeps the name the docs, docker compose and the
tests use::

    python -m examples.shop.app --rate 5                  # until SIGTERM / Ctrl-C
    python -m examples.shop.app --rate 50 --orders 300    # then exit 0
    python -m examples.shop.app --setup-only              # create or check the table, exit
"""

from __future__ import annotations

import sys

from outbox.demo.shop import (
    CHARGE_DESTINATION,
    KEY_PREFIX,
    ORDERS_TABLE,
    Base,
    Order,
    SchemaMismatch,
    build_parser,
    charge_key,
    create_orders_table,
    main,
    place_order,
    run_shop,
)

__all__ = [
    "CHARGE_DESTINATION",
    "KEY_PREFIX",
    "ORDERS_TABLE",
    "Base",
    "Order",
    "SchemaMismatch",
    "build_parser",
    "charge_key",
    "create_orders_table",
    "main",
    "place_order",
    "run_shop",
]

if __name__ == "__main__":
    sys.exit(main())
