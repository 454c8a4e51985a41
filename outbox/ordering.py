"""Per-key ordering: rows written with the same ``ordering_key`` are claimed one at a
time, in commit order; other keys never wait for them.

Where the order is kept (all in PostgreSQL, so that it holds with many relays and workers):

* **Writers** of one ordering key are serialised by a BEFORE INSERT trigger (migration 0017): a
  transaction advisory lock on the key, then the row's id, so ids follow commit order.
* **The relay** publishes only a key's head: a row is not taken while an earlier row of its key
  may still hold it back (:data:`BLOCKING_SQL`); **the claim** checks the same, so a message that
  reached a worker anyway (a re-dispatch, a replay) claims nothing.
* **Settling a head** (sent, cancelled, failed) or skipping it fires an AFTER UPDATE trigger that
  wakes the relay: the next row goes at once.

What holds a key back, by the earlier row's state (the head-of-line policy):

* ``pending``, ``dispatched``: waiting its turn, or its retry: the key waits with it;
* ``in_flight``, ``unknown``: always: an effect that may have happened is never skipped;
* ``failed``: by default; not when its handler declares ``on_failed_head="skip"`` (recorded on
  the row by its claim, ``skip_when_failed``) and no call of it may have taken effect, or when an
  operator skipped it (``outbox skip``, ``order_skipped_at``).

Who unblocks a key: the worker and the reconciler settling the head; an operator with
``resolve``, ``replay`` or ``skip`` (docs/ordering.md).
"""

from __future__ import annotations

from . import outcomes


def lets_pass_sql(row: str) -> str:
    """The failed ``row`` no longer holds its ordering key: an operator skipped it, or its
    handler skips failed rows (``skip_when_failed``, recorded by its claim) and no call of it may
    have taken effect. An uncertain effect is never passed by a policy: only an operator's
    ``outbox skip`` passes it."""
    return f"""({row}.order_skipped_at IS NOT NULL
        OR ({row}.skip_when_failed AND NOT EXISTS (
            SELECT 1 FROM outbox_attempt {row}_a
            WHERE {row}_a.message_id = {row}.id AND {outcomes.may_have_taken_effect_sql(f"{row}_a")})))"""


#: The earlier rows (``e``) of an ordering key that hold back the rows after them.
HOLDING_SQL = f"""(e.state IN ('pending', 'dispatched', 'in_flight', 'unknown')
         OR (e.state = 'failed' AND NOT {lets_pass_sql("e")}))"""


def blocked_sql(row: str) -> str:
    """True when an earlier row of ``row``'s ordering key holds it back (``row``: the table name
    or alias of the row in question). One probe of the ordering index; false at once for a row
    without an ordering key."""
    return f"""({row}.ordering_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox_message e
        WHERE e.ordering_key = {row}.ordering_key AND e.id < {row}.id
          AND e.state NOT IN ('sent', 'cancelled') AND {HOLDING_SQL}))"""


def out_of_line_sql(row: str) -> str:
    """True when the failed ``row`` let its ordering key go on without it: skipped (by its
    handler's policy or an operator), or a later row of its key went (was claimed, or settled).
    Replayed, it would come after rows written after it: ``outbox replay`` needs ``--force``.

    Skipped is enough, whatever the later rows' states: they may be claimed at any moment (a
    replay racing a successor's claim would put two rows of one key in flight), and once purged
    they are not in the table to be seen."""
    # A row behind it that went: claimed or settled; one cancelled without a claim never went.
    return f"""({row}.ordering_key IS NOT NULL AND ({lets_pass_sql(row)}
        OR EXISTS (SELECT 1 FROM outbox_message p
                   WHERE p.ordering_key = {row}.ordering_key AND p.id > {row}.id
                     AND (p.state IN ('in_flight', 'unknown', 'sent', 'failed')
                          OR (p.state <> 'cancelled' AND p.attempts > 0)))))"""


#: ``on_failed_head`` values of ``@outbox.handler``.
ON_FAILED_HEAD = ("block", "skip")

#: The longest ordering key ``write`` accepts (the schema's CHECK says the same).
MAX_ORDERING_KEY_LENGTH = 200


#: The keys held back by their head (docs/ordering.md, "blocked"): one row per head, with the
#: rows waiting behind it; ``outbox ordering``, ``status`` and the metrics read it.
BLOCKED_SQL = f"""
WITH heads AS (
    SELECT DISTINCT ON (e.ordering_key)
           e.ordering_key, e.id, e.key, e.step, e.destination, e.state, e.attempts, e.last_error,
           e.releases, e.available_at > now() AS not_due, e.available_at,
           EXISTS (SELECT 1 FROM outbox_destination d
                   WHERE d.destination = e.destination
                     AND (d.paused_until > now() OR d.breaker_opened_at IS NOT NULL)) AS held,
           CASE e.state WHEN 'failed' THEN e.completed_at
                        WHEN 'unknown' THEN e.unknown_since
                        WHEN 'in_flight' THEN e.claimed_at
                        ELSE GREATEST(e.created_at, (SELECT max(a.finished_at) FROM outbox_attempt a
                                                     WHERE a.message_id = e.id)) END AS since
    FROM outbox_message e
    WHERE e.ordering_key IS NOT NULL AND e.state NOT IN ('sent', 'cancelled') AND {HOLDING_SQL}
    ORDER BY e.ordering_key, e.id
), blocked AS (
    SELECT h.*,
           (SELECT count(*) FROM outbox_message w
            WHERE w.ordering_key = h.ordering_key AND w.id > h.id
              AND w.state IN ('pending', 'dispatched')) AS waiting
    FROM heads h
    WHERE h.state IN ('failed', 'unknown', 'in_flight') OR h.attempts > 0 OR h.releases > 0
       OR h.not_due OR h.held
)
"""
#: Plain SQL (no parameters): the metrics read it on a psycopg connection.
BLOCKED_SUMMARY_SQL = (
    BLOCKED_SQL
    + """
SELECT count(*) AS keys, EXTRACT(EPOCH FROM now() - min(since)) AS oldest
FROM blocked WHERE waiting > 0
"""
)
