"""Job 1, ``expire_leases``: `in_flight` rows whose lease has expired become `unknown`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psycopg

from outbox import store
from outbox.handlers import Handler
from outbox.settings import DEFAULT_TIME_LIMIT_SECONDS

LEASE_EXPIRED_ERROR = "lease expired: the worker died or overran its time limit"


def expire_leases(
    conn: psycopg.Connection[Any],
    handlers: Mapping[str, Handler] | None = None,
    *,
    only_destinations: Sequence[str] | None = None,
) -> int:
    """Move every `in_flight` row whose lease has expired to `unknown`; returns how many moved.

    Its first lookup is due one ``time_limit`` of its destination later (from ``handlers``); a
    destination they do not name waits the longest of them, and at least the default 30 s.
    One statement, so it is safe against a consumer recording at the same moment: whichever
    commits first wins, and the other's guard no longer matches. Works on a plain autocommit
    psycopg connection; on a connection inside a transaction the caller commits.
    """
    known = dict(handlers or {})
    # The first lookup waits one time_limit of the row's destination (on the database's clock):
    # a call that overran its lease may still be landing at the provider, and a lookup before
    # it lands would find nothing and let the row be charged again.
    return store.recovery.expire_leases(
        conn,
        waits_seconds={d: h.time_limit for d, h in known.items()},
        default_wait_seconds=max([DEFAULT_TIME_LIMIT_SECONDS, *(h.time_limit for h in known.values())]),
        error=LEASE_EXPIRED_ERROR,
        only_destinations=only_destinations,
    )


@dataclass(frozen=True)
class ExpireLeasesConfig:
    """The handlers name each destination's ``time_limit``: the wait before a first lookup."""

    handlers: Mapping[str, Handler] = field(default_factory=dict)


@dataclass(frozen=True)
class ExpireLeases:
    name: ClassVar[str] = "expire_leases"
    config: ExpireLeasesConfig

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        expired = expire_leases(conn, self.config.handlers)
        return {"expired": expired} if expired else {}
