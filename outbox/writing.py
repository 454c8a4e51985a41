"""The application API: write an outbox row inside the caller's transaction, or cancel one.

The caller owns the transaction: nothing here commits, begins or rolls back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from . import features, store, tracing, windows
from . import settings as _settings
from .batches import Batch
from .exceptions import BatchConflict, InvalidMessage, KeyConflict
from .ordering import MAX_ORDERING_KEY_LENGTH
from .payloads import check_version, imported_handler
from .schema_check import ensure_schema, ensure_schema_async
from .validation import check_aware, check_destination, check_key_step, check_label, encode_payload

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession


@dataclass(frozen=True)
class Written:
    """Result of :func:`write`: the row id, and whether this call created it."""

    id: int
    created: bool


# Compared in the database so that jsonb's normalisation (key order, whitespace) decides; the
# same payload at another payload_version is another operation (its fields mean something else),
# and so is one at another priority or fairness key (which would change its turn). A purged key
# answers from the ledger (which keeps no version, priority or fairness key), by the hash of the
# same canonical jsonb text the purge stored. One statement, one snapshot: a purge commits the
# row's deletion and its ledger entry together, so exactly one of the two branches finds the key.
_EXISTING = text(
    """
    (SELECT id, destination = :destination AND payload = CAST(:payload AS jsonb)
                AND payload_version = :payload_version
                AND ordering_key IS NOT DISTINCT FROM CAST(:ordering_key AS text)
                AND priority = :priority
                AND fairness_key IS NOT DISTINCT FROM CAST(:fairness_key AS text) AS same
     FROM outbox_message WHERE key = :key AND step = :step)
    UNION ALL
    (SELECT message_id, destination = :destination
            AND payload_hash = outbox_payload_digest(CAST(:payload AS jsonb))
     FROM outbox_key_ledger WHERE key = :key AND step = :step)
    LIMIT 1
    """
)

# A member of a batch: the same answer, and the row must be in that batch to be "the same".
_EXISTING_MEMBER = text(
    """
    (SELECT id, destination = :destination AND payload = CAST(:payload AS jsonb)
                AND payload_version = :payload_version
                AND ordering_key IS NOT DISTINCT FROM CAST(:ordering_key AS text)
                AND priority = :priority
                AND fairness_key IS NOT DISTINCT FROM CAST(:fairness_key AS text)
                AND batch_id IS NOT DISTINCT FROM :batch_id AS same
     FROM outbox_message WHERE key = :key AND step = :step)
    UNION ALL
    (SELECT message_id, destination = :destination
            AND payload_hash = outbox_payload_digest(CAST(:payload AS jsonb))
            AND batch_id IS NOT DISTINCT FROM :batch_id
     FROM outbox_key_ledger WHERE key = :key AND step = :step)
    LIMIT 1
    """
)
# Why a member was not inserted when no row has its key: the batch is not this transaction's.
_BATCH_OWNER = text(
    "SELECT created_txid = txid_current() AS ours, name FROM outbox_batch WHERE id = :batch_id"
)

_max_payload_bytes: int | None = None


def _default_max_payload_bytes() -> int:
    global _max_payload_bytes
    if _max_payload_bytes is None:
        # Only this variable: the application's other OUTBOX_* settings (or its own database URL
        # form) are none of write()'s business and must not make it raise.
        raw = os.environ.get("OUTBOX_MAX_PAYLOAD_BYTES", "")
        _max_payload_bytes = _settings.from_env({"OUTBOX_MAX_PAYLOAD_BYTES": raw}).max_payload_bytes
    return _max_payload_bytes


def _params(
    key: str,
    step: str,
    destination: str,
    payload: Any,
    available_at: datetime | None,
    deadline: datetime | None,
    max_payload_bytes: int | None,
    payload_version: int | None = None,
    validate: bool = False,
    ordering_key: str | None = None,
    priority: str = windows.NORMAL,
    fairness_key: str | None = None,
) -> dict[str, Any]:
    check_key_step(key, step)
    check_label("ordering_key", ordering_key, MAX_ORDERING_KEY_LENGTH)
    rank = windows.priority_rank(priority)
    check_label("fairness_key", fairness_key, windows.MAX_FAIRNESS_KEY_LENGTH)
    check_destination(destination)
    check_aware("available_at", available_at)
    check_aware("deadline", deadline)
    encoded = encode_payload(payload, max_payload_bytes or _default_max_payload_bytes())
    version = _payload_version(destination, payload, payload_version, validate)
    return {
        "key": key,
        "step": step,
        "destination": destination,
        "payload": encoded,
        "available_at": available_at,
        "deadline": deadline,
        "trace_context": tracing.current_context_json(),
        "payload_version": version,
        "ordering_key": ordering_key,
        "priority": rank,
        "fairness_key": fairness_key,
    }


def _payload_version(destination: str, payload: Any, payload_version: Any, validate: bool) -> int:
    """The row's payload version: the one given, else the destination's handler's current one
    when this process imported it, else 1; with ``validate``, the payload checked against that
    handler's model and upgrades (outbox.payloads) before any statement is sent."""
    handler = imported_handler(destination)
    if payload_version is not None:
        version = check_version(payload_version)
    else:
        version = handler.payload_version if handler is not None else 1
    if validate:
        if handler is None or not handler.checks_payloads:
            raise InvalidMessage(
                f"validate=True: no handler of {destination!r} with a payload_model or upgrades is "
                "imported in this process (import the handler module in the writer, or leave the "
                "check to the worker)"
            )
        handler.prepare(payload, version)
    return version


