"""What the reconciler's jobs share: their counts and the protocol the scheduler runs."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import psycopg


def nonzero(counts: Counter[str]) -> dict[str, int]:
    # Only what happened: an idle run reports {} rather than a row of zeros.
    return {k: v for k, v in counts.items() if v}


class MaintenanceJob(Protocol):
    """What the scheduler runs: a named job whose ``run_once`` returns the counts of what it did
    (``{}`` when it had nothing to do)."""

    @property
    def name(self) -> str: ...

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]: ...
