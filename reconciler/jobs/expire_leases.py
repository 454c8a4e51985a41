"""Job 1, ``expire_leases``: `in_flight` rows whose lease has expired become `unknown`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psycopg

from outbox.handlers import Handler
from outbox.settings import DEFAULT_TIME_LIMIT_SECONDS

LEASE_EXPIRED_ERROR = "lease expired: the worker died or overran its time limit"

# The claim token is kept: a late recording by the same claim is better evidence than a lookup
# and may still settle the row (see outbox.fence). The fence row is closed in the same statement,
# so an operator sees why the claim ended. The first lookup waits one time_limit of the row's
# destination (on the database's clock): a call that overran its lease may still be landing at
# the provider, and a lookup before it lands would find nothing and let the row be charged again.
_EXPIRE_LEASES = """
WITH waits AS (
    SELECT * FROM unnest(CAST(%(destinations)s AS text[]), CAST(%(waits)s AS float8[]))
        AS w(destination, seconds)
), expired AS (
    UPDATE outbox_message m
    SET state = 'unknown',
        unknown_since = now(),
        available_at = now() + COALESCE(
            (SELECT w.seconds FROM waits w WHERE w.destination = m.destination),
            %(default_wait)s) * interval '1 second',
        lease_expires_at = NULL,
        last_error = %(error)s
    WHERE state = 'in_flight' AND lease_expires_at < now()
    RETURNING id, claim_token
), fenced AS (
    UPDATE outbox_attempt a
    SET outcome = 'lease_expired', finished_at = now()
    FROM expired e
    WHERE a.claim_token = e.claim_token AND a.finished_at IS NULL
    RETURNING a.id
)
SELECT (SELECT count(*) FROM expired), (SELECT count(*) FROM fenced)
"""


def expire_leases(conn: psycopg.Connection[Any], handlers: Mapping[str, Handler] | None = None) -> int:
    """Move every `in_flight` row whose lease has expired to `unknown`; returns how many moved.

    Its first lookup is due one ``time_limit`` of its destination later (from ``handlers``); a
    destination they do not name waits the longest of them, and at least the default 30 s.
    One statement, so it is safe against a consumer recording at the same moment: whichever
    commits first wins, and the other's guard no longer matches. Works on a plain autocommit
    psycopg connection; on a connection inside a transaction the caller commits.
    """
    known = dict(handlers or {})
    params = {
        "error": LEASE_EXPIRED_ERROR,
        "destinations": list(known),
        "waits": [h.time_limit for h in known.values()],
        "default_wait": max([DEFAULT_TIME_LIMIT_SECONDS, *(h.time_limit for h in known.values())]),
    }
    row = conn.execute(_EXPIRE_LEASES, params).fetchone()
    return int(row[0]) if row else 0


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
