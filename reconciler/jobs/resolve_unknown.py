"""Job 2, ``resolve_unknown``: each due `unknown` row's provider is asked, through the handler's
lookup, whether the call took effect, and the row is settled accordingly (outbox.settlement).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox.alerts import AlertHook, log_alert
from outbox.handlers import Handler
from outbox.settlement import (
    DEFAULT_LOOKUP_CONCURRENCY,
    DEFAULT_RESOLVE_BATCH,
    DEFAULT_RESOLVE_BUDGET_SECONDS,
    LookupClients,
    resolve_unknown,
)

__all__ = ["ResolveUnknown", "ResolveUnknownConfig", "resolve_unknown"]


@dataclass(frozen=True)
class ResolveUnknownConfig:
    batch_size: int = DEFAULT_RESOLVE_BATCH
    time_budget_seconds: float = DEFAULT_RESOLVE_BUDGET_SECONDS
    #: Lookups of one destination in flight at once (OUTBOX_LOOKUP_CONCURRENCY).
    lookup_concurrency: int = DEFAULT_LOOKUP_CONCURRENCY


@dataclass(frozen=True)
class ResolveUnknown:
    name: ClassVar[str] = "resolve_unknown"
    config: ResolveUnknownConfig
    handlers: Mapping[str, Handler]
    #: Names the handler module in the reasons a human reads.
    module: str
    clients: LookupClients
    #: Set on shutdown: the run leaves the remaining rows due.
    stop: threading.Event | None = None
    alert: AlertHook = log_alert

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return resolve_unknown(
            conn,
            self.handlers,
            module=self.module,
            clients=self.clients,
            batch_size=self.config.batch_size,
            time_budget_seconds=self.config.time_budget_seconds,
            lookup_concurrency=self.config.lookup_concurrency,
            stop=self.stop,
            alert=self.alert,
        )
