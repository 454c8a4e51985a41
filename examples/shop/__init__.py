"""The example shop: orders charged through the outbox (its code is in ``outbox/demo``, shipped with
the package for ``outbox demo``; these modules keep the names the docs, docker compose and tests use)."""
