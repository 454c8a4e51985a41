"""Job 6, ``no_consumer``: destinations whose rows wait and that no live worker serves."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg

from outbox import alerts, heartbeat, settings, store
from outbox.alerts import AlertHook, AlertRow, log_alert
from outbox.db import require_autocommit

from .common import nonzero

logger = logging.getLogger(__name__)

_FIRST_ROW = (
    "SELECT key, step, state, EXTRACT(EPOCH FROM now() - created_at) FROM outbox_message WHERE id = %s"
)


def no_consumer(
    conn: psycopg.Connection[Any],
    hook: AlertHook = log_alert,
    *,
    cycles_before_alert: int = settings.DEFAULT_NO_CONSUMER_CYCLES,
) -> dict[str, int]:
    """Find destinations with rows waiting (`pending` or `dispatched`) and no live worker
    heartbeat serving their queue; alert each once per episode, after ``cycles_before_alert``
    runs in a row (a worker restarting during a deploy is not an episode). The alert goes to
    ``hook`` as an :class:`AlertRow` with state ``no_consumer``, naming the oldest waiting row
    and saying "no consumer for D since T, K rows waiting". Also deletes the heartbeats of
    processes not heard from for a day.

    Counts: ``no_consumer`` (destinations), ``alerts``, ``hook_errors``, ``ended`` (episodes
    over: a consumer appeared or nothing waits), ``heartbeats_purged``.
    """
    require_autocommit(conn, "no_consumer")
    counts: Counter[str] = Counter()
    counts["heartbeats_purged"] = store.recovery.purge_heartbeats(
        conn, retention_seconds=heartbeat.HEARTBEAT_RETENTION_SECONDS
    )
    found = heartbeat.no_consumer(conn.execute(heartbeat.NO_CONSUMER_SQL).fetchall())
    for ended in store.recovery.end_no_consumer_episodes(conn, keep=[f.destination for f in found]):
        counts["ended"] += 1
        logger.info(
            "destination %s has a consumer again, or nothing waits for one",
            ended,
            extra={"destination": ended},
        )
    for gap in found:
        counts["no_consumer"] += 1
        row = store.recovery.count_no_consumer_episode(
            conn, gap.destination, since=gap.since, rows_waiting=gap.rows_waiting
        )
        if row is None or row[0] < cycles_before_alert or row[1] is not None:
            continue
        first = conn.execute(_FIRST_ROW, (gap.first_id,)).fetchone()
        if first is None:
            continue  # gone since the count: the next cycle sees the destination afresh
        alert = AlertRow(
            id=gap.first_id,
            key=first[0],
            step=first[1],
            destination=gap.destination,
            state="no_consumer",
            reason=f"{gap.describe()}; start a worker serving it, or cancel the rows "
            f"(outbox cancel --destination {gap.destination} --reason …)",
            age=float(first[3]),
        )
        if not alerts.send(
            hook, alert, about=f"destination {gap.destination}", extra={"destination": gap.destination}
        ):
            counts["hook_errors"] += 1
            continue
        if store.recovery.mark_no_consumer_alerted(conn, gap.destination):
            counts["alerts"] += 1
    return nonzero(counts)


@dataclass(frozen=True)
class NoConsumerConfig:
    #: Runs in a row without a consumer before the alert: a restarting worker is not an episode.
    cycles_before_alert: int = settings.DEFAULT_NO_CONSUMER_CYCLES


@dataclass(frozen=True)
class NoConsumer:
    name: ClassVar[str] = "no_consumer"
    config: NoConsumerConfig
    hook: AlertHook = log_alert

    def run_once(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        return no_consumer(conn, self.hook, cycles_before_alert=self.config.cycles_before_alert)
