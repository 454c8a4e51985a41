"""``outbox chains`` without ``--stalled``: the chains under way, and how many keys stopped.

A chain is known by its later steps (written by another step's ``@then`` or ``@on_failure``: their
``via``); a chain still at its first step looks like a lone row to the database, so it is not
listed here (``outbox chains --stalled`` lists every stopped key, chained or not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from .inspect import require_destination
from .repair import DEFAULT_STALLED_AFTER_SECONDS, DEFAULT_STALLED_LIMIT, stalled
from .values import seconds

# Per chained key, its first step (in written order) still waiting: pending, dispatched or in
# flight, with how long it has been so; the key's steps written (purged ones from the ledger) and
# how many of them are done (sent or cancelled, or purged: only a finished row is purged).
_UNDER_WAY = text(
    """
WITH waiting AS (
    SELECT DISTINCT ON (m.key) m.id, m.key, m.step, m.destination, m.state,
           EXTRACT(EPOCH FROM now() - COALESCE(CASE m.state WHEN 'in_flight' THEN m.claimed_at
                                                           WHEN 'dispatched' THEN m.dispatched_at
                                                           ELSE m.available_at END, m.created_at)) AS age
    FROM outbox_message m
    WHERE m.state IN ('pending', 'dispatched', 'in_flight')
      AND (CAST(:destination AS text) IS NULL OR m.destination = CAST(:destination AS text))
      AND (EXISTS (SELECT 1 FROM outbox_message k WHERE k.key = m.key AND k.via IS NOT NULL)
           OR EXISTS (SELECT 1 FROM outbox_key_ledger l WHERE l.key = m.key AND l.via IS NOT NULL))
    ORDER BY m.key, m.created_at, m.id
), purged AS (
    SELECT w.key, count(l.*) AS n
    FROM waiting w JOIN outbox_key_ledger l ON l.key = w.key
    WHERE NOT EXISTS (SELECT 1 FROM outbox_message k WHERE k.key = l.key AND k.step = l.step)
    GROUP BY w.key
)
SELECT w.*,
       (SELECT count(*) FROM outbox_message k WHERE k.key = w.key) + COALESCE(p.n, 0) AS steps,
       (SELECT count(*) FROM outbox_message k WHERE k.key = w.key AND k.state IN ('sent', 'cancelled'))
       + COALESCE(p.n, 0) AS done,
       count(*) OVER () AS matching
FROM waiting w LEFT JOIN purged p ON p.key = w.key
ORDER BY w.age DESC, w.id
LIMIT :limit
"""
)


@dataclass
class ChainsReport:
    """The chains under way, the longest waiting first, and the count of stopped keys."""

    destination: str | None
    keys: list[dict[str, Any]]
    #: How many chains are under way (``keys`` holds at most the limit).
    under_way: int
    #: How many keys ``outbox chains --stalled`` lists, at its default threshold.
    stalled: int
    stalled_after_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "under_way": self.under_way,
            "keys": self.keys,
            "stalled": {"older_than_seconds": self.stalled_after_seconds, "matching": self.stalled},
        }


def chains_under_way(
    connection: Connection, *, destination: str | None = None, limit: int = DEFAULT_STALLED_LIMIT
) -> ChainsReport:
    """Every chained key with a step waiting (optionally a step of ``destination``): where it is and
    since when, and how many keys stopped for the default ``--stalled`` threshold or more."""
    if destination is not None:
        require_destination(connection, destination)
    rows = [
        dict(r)
        for r in connection.execute(_UNDER_WAY, {"destination": destination, "limit": limit}).mappings()
    ]
    keys = [
        {
            "key": r["key"],
            "id": int(r["id"]),
            "step": r["step"],
            "destination": r["destination"],
            "state": r["state"],
            "age_seconds": seconds(r["age"]),
            "steps": int(r["steps"]),
            "done": int(r["done"]),
        }
        for r in rows
    ]
    stopped = stalled(
        connection, destination=destination, older_than_seconds=DEFAULT_STALLED_AFTER_SECONDS, limit=1
    )
    return ChainsReport(
        destination,
        keys,
        int(rows[0]["matching"]) if rows else 0,
        stopped.matching,
        DEFAULT_STALLED_AFTER_SECONDS,
    )
