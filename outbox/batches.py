"""Batches: rows written in one transaction as a group, and one row written when all are done.

::

    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name=f"import:{job.id}",
                         then=outbox.Next("report", "mail.send", {"job": job.id}),
                         catch=outbox.Next("alert", "mail.send", {"job": job.id, "failed": True}))
        for chunk in chunks:
            outbox.write(s, key=f"import:{job.id}", step=f"chunk-{chunk.n}",
                         destination="crm.import", payload=chunk.payload, batch=b)

The batch and its members commit together, in the caller's transaction (nothing here commits).
A row joins a batch only in the transaction that created it, so a committed batch's members are
fixed, and "every member is terminal" means the same to every reader. When it is, the
reconciler's ``batches`` job finishes the batch in one guarded statement
(:func:`outbox.store.recovery.finish_batch`): exactly one of ``then`` (no member failed: each is
``sent`` or ``cancelled``) or ``catch`` (any failed) is written, as row ``(name, step)``, even
with two reconcilers at once, and never lost: the job sweeps every open batch each run, so two
last members settling at the same moment cannot each leave the finishing to the other.

A batch's outcome is decided once, from its members' states at that moment: a failed member
replayed afterwards does not undo its ``catch``. A batch with no member finishes with ``then``.

A finished batch whose members are purged is kept like a ledgered key (the reconciler's purge):
its then/catch payloads give way to their SHA-256 at the retention, the batch goes at the ledger
horizon; until then its name answers as before (same steps: the old batch; other: a conflict).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from . import features, store
from .chains import Next, version_for
from .exceptions import BatchConflict, InvalidMessage
from .schema_check import ensure_schema, ensure_schema_async
from .validation import check_destination, check_key_step, encode_payload

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

#: A then/catch step's payload: ``write``'s default limit.
MAX_STEP_PAYLOAD_BYTES = 65536


def _same_step(column: str, param: str) -> str:
    """The stored step ``column`` is the one given: equal, or, once the purge replaced its
    payload by its SHA-256 (:data:`outbox.store.recovery.STRIPPED_STEP_SQL`), equal to the given one
    stripped the same way."""
    given = f"CAST(:{param} AS jsonb)"
    return (
        f"{column} IS NOT DISTINCT FROM CASE WHEN {column} ? 'payload_sha256' "
        f"THEN {store.recovery.STRIPPED_STEP_SQL.format(step=given)} ELSE {given} END"
    )


# A ledgered name answers as write() answers for a ledgered key: the same definition is the old
# batch, another one a conflict, until the purge drops the batch at the horizon.
_EXISTING = text(
    f"""
SELECT id, {_same_step("then_step", "then_step")} AND {_same_step("catch_step", "catch_step")} AS same
FROM outbox_batch WHERE name = :name
"""
)
# The rows a new batch will write when done must not exist yet: the finish's INSERT would find
# them and write nothing (it records that as the batch's problem, but better refused here).
_TAKEN = text(
    """
SELECT step FROM outbox_message WHERE key = :name AND step = ANY(CAST(:steps AS text[]))
UNION
SELECT step FROM outbox_key_ledger WHERE key = :name AND step = ANY(CAST(:steps AS text[]))
"""
)


@dataclass(frozen=True)
class Batch:
    """Result of :func:`batch`: pass it as ``write(..., batch=b)``. ``created`` is False when the
    batch existed already with the same steps (a retry of a committed transaction): its members
    are fixed, and writing one of them again is the usual no-op."""

    id: int
    name: str
    created: bool
    #: The steps of its then/catch rows (key ``name``): no member may take them.
    steps: tuple[str, ...] = ()


def _step(name: str, which: str, nxt: Next | None) -> str | None:
    if nxt is None:
        return None
    if not isinstance(nxt, Next):
        raise InvalidMessage(f"batch {which}= takes an outbox.Next, got {type(nxt).__name__}")
    check_key_step(name, nxt.step)
    check_destination(nxt.destination)
    payload = json.loads(encode_payload(dict(nxt.payload), MAX_STEP_PAYLOAD_BYTES))
    step = {"step": nxt.step, "destination": nxt.destination, "payload": payload}
    version = version_for(nxt)
    if version != 1:
        # Only when not 1: a batch created before versions compares equal to its retry.
        step["payload_version"] = version
    return json.dumps(step)


def _params(name: str, then: Next | None, catch: Next | None) -> dict[str, Any]:
    if not isinstance(name, str) or not name.strip():
        raise InvalidMessage("a batch needs a name: the business key of the row it writes when done")
    # The name is the key of the row the batch writes: the rules of a key, whatever the steps.
    check_key_step(name, "batch")
    if name.strip().isdigit():
        raise InvalidMessage(f"batch name {name!r} is digits only: outbox batch show would read it as an id")
    then_step, catch_step = _step(name, "then", then), _step(name, "catch", catch)
    if then is not None and catch is not None and then.step == catch.step:
        raise InvalidMessage(f"then and catch name the same step {then.step!r}: a batch ends one way")
    steps = [n.step for n in (then, catch) if n is not None]
    return {"name": name, "then_step": then_step, "catch_step": catch_step, "steps": steps}


def _conclude(inserted: Any, existing: Any, params: dict[str, Any]) -> Batch:
    name, steps = params["name"], tuple(params["steps"])
    if inserted is not None:
        return Batch(int(inserted), name, True, steps)
    if existing is None or not existing.same:
        raise BatchConflict(
            f"batch {name!r} exists already with other then/catch steps; a batch name names one group"
        )
    return Batch(int(existing.id), name, False, steps)


def _refuse_taken(taken: list[str], name: str) -> None:
    if taken:
        raise BatchConflict(
            f"a row {name}:{taken[0]} exists already: batch {name!r} could never write its step "
            f"{taken[0]!r}; name the batch or its step otherwise"
        )


def batch(
    target: Session | Connection, *, name: str, then: Next | None = None, catch: Next | None = None
) -> Batch:
    """Open a batch in the caller's transaction; never commits. ``name`` is unique and is the
    business key of the row the batch writes when every member is terminal: ``then`` when none
    failed, ``catch`` when any did (either may be None: nothing is written that way).

    The same name again with the same steps returns the existing batch (``created=False``);
    with other steps it raises :class:`BatchConflict`; so until the purge drops a finished batch
    at the ledger horizon, after which the name is new. Bad input raises
    :class:`InvalidMessage` before any statement is sent."""
    params = _params(name, then, catch)
    ensure_schema(target)
    with features.gated(f"batch {name}"):
        inserted = store.application.insert_batch(target, params)
    if inserted is None:
        return _conclude(None, target.execute(_EXISTING, params).first(), params)
    # After the insert: a concurrent writer of the same name waits on it instead of both passing.
    _refuse_taken(list(target.execute(_TAKEN, params).scalars()), name)
    return _conclude(inserted, None, params)


async def batch_async(
    target: AsyncSession | AsyncConnection, *, name: str, then: Next | None = None, catch: Next | None = None
) -> Batch:
    """The :func:`batch` twin for ``AsyncSession`` / ``AsyncConnection``."""
    params = _params(name, then, catch)
    await ensure_schema_async(target)
    with features.gated(f"batch {name}"):
        inserted = await store.application.insert_batch_async(target, params)
    if inserted is None:
        return _conclude(None, (await target.execute(_EXISTING, params)).first(), params)
    _refuse_taken(list((await target.execute(_TAKEN, params)).scalars()), name)
    return _conclude(inserted, None, params)