def _batch_id(batch: Any, key: str, step: str) -> int:
    if not isinstance(batch, Batch):
        raise InvalidMessage(
            f"batch= takes the outbox.Batch that outbox.batch returned, got {type(batch).__name__}"
        )
    if key == batch.name and step in batch.steps:
        raise InvalidMessage(
            f"{key}:{step} is the row batch {batch.name!r} writes when it is done; "
            "a member takes another step"
        )
    return batch.id


def _not_in_batch(owner: Any, batch_id: int) -> None:
    """A member that was not inserted and conflicts with no row: its batch is not open here."""
    if owner is None:
        raise BatchConflict(f"no batch with id {batch_id}")
    if not owner.ours:
        raise BatchConflict(
            f"batch {owner.name!r} was created by an earlier transaction: rows join a batch only in the "
            "transaction that created it (its members are fixed once it commits)"
        )


def _conclude(inserted: Any, existing: Any, key: str, step: str) -> Written:
    if inserted is not None:
        return Written(int(inserted), True)
    if existing is None:
        # Inserted by nobody and conflicting with nobody: the other writer rolled back after our
        # INSERT saw its row, or the ledger horizon dropped the key between the two statements.
        raise KeyConflict(key, step, -1)
    if not existing.same:
        raise KeyConflict(key, step, int(existing.id))
    return Written(int(existing.id), False)


