"""Crash injection for the acceptance tests: ``OUTBOX_FAILPOINTS=after_claim,after_call``.

A named point SIGKILLs its own process, the way an OOM kill or a node loss would. Unset in
production; the check is one frozenset lookup.
"""

from __future__ import annotations

import os
import signal

_ACTIVE = frozenset(p.strip() for p in os.environ.get("OUTBOX_FAILPOINTS", "").split(",") if p.strip())


def failpoint(name: str) -> None:
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
