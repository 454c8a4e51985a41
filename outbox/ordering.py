"""Per-key ordering (issue 15): rows written with the same ``ordering_key`` are claimed one at a
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
  the row by its claim, ``skip_when_failed``) or an operator skipped it (``outbox skip``,
  ``order_skipped_at``).

Who unblocks a key: the worker and the reconciler settling the head; an operator with
``resolve``, ``replay`` or ``skip`` (docs/ordering.md).
"""

from __future__ import annotations

#: The earlier rows of an ordering key that hold back the rows after them.
HOLDING_SQL = """(e.state IN ('pending', 'dispatched', 'in_flight', 'unknown')
         OR (e.state = 'failed' AND NOT e.skip_when_failed AND e.order_skipped_at IS NULL))"""


def blocked_sql(row: str) -> str:
    """True when an earlier row of ``row``'s ordering key holds it back (``row``: the table name
    or alias of the row in question). One probe of the ordering index; false at once for a row
    without an ordering key."""
    return f"""({row}.ordering_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox_message e
        WHERE e.ordering_key = {row}.ordering_key AND e.id < {row}.id
          AND e.state NOT IN ('sent', 'cancelled') AND {HOLDING_SQL}))"""


def passed_sql(row: str) -> str:
    """True when a later row of ``row``'s ordering key already went (was claimed, or settled):
    ``row``, replayed, would come after it; ``outbox replay`` then needs ``--force``."""
    return f"""({row}.ordering_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox_message p
        WHERE p.ordering_key = {row}.ordering_key AND p.id > {row}.id
          AND (p.state NOT IN ('pending', 'dispatched') OR p.attempts > 0)))"""


#: ``on_failed_head`` values of ``@outbox.handler``.
ON_FAILED_HEAD = ("block", "skip")

#: The longest ordering key ``write`` accepts (the schema's CHECK says the same).
MAX_ORDERING_KEY_LENGTH = 200
