"""Job 8, ``chains``: a row an operator resolved ``sent`` without the handler module (``outbox
resolve --sent`` without ``--module``), or that a release older than migration 0022 settled
``sent`` (its trigger marks those), gets its ``then`` steps from the reconciler's module
(``outbox.chains``). One guarded statement per row writes the steps and clears the
mark; a destination this module has no handler for keeps a problem that the ``alerts`` job
reports.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg
from psycopg.rows import dict_row

from outbox import chains, store
from outbox.db import require_autocommit
from outbox.handlers import Confirmed, Handler

from .common import nonzero

logger = logging.getLogger(__name__)

DEFAULT_CHAINS_BATCH = 100
#: Marked rows cleared per run without computing anything (no @then, or their step exists).
CLEAR_BATCH = 10_000

# followed_already: the settling code wrote its then steps (a release that knows chains but not
# the mark of 0022's trigger): only the mark goes, the plan is not computed a second time.
_UNCOMPUTED = f"""
SELECT id, key, step, destination, payload, attempts, deadline, provider_ref, response, payload_version,
       EXISTS (SELECT 1 FROM outbox_message c WHERE c.key = m.key AND c.parent_id = m.id
                                               AND c.via = '{chains.THEN}')
       OR EXISTS (SELECT 1 FROM outbox_key_ledger c WHERE c.key = m.key AND c.parent_id = m.id
                                                  AND c.via = '{chains.THEN}') AS followed_already
FROM outbox_message m
WHERE chain_problem = %(marker)s AND alerted_at IS NULL AND state = 'sent'
ORDER BY id
LIMIT %(limit)s
"""


def write_uncomputed(
    conn: psycopg.Connection[Any],
    handlers: Mapping[str, Handler],
    *,
    module: str = "the handler module",
    batch_size: int = DEFAULT_CHAINS_BATCH,
) -> dict[str, int]:
    """Write the next steps of up to ``batch_size`` rows resolved ``sent`` without the handler
    module (or settled by a release before 0022). Counts: ``cleared`` (no step to compute),
    ``followed`` (rows done), ``steps`` (rows written), ``no_handler``, ``raced``."""
    require_autocommit(conn, "chains")
    counts: Counter[str] = Counter()
    # First the rows that need no computing, many per statement (a release before 0022 marks
    # every row it settles): only those whose handler declares a @then are computed one by one.
    no_then = sorted(d for d, h in handlers.items() if h.then_fn is None)
    counts["cleared"] = store.recovery.clear_uncomputed(conn, no_then=no_then, limit=CLEAR_BATCH)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_UNCOMPUTED, {"marker": chains.NOT_COMPUTED, "limit": batch_size}).fetchall()
    for row in rows:
        handler = handlers.get(row["destination"])
        if row["followed_already"]:
            plan = chains.NO_NEXT_STEPS
        elif handler is None:
            plan = chains.Plan(
                (), f"no handler for destination {row['destination']} in {module}: its next steps are unknown"
            )
        else:
            confirmed = Confirmed(ref=row["provider_ref"], response=row["response"])
            plan = chains.then_plan_for_row(handler, row, confirmed)
        done = store.recovery.write_next_steps(
            conn, row_id=row["id"], follow=plan, expected_problem=chains.NOT_COMPUTED
        )
        if done is None:
            counts["raced"] += 1
            continue
        counts["no_handler" if handler is None else "followed"] += 1
        counts["steps"] += done.followed
        if done.followed:
            logger.info(
                "outbox %s:%s (resolved by hand): %d next step(s) written",
                row["key"],
                row["step"],
                done.followed,
                extra={"outbox_id": row["id"], "key": row["key"], "step": row["step"]},
            )
    return nonzero(counts)


@dataclass(frozen=True)
class ChainsConfig:
    batch_size: int = DEFAULT_CHAINS_BATCH


@dataclass(frozen=True)
class Chains:
    name: ClassVar[str] = "chains"
    config: ChainsConfig
    handlers: Mapping[str, Handler]
    module: str = "the handler module"

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return write_uncomputed(conn, self.handlers, module=self.module, batch_size=self.config.batch_size)
