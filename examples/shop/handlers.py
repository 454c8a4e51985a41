"""Handlers of the example shop: charge a card through the payment provider, and find a charge.

Their code is ``outbox/demo/handlers.py``: ``outbox demo`` runs them, and ships them in the
package so that it runs from an install. Importing this module declares them, under the name the
docs and docker compose use: ``outbox worker examples.shop.handlers``.
"""

from __future__ import annotations

from outbox.demo.handlers import DESTINATION, charge, find_charge, provider_url

__all__ = ["DESTINATION", "charge", "find_charge", "provider_url"]