def write(
    target: Session | Connection,
    *,
    key: str,
    step: str,
    destination: str,
    payload: dict[str, Any],
    available_at: datetime | None = None,
    deadline: datetime | None = None,
    max_payload_bytes: int | None = None,
    batch: Batch | None = None,
    payload_version: int | None = None,
    validate: bool = False,
    ordering_key: str | None = None,
    priority: str = windows.NORMAL,
    fairness_key: str | None = None,
) -> Written:
    """Add the outbox row ``(key, step)`` to the caller's transaction; never commits.

    Writing the same ``(key, step)`` again with the same destination and payload returns the
    existing id with ``created=False``; with a different one it raises :class:`KeyConflict`. The
    same holds for a key whose row was purged, while the key ledger keeps it (the horizon).
    Bad input raises :class:`InvalidMessage` before any statement is sent.

    ``batch``: the row is a member of that batch (:func:`outbox.batch`, created in this same
    transaction; else :class:`BatchConflict`).

    ``payload_version``: the version of the payload's shape (default: the current version of the
    destination's handler when this process imported it, else 1); ``validate=True`` checks the
    payload against that handler's ``payload_model`` first (outbox.payloads; docs/payloads.md).

    ``ordering_key``: the rows of one ordering key (e.g. ``customer:7``, independent of ``key``)
    are claimed one at a time, in commit order (outbox.ordering; docs/ordering.md). The writers of
    one ordering key wait for each other: the database serialises them until each commits.

    ``priority`` (``"high"``, ``"normal"``, ``"low"``) and ``fairness_key`` (e.g. ``tenant:42``):
    the relay publishes a limited destination's rows by priority, then one row of each fairness key
    in turn, so that one tenant's backlog does not hold another's rows behind it
    (outbox.windows; docs/flow-control.md). Its next steps inherit both.
    """
    params = _params(
        key,
        step,
        destination,
        payload,
        available_at,
        deadline,
        max_payload_bytes,
        payload_version,
        validate,
        ordering_key,
        priority,
        fairness_key,
    )
    ensure_schema(target)
    if batch is not None:
        params["batch_id"] = _batch_id(batch, key, step)
        with features.gated(f"row {key}:{step}"):
            inserted = store.application.insert_member(target, params)
        if inserted is not None:
            return Written(int(inserted), True)
        existing = target.execute(_EXISTING_MEMBER, params).first()
        if existing is None:
            _not_in_batch(target.execute(_BATCH_OWNER, params).first(), params["batch_id"])
        return _conclude(None, existing, key, step)
    with features.gated(f"row {key}:{step}"):
        inserted = store.application.insert(target, params)
    existing = None if inserted is not None else target.execute(_EXISTING, params).first()
    return _conclude(inserted, existing, key, step)


def cancel(target: Session | Connection, *, key: str, step: str) -> bool:
    """Cancel ``(key, step)`` if no consumer holds it; True when this call cancelled it.

    Only a row no consumer ever claimed (`pending` or `dispatched`, no attempt row) can be
    cancelled: once a call was attempted, it may have taken effect (an idempotent destination
    retries ambiguous calls), so cancelling it could hide a real charge. A purged key (in the
    ledger) is terminal: False.
    """
    check_key_step(key, step, new_row=False)
    ensure_schema(target)
    return store.application.cancel_by_key(target, key=key, step=step)


async def write_async(
    target: AsyncSession | AsyncConnection,
    *,
    key: str,
    step: str,
    destination: str,
    payload: dict[str, Any],
    available_at: datetime | None = None,
    deadline: datetime | None = None,
    max_payload_bytes: int | None = None,
    batch: Batch | None = None,
    payload_version: int | None = None,
    validate: bool = False,
    ordering_key: str | None = None,
    priority: str = windows.NORMAL,
    fairness_key: str | None = None,
) -> Written:
    """The :func:`write` twin for ``AsyncSession`` / ``AsyncConnection`` (psycopg async)."""
    params = _params(
        key,
        step,
        destination,
        payload,
        available_at,
        deadline,
        max_payload_bytes,
        payload_version,
        validate,
        ordering_key,
        priority,
        fairness_key,
    )
    await ensure_schema_async(target)
    if batch is not None:
        params["batch_id"] = _batch_id(batch, key, step)
        with features.gated(f"row {key}:{step}"):
            inserted = await store.application.insert_member_async(target, params)
        if inserted is not None:
            return Written(int(inserted), True)
        existing = (await target.execute(_EXISTING_MEMBER, params)).first()
        if existing is None:
            _not_in_batch((await target.execute(_BATCH_OWNER, params)).first(), params["batch_id"])
        return _conclude(None, existing, key, step)
    with features.gated(f"row {key}:{step}"):
        inserted = await store.application.insert_async(target, params)
    existing = None if inserted is not None else (await target.execute(_EXISTING, params)).first()
    return _conclude(inserted, existing, key, step)


async def cancel_async(target: AsyncSession | AsyncConnection, *, key: str, step: str) -> bool:
    """The :func:`cancel` twin for ``AsyncSession`` / ``AsyncConnection``."""
    check_key_step(key, step, new_row=False)
    await ensure_schema_async(target)
    return await store.application.cancel_by_key_async(target, key=key, step=step)
