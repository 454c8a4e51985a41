"""The application's statements, in the caller's transaction (nothing here commits): a new row,
a cancelled one, a batch and its members (``outbox.write``, ``outbox.cancel``, ``outbox.batch``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import outcomes
from .sql import cached_text

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session


_INSERT = """
INSERT INTO outbox_message (key, step, destination, payload, available_at, deadline, trace_context,
                            payload_version, ordering_key, priority, fairness_key)
VALUES (:key, :step, :destination, CAST(:payload AS jsonb),
        COALESCE(CAST(:available_at AS timestamptz), now()), :deadline, CAST(:trace_context AS jsonb),
        :payload_version, :ordering_key, :priority, :fairness_key)
ON CONFLICT (key, step) DO NOTHING
RETURNING id
"""


_CANCEL_BY_KEY = f"""
UPDATE outbox_message
SET state = 'cancelled', completed_at = now(), claim_token = NULL
WHERE key = :key AND step = :step AND state IN ('pending', 'dispatched')
  -- Not `attempts = 0`: a replay resets attempts, but its earlier claims may have charged.
  -- The fence row of a lost claim that never committed (outbox.outcomes): no call was made.
  AND NOT EXISTS (SELECT 1 FROM outbox_attempt a
                  WHERE a.message_id = outbox_message.id AND NOT {outcomes.is_fence_sql("a")})
RETURNING id
"""


def insert(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> ``pending``: the new row's id, or None when ``(key, step)`` exists already (or is
    in the key ledger: the insert guard trigger then inserts nothing)."""
    return target.execute(cached_text(_INSERT), params).scalar()


async def insert_async(target: AsyncSession | AsyncConnection, params: Mapping[str, Any]) -> int | None:
    return (await target.execute(cached_text(_INSERT), params)).scalar()


def cancel_by_key(target: Session | Connection, *, key: str, step: str) -> bool:
    """``pending``/``dispatched`` -> ``cancelled``, only for a row no consumer ever claimed (no
    attempt row): once a call was attempted it may have taken effect."""
    return target.execute(cached_text(_CANCEL_BY_KEY), {"key": key, "step": step}).first() is not None


async def cancel_by_key_async(target: AsyncSession | AsyncConnection, *, key: str, step: str) -> bool:
    return (await target.execute(cached_text(_CANCEL_BY_KEY), {"key": key, "step": step})).first() is not None


# ON CONFLICT: a batch of that name exists (the caller's retry of a committed transaction, or a
# name reused): the caller compares it (outbox.batches), the transaction stays usable.
_INSERT_BATCH = """
INSERT INTO outbox_batch (name, then_step, catch_step)
VALUES (:name, CAST(:then_step AS jsonb), CAST(:catch_step AS jsonb))
ON CONFLICT (name) DO NOTHING
RETURNING id
"""


# A row joins a batch only in the transaction that created the batch (created_txid): once the
# batch commits, its members are fixed, and "every member is terminal" means the same thing to
# every reader. Casts: in a SELECT list a bare parameter would be text.
_INSERT_MEMBER = """
INSERT INTO outbox_message (key, step, destination, payload, available_at, deadline, trace_context, batch_id,
                            payload_version, ordering_key, priority, fairness_key)
SELECT CAST(:key AS text), CAST(:step AS text), CAST(:destination AS text), CAST(:payload AS jsonb),
       COALESCE(CAST(:available_at AS timestamptz), now()), CAST(:deadline AS timestamptz),
       CAST(:trace_context AS jsonb), b.id, CAST(:payload_version AS integer), CAST(:ordering_key AS text),
       CAST(:priority AS smallint), CAST(:fairness_key AS text)
FROM outbox_batch b
WHERE b.id = :batch_id AND b.created_txid = txid_current()
ON CONFLICT (key, step) DO NOTHING
RETURNING id
"""


def insert_batch(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> an open batch: its id, or None when a batch of that name exists."""
    return target.execute(cached_text(_INSERT_BATCH), params).scalar()


async def insert_batch_async(target: AsyncSession | AsyncConnection, params: Mapping[str, Any]) -> int | None:
    return (await target.execute(cached_text(_INSERT_BATCH), params)).scalar()


def insert_member(target: Session | Connection, params: Mapping[str, Any]) -> int | None:
    """(none) -> ``pending``, a member of batch ``batch_id``: the new row's id, or None when
    ``(key, step)`` exists already or the batch was not created by this transaction."""
    return target.execute(cached_text(_INSERT_MEMBER), params).scalar()


async def insert_member_async(
    target: AsyncSession | AsyncConnection, params: Mapping[str, Any]
) -> int | None:
    return (await target.execute(cached_text(_INSERT_MEMBER), params)).scalar()
