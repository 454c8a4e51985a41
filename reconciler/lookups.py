"""HTTP clients for the lookups of ``resolve_unknown``, owned by the reconciler."""

from __future__ import annotations

from outbox.handlers import Deliveries


class LookupClients(Deliveries):
    """The lookups' deliveries: one HTTP client per destination, kept across runs and closed by
    ``close``. The reconciler may share a process with a worker (tests, the demo), so it owns
    clients of its own and closes exactly those. A lookup runs outside any worker call, so its
    clients have no send bound."""

    def __init__(self) -> None:
        super().__init__(send_bound=False)
