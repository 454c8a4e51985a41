"""What the reconciler's jobs share: their error text, their counts, their connection check."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import httpx
import psycopg

from outbox.policy import _short as _short  # the same bound as every stored error text


def _nonzero(counts: Counter[str]) -> dict[str, int]:
    # Only what happened: an idle run reports {} rather than a row of zeros.
    return {k: v for k, v in counts.items() if v}


def _describe(exc: Exception) -> str:
    # Never the full URL: query strings carry idempotency keys, and sometimes credentials.
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.host}"
    if isinstance(exc, httpx.RequestError):
        try:
            return f"{type(exc).__name__} talking to {exc.request.url.host}"
        except RuntimeError:  # raised by .request when the error carries no request
            return type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _require_autocommit(conn: psycopg.Connection[Any], job: str) -> None:
    # Inside a transaction, a lookup would hold row locks (and a snapshot) for the length of an
    # HTTP call, and one failing statement would undo the batch's earlier transitions.
    if not conn.autocommit:
        raise ValueError(f"{job} needs a psycopg connection in autocommit mode")


class MaintenanceJob(Protocol):
    """What the scheduler runs: a named job whose ``run_once`` returns the counts of what it did
    (``{}`` when it had nothing to do)."""

    @property
    def name(self) -> str: ...

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]: ...
