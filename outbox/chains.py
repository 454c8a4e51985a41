"""Chains: the next steps of a settled row, written by the statement that settles it.

A handler declares them with a pure function of the delivery and the provider's answer::

    @charge.then
    def next_steps(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("export", "accounting", {"invoice": d.payload["invoice"], "charge": c.ref})]

and, for compensation, ``@charge.on_failure`` over ``def undo(d, error: str) -> list[Next]``.

Because it is declared rather than returned by the call, every path that settles a row ``sent``
(the worker's record, the reconciler's lookup, ``outbox resolve --sent``, ``outbox repair``)
computes the same steps and hands them, as one jsonb parameter, to the statement that moves the
row (:data:`FOLLOW_SQL`): "step N sent" and "its next steps exist" commit together, whatever
dies in between. The steps keep the row's business key (a new step of the same operation), so
the unique ``(key, step)`` and the key ledger make a second writing a no-op.

A plan that cannot be written as declared (the function raised, returned something that is not
a list of :class:`Next`, or a step exists already with another destination or payload) never
stops the row from being settled: the row is settled, the reason is stored in its
``chain_problem``, the reconciler alerts it once, and ``outbox repair`` writes what is missing
once the cause is fixed.

Compensation (``on_failure``) is written only when the row fails for a *certain* reason: the
failing call's answer was certain and no earlier call of the row may have taken effect
(:mod:`outbox.outcomes`). A row failed out of ``unknown`` never writes one: nobody knows the
effect did not happen. Once written, it blocks a replay of the failed row without ``--force``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import sanitize
from .exceptions import InvalidMessage
from .payloads import check_version, imported_handler
from .validation import check_destination, check_key_step, encode_payload

if TYPE_CHECKING:
    from .handlers import Confirmed, Delivery, Handler

logger = logging.getLogger(__name__)

#: Why a row was written by another's settlement (``outbox_message.via``).
THEN = "then"
ON_FAILURE = "on_failure"

#: The largest payload a next step may carry: ``write``'s default limit.
MAX_NEXT_PAYLOAD_BYTES = 65536


@dataclass(frozen=True)
class Next:
    """One step a settled row writes after it: same business key, a new ``step``."""

    step: str
    destination: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    #: The version of the payload's shape (outbox.payloads); None: the current version of the
    #: destination's handler when this process imported it, else 1 (as ``write`` does).
    payload_version: int | None = None


@dataclass(frozen=True)
class Plan:
    """The rows a settlement writes (``[{"step", "destination", "payload", "via"}]``) and why a
    declared step is missing from them (None: nothing is)."""

    rows: tuple[Mapping[str, Any], ...] = ()
    problem: str | None = None

    @property
    def param(self) -> str | None:
        """The statement's ``%(follow)s``: NULL when there is nothing to write, so that the
        settling statements of the rows without chains keep one plan."""
        return json.dumps(list(self.rows), separators=(",", ":"), ensure_ascii=False) if self.rows else None

    def __add__(self, other: Plan) -> Plan:
        problems = [p for p in (self.problem, other.problem) if p]
        return Plan(self.rows + other.rows, "; ".join(problems) or None)


NO_NEXT_STEPS = Plan()

#: ``chain_problem`` of a row settled ``sent`` by hand without the handler module (``outbox
#: resolve --sent`` without ``--module``): its next steps were not computed. The reconciler's
#: ``chains`` job computes and writes them with its module (then clears it); never alerted as is.
NOT_COMPUTED = "next steps not computed yet: settled sent by hand without the handler module"
UNCOMPUTED = Plan((), NOT_COMPUTED)


def _plan(
    via: str,
    fn: Callable[..., Any],
    key: str,
    step: str,
    args: tuple[Any, ...],
    *,
    max_payload_bytes: int = MAX_NEXT_PAYLOAD_BYTES,
) -> Plan:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        steps = fn(*args)
        if steps is None:
            return NO_NEXT_STEPS
        if isinstance(steps, Next):
            steps = [steps]
        if not isinstance(steps, Sequence) or isinstance(steps, str | bytes):
            raise TypeError(f"returned {type(steps).__name__}, expected a list of outbox.Next")
        rows = []
        seen: set[str] = set()
        for nxt in steps:
            if not isinstance(nxt, Next):
                raise TypeError(f"returned a {type(nxt).__name__} in its list, expected outbox.Next")
            check_key_step(key, nxt.step)
            check_destination(nxt.destination)
            if nxt.step == step:
                raise InvalidMessage(f"step {nxt.step!r} cannot follow itself")
            if nxt.step in seen:
                raise InvalidMessage(f"step {nxt.step!r} is named twice")
            seen.add(nxt.step)
            payload = json.loads(encode_payload(dict(nxt.payload), max_payload_bytes))
            version = version_for(nxt)
            rows.append(
                {
                    "step": nxt.step,
                    "destination": nxt.destination,
                    "payload": payload,
                    "via": via,
                    "payload_version": version,
                }
            )
    except Exception as exc:
        # A bug in a pure function must not keep a confirmed charge from being recorded: the
        # row settles, the problem is stored, alerted, and `outbox repair` writes the steps later.
        problem = sanitize.clean_text(f"{via} {name} raised {type(exc).__name__}: {exc}")
        logger.error(
            "outbox %s:%s: its %s steps were not written: %s",
            key,
            step,
            via,
            problem,
            extra={"key": key, "step": step, "outbox_chain": via, "_shown": ("outbox_chain",)},
        )
        return Plan((), problem)
    return Plan(tuple(rows))


def version_for(nxt: Next) -> int:
    """The payload version of a next step's row: its own, else the version this process's
    handler of that destination delivers, else 1 (the rule of ``write``)."""
    if nxt.payload_version is not None:
        return check_version(nxt.payload_version)
    known = imported_handler(nxt.destination)
    return known.payload_version if known is not None else 1


def as_stored(confirmed: Confirmed) -> Confirmed:
    """A provider's answer as the statement that settles its row stores it: the reference and
    the response summary through :mod:`outbox.sanitize`, the summary read back as a reader of the
    row gets it. What a ``@then`` function is given on every path, so that it sees one truth: the
    worker's and a lookup's answers pass through here, the other paths read the stored row."""
    encoded = sanitize.encode_response(confirmed.response)
    return replace(
        confirmed,
        # A reference that cleans to nothing stays as given (Confirmed refuses an empty one).
        ref=sanitize.clean_ref(confirmed.ref) or confirmed.ref,
        response=json.loads(encoded) if encoded is not None else None,
    )


def then_plan(handler: Handler, delivery: Delivery, confirmed: Confirmed) -> Plan:
    """What settling ``delivery``'s row ``sent`` with ``confirmed`` writes after it: ``confirmed``
    as stored (:func:`as_stored`, or the stored row's own values)."""
    fn = handler.then_fn
    if fn is None:
        return NO_NEXT_STEPS
    return _plan(THEN, fn, delivery.key, delivery.step, (delivery, confirmed))


def failure_plan(handler: Handler, delivery: Delivery, error: str | None) -> Plan:
    """What failing ``delivery``'s row for a certain reason writes after it (compensation)."""
    fn = handler.on_failure_fn
    if fn is None:
        return NO_NEXT_STEPS
    return _plan(ON_FAILURE, fn, delivery.key, delivery.step, (delivery, error or ""))


def caught_sql(row: str) -> str:
    """The failed member ``row`` of a batch that ended with its catch row written: handled, like
    a compensated step (``outbox chains --stalled`` and ``outbox show KEY`` both read it)."""
    return f"""({row}.batch_id IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox_batch b
        WHERE b.id = {row}.batch_id AND b.outcome = 'catch' AND b.written_id IS NOT NULL))"""


#: A compensation was written for the failed row ``m``: a replay of it needs ``--force``.
COMPENSATED_SQL = f"""(EXISTS (SELECT 1 FROM outbox_message c
                WHERE c.key = m.key AND c.parent_id = m.id AND c.via = '{ON_FAILURE}')
        OR EXISTS (SELECT 1 FROM outbox_key_ledger c
                   WHERE c.key = m.key AND c.parent_id = m.id AND c.via = '{ON_FAILURE}'))"""


def then_plan_for_row(handler: Handler, row: Mapping[str, Any], confirmed: Confirmed) -> Plan:
    """:func:`then_plan` for a stored row (``id, key, step, payload, attempts, deadline``), outside
    a worker: an operator's ``resolve --sent``, ``outbox repair``. The function is pure: its
    delivery's client is closed unused."""
    if handler.then_fn is None:
        return NO_NEXT_STEPS
    # Here, not at the top: outbox.write imports this module (through the store), and an
    # application's writer has no use for httpx.
    from .handlers import Deliveries
    from .payloads import Unreadable

    # An unreadable payload (outbox.db.tolerate_unloadable) is given as it is: a @then that
    # reads it fails, and that is stored as this row's chain problem, not the job's crash.
    stored: Any = row["payload"]
    payload: Any = stored if isinstance(stored, Unreadable) else dict(stored)
    clients = Deliveries(send_bound=False)
    try:
        delivery = clients.delivery(
            handler,
            id=int(row["id"]),
            key=str(row["key"]),
            step=str(row["step"]),
            payload=payload,
            attempt=int(row["attempts"]),
            deadline=row["deadline"],
            payload_version=int(row["payload_version"]),
            strict=False,
        )
        return then_plan(handler, delivery, confirmed)
    finally:
        clients.close()
