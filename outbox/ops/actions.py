"""Acting on rows: ``replay``, ``resolve`` and ``cancel``.

Every action is one guarded statement per row (``UPDATE … WHERE id = :id AND state = …``), so a
row that moved since the operator looked is refused, never overwritten; who did it and why is
appended to the row's ``history``. The functions take a SQLAlchemy ``Connection`` and never
commit: the caller owns the transaction (and a NOTIFY sent by an action is delivered when it
commits).
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from .. import chains, ordering, outcomes, sanitize, states, store
from ..exceptions import ConfigError, InvalidTransition, NotFound, OutboxError
from ..handlers import Confirmed, Handler
from .inspect import require_destination

# -- replay and resolve ------------------------------------------------------------------------------

FAILED_OUT_OF_UNKNOWN = (
    "an operator failed it out of unknown (resolve --failed): nobody knows whether its call took effect"
)
COMPENSATED = "its @on_failure compensation was written: replayed, the step would run after its own undo"
ORDER_PASSED = (
    "its ordering key went on without it (skipped, or a row behind it went): replayed, it would "
    "come after rows written after it"
)
_REFUSAL_TEXTS = {
    "failed_out_of_unknown": FAILED_OUT_OF_UNKNOWN,
    "compensated": COMPENSATED,
    "order_passed": ORDER_PASSED,
}
#: Refusals that are not about a second charge: --force is the operator's call on the order of
#: things, not on the money.
_NOT_ABOUT_A_CHARGE = frozenset({COMPENSATED, ORDER_PASSED})

# What a replay would do to each row, and why it refuses: read to preview, never to act (the
# acting statements re-check every rule themselves).
_PLAN_COLUMNS = f"""
SELECT m.id, m.key, m.step, m.destination, m.state, m.completed_at, m.last_error,
       m.deadline IS NOT NULL AND m.deadline <= now() AS past_deadline,
       ARRAY(
           SELECT CASE
               WHEN {outcomes.is_confirmed_sql("a")} THEN
                   format('attempt %s was confirmed by the provider (outcome %s)', a.attempt, a.outcome)
               WHEN a.outcome IS NULL THEN
                   format('attempt %s never recorded an outcome: its call may have taken effect', a.attempt)
               ELSE format('attempt %s ended %s: its call may have taken effect, and neither a lookup '
                           'nor an operator (resolve --not-sent) settled it', a.attempt, a.outcome)
           END
           FROM outbox_attempt a WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql("a")}
           ORDER BY a.started_at, a.id
       ) || CASE WHEN {outcomes.operator_failed_unknown_sql("m")}
                 THEN ARRAY[CAST(:failed_out_of_unknown AS text)] ELSE ARRAY[]::text[] END
         || CASE WHEN {chains.COMPENSATED_SQL}
                 THEN ARRAY[CAST(:compensated AS text)] ELSE ARRAY[]::text[] END
         || CASE WHEN {ordering.out_of_line_sql("m")}
                 THEN ARRAY[CAST(:order_passed AS text)] ELSE ARRAY[]::text[] END AS refusals,
       ARRAY(SELECT a.id FROM outbox_attempt a
             WHERE a.message_id = m.id AND {outcomes.blocks_replay_sql("a")} ORDER BY a.id) AS blockers
FROM outbox_message m
"""
_PLAN_IDS = text(f"{_PLAN_COLUMNS} WHERE m.id = ANY(CAST(:ids AS bigint[])) ORDER BY m.id")
_PLAN_DESTINATION = text(
    f"{_PLAN_COLUMNS} WHERE m.destination = :destination AND m.state = 'failed' ORDER BY m.id"
)

_CONFIRMED_ATTEMPT = text(
    f"""
SELECT a.attempt, a.outcome FROM outbox_attempt a
WHERE a.message_id = :id AND {outcomes.is_confirmed_sql("a")}
  AND a.settled IS DISTINCT FROM '{outcomes.OPERATOR_FORCED}'
ORDER BY a.id LIMIT 1
"""
)
_STATE_OF = text("SELECT state FROM outbox_message WHERE id = :id")
_NOTIFY = text("SELECT pg_notify(:channel, '')")


@dataclass(frozen=True)
class ActionResult:
    id: int
    done: bool
    message: str
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "done": self.done, "message": self.message, "warnings": self.warnings}


#: An operator's reason is kept whole up to this length (a typed sentence, a pasted ticket).
OPERATOR_TEXT_CHARS = 2000


def default_actor() -> str:
    """Who is acting: $USER, else the login name."""
    with contextlib.suppress(Exception):
        return os.environ.get("USER") or getpass.getuser()
    return "unknown"


def history_params(action: str, to_state: str, by: str, reason: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "action": action,
        "to_state": to_state,
        "by": by,
        # Operators paste what the customer or the provider said: stored like any error text.
        "reason": operator_text(reason),
        "extra": json.dumps(extra),
    }


def operator_text(reason: str | None) -> str | None:
    """An operator's --reason as stored (history, last_error): no card number, bounded."""
    return sanitize.clean_optional_text(reason, max_chars=OPERATOR_TEXT_CHARS)


def _refusal(connection: Connection, row_id: int, wanted: str, verb: str) -> OutboxError:
    # Read only to explain a refusal: the guarded UPDATE already decided.
    current = connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()
    if current is None:
        return NotFound(f"no outbox row with id {row_id}")
    return InvalidTransition(f"row {row_id} is {current}, only {wanted} rows can be {verb}")


def _state(connection: Connection, row_id: int) -> str | None:
    return connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()


def _notify(connection: Connection) -> None:
    """Wake the relays; delivered when the caller commits (the insert trigger does the same)."""
    from ..schema import NOTIFY_CHANNEL  # the table definitions: only for the commands that act

    connection.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL})


def _replayed(row: Any) -> ActionResult:
    warnings = []
    if row.past_deadline:
        warnings.append(
            "its deadline has passed: the consumer will fail it again without calling the provider"
        )
    return ActionResult(int(row.id), True, f"row {row.id} replayed: failed -> pending", warnings)


@dataclass(frozen=True)
class ReplayCandidate:
    """One row a replay was asked about, as the preview saw it."""

    id: int
    key: str
    step: str
    destination: str
    state: str
    #: When it failed: the version the acting statement requires (a row that failed again since
    #: the preview is a different failure, not the one the operator looked at).
    failed_at: datetime | None
    last_error: str | None
    past_deadline: bool
    #: Why the replay rules refuse it (empty: replayable).
    refusals: list[str]
    #: Ids of the attempt rows behind the refusals: what a --force replay marks as forced over.
    blockers: list[int]

    @property
    def replayable(self) -> bool:
        return self.state == states.FAILED and not self.refusals

    def refusal(self) -> str:
        if self.state != states.FAILED:
            return f"row {self.id} is {self.state}, only failed rows can be replayed"
        if self.refusals and set(self.refusals) <= _NOT_ABOUT_A_CHARGE:
            return (
                f"row {self.id} refused: {'; '.join(self.refusals)}. If the step must run again "
                f"anyway: outbox replay {self.id} --force --reason WHY"
            )
        return (
            f"row {self.id} refused: {'; '.join(self.refusals)}. Replaying it could charge twice; "
            f"if the provider confirms it cannot: outbox replay {self.id} --force --reason WHY"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "key": self.key,
            "step": self.step,
            "destination": self.destination,
            "state": self.state,
            "failed_at": self.failed_at,
            "last_error": self.last_error,
            "replayable": self.replayable,
            "refusals": self.refusals,
        }


@dataclass
class ReplayPlan:
    """What ``outbox replay`` will do: the rows it will replay, the rows it refuses and why.

    :func:`execute_replay` acts on exactly ``to_replay`` (by id and failure), never on a fresh
    query; ``fingerprint`` names that set so that a later run can check it acts on what was read.
    """

    destination: str | None
    force: bool
    rows: list[ReplayCandidate]
    #: Requested ids with no row.
    missing: list[int] = field(default_factory=list)

    @property
    def to_replay(self) -> list[ReplayCandidate]:
        if self.force:
            return [r for r in self.rows if r.state == states.FAILED]
        return [r for r in self.rows if r.replayable]

    @property
    def refused(self) -> list[ReplayCandidate]:
        chosen = {r.id for r in self.to_replay}
        return [r for r in self.rows if r.id not in chosen]

    @property
    def fingerprint(self) -> str:
        chosen = sorted(f"{r.id}@{r.failed_at.isoformat() if r.failed_at else '-'}" for r in self.to_replay)
        return hashlib.sha256(" ".join(chosen).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "force": self.force,
            "plan": self.fingerprint,
            "to_replay": [r.to_dict() for r in self.to_replay],
            "refused": [{**r.to_dict(), "reason": r.refusal()} for r in self.refused],
            "missing": self.missing,
        }


def _candidate(row: Any) -> ReplayCandidate:
    return ReplayCandidate(
        id=int(row.id),
        key=row.key,
        step=row.step,
        destination=row.destination,
        state=row.state,
        failed_at=row.completed_at,
        last_error=row.last_error,
        past_deadline=bool(row.past_deadline),
        refusals=list(row.refusals),
        blockers=[int(b) for b in row.blockers],
    )


def plan_replay(
    connection: Connection,
    ids: Sequence[int] = (),
    *,
    destination: str | None = None,
    force: bool = False,
) -> ReplayPlan:
    """Preview a replay of ``ids``, or of every ``failed`` row of ``destination``; changes nothing.

    The replay rules (:mod:`outbox.outcomes`): a row whose attempt rows hold a confirmed call, or an
    ambiguous one that no lookup's "not found" and no ``resolve --not-sent`` settled, or that an
    operator failed out of ``unknown``, is refused, unless ``force``, which names exactly one row.
    Raises :class:`NotFound` for a destination no row names (a typo must not read as "nothing to
    replay") and :class:`ConfigError` for a force that is not about one row by id.
    """
    if bool(ids) == bool(destination):
        raise ConfigError("replay takes row ids or --destination D, not both and not neither")
    if force and (destination or len(set(ids)) != 1):
        raise ConfigError(
            "--force replays one row named by its id, never in bulk (not with --destination, not "
            "with several ids): look at each such row with outbox show ID first"
        )
    params = dict(_REFUSAL_TEXTS)
    if destination:
        require_destination(connection, destination)
        found = connection.execute(_PLAN_DESTINATION, {**params, "destination": destination}).all()
        return ReplayPlan(destination, force, [_candidate(r) for r in found])
    wanted = list(dict.fromkeys(ids))  # a repeated id is one request
    found = connection.execute(_PLAN_IDS, {**params, "ids": wanted}).all()
    by_id = {int(r.id): _candidate(r) for r in found}
    return ReplayPlan(
        None, force, [by_id[i] for i in wanted if i in by_id], [i for i in wanted if i not in by_id]
    )


def execute_replay(
    connection: Connection, plan: ReplayPlan, *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """Replay exactly the rows of ``plan.to_replay``: each is one guarded move that re-checks the
    rules and the failure the preview saw, so a row that changed since is left alone and said so.
    A forced replay needs a ``reason`` and is recorded as such (``forced``, what it overrode) in
    the row's history, and its attempt rows are marked ``operator_forced``."""
    actor = by or default_actor()
    results: dict[int, ActionResult] = {r.id: ActionResult(r.id, False, r.refusal()) for r in plan.refused}
    results.update({i: ActionResult(i, False, f"no outbox row with id {i}") for i in plan.missing})
    chosen = plan.to_replay
    moved: dict[int, Any] = {}
    if plan.force and chosen:
        if not (reason and reason.strip()):
            raise ConfigError("--force needs --reason: why replaying this row cannot charge twice")
        [row] = chosen
        params = history_params("replay", states.PENDING, actor, reason, forced=True, overrode=row.refusals)
        seen = store.operator.replay_forced(
            connection, row_id=row.id, version=row.failed_at, seen=row.blockers, history=params
        )
        if seen is not None:
            moved[int(seen.id)] = seen
    elif chosen:
        params = history_params("replay", states.PENDING, actor, reason)
        for done in store.operator.replay_planned(
            connection, ids=[c.id for c in chosen], versions=[c.failed_at for c in chosen], history=params
        ):
            moved[int(done.id)] = done
    for c in chosen:
        results[c.id] = _replayed(moved[c.id]) if c.id in moved else _changed(connection, c, plan.force)
    if moved:
        _notify(connection)
    order = [r.id for r in plan.rows] + plan.missing
    return [results[i] for i in order]


def _changed(connection: Connection, planned: ReplayCandidate, force: bool) -> ActionResult:
    """Why a previewed row did not move: read only to explain, the guarded UPDATE decided."""
    params = {**_REFUSAL_TEXTS, "ids": [planned.id]}
    now = connection.execute(_PLAN_IDS, params).first()
    if now is None:
        return ActionResult(planned.id, False, f"no outbox row with id {planned.id}")
    current = _candidate(now)
    if current.state != states.FAILED:
        message = f"row {planned.id} is now {current.state}: it changed since the preview, left alone"
    elif current.failed_at != planned.failed_at:
        message = f"row {planned.id} failed again since the preview: left alone, preview it again"
    elif force:
        message = (
            f"row {planned.id} gained a reason to refuse since the preview "
            f"({'; '.join(current.refusals)}): left alone, look at it again"
        )
    else:
        message = current.refusal()
    return ActionResult(planned.id, False, message)


def replay(
    connection: Connection,
    ids: Sequence[int],
    *,
    by: str | None = None,
    reason: str | None = None,
    force: bool = False,
) -> list[ActionResult]:
    """``failed`` → ``pending`` for each id, attempts reset; other rows, and rows the replay
    rules refuse, are left untouched (see :func:`plan_replay`). ``force`` (one id, with a
    ``reason``) replays a row the rules refuse."""
    return execute_replay(connection, plan_replay(connection, ids, force=force), by=by, reason=reason)


def replay_destination(
    connection: Connection, destination: str, *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """Replay every ``failed`` row of ``destination`` the replay rules allow; the others are
    returned refused. Raises :class:`NotFound` for a destination no row names."""
    plan = plan_replay(connection, destination=destination)
    return execute_replay(connection, plan, by=by, reason=reason)


def resolve(
    connection: Connection,
    row_id: int,
    *,
    sent_ref: str | None = None,
    not_sent: bool = False,
    failed_reason: str | None = None,
    by: str | None = None,
    reason: str | None = None,
    handlers: Mapping[str, Handler] | None = None,
    response: Mapping[str, Any] | None = None,
) -> ActionResult:
    """Settle an ``unknown`` row by hand, exactly one of: the provider has it (``sent_ref``), it
    certainly has not (``not_sent``: back to pending, attempts kept, its ambiguous attempt rows
    marked settled, which is what lets a later replay through; refused when an attempt row holds a
    call the provider confirmed), or give up (``failed_reason``: a later replay is refused unless
    forced). Raises :class:`InvalidTransition` (or :class:`NotFound`) and changes
    nothing when the row is not ``unknown``.

    ``handlers`` (the handler module's): a row resolved ``sent`` writes its destination's
    ``then`` steps in the same statement (outbox.chains). Without them, none are written, and
    the result says so: ``outbox repair`` writes them later. ``response`` (with ``sent_ref``
    only): the provider's answer as the operator found it, a JSON object, stored sanitised as the
    row's response; the ``then`` function gets exactly what is stored (None without it)."""
    chosen = [sent_ref is not None, not_sent, failed_reason is not None]
    if sum(chosen) != 1:
        raise ConfigError("resolve needs exactly one of --sent REF, --not-sent, --failed REASON")
    if response is not None and sent_ref is None:
        raise ConfigError("--response goes with --sent: it is the answer of the call the provider has")
    if response is not None and not isinstance(response, Mapping):
        raise ConfigError(
            f"--response must be a JSON object (the provider's answer), got {type(response).__name__}"
        )
    actor = by or default_actor()
    notes: list[str] = []
    if sent_ref is not None:
        if not sent_ref.strip():
            raise ConfigError("--sent needs the provider's reference, e.g. --sent ch_123")
        # Stored by the same rules as a reference the worker records (outbox.sanitize).
        sent_ref = sanitize.clean_ref(sent_ref)
        to_state = states.SENT
        history = history_params("resolve", to_state, actor, reason, provider_ref=sent_ref)
        # Stored as a worker's answer is (outbox.sanitize), and the then function is given
        # exactly that: None without --response.
        stored = sanitize.encode_response(dict(response)) if response is not None else None
        answer = Confirmed(sent_ref, json.loads(stored) if stored is not None else None)
        plan = _then_plan(connection, row_id, answer, handlers)
        followed = store.operator.resolve_sent(
            connection, row_id=row_id, ref=sent_ref, history=history, follow=plan, response=stored
        )
        moved = followed is not None
        if moved:
            notes.extend(_chain_notes(plan, followed or 0, with_module=handlers is not None))
    elif not_sent:
        to_state = states.PENDING
        history = history_params("resolve", to_state, actor, reason)
        moved = store.operator.resolve_not_sent(connection, row_id=row_id, history=history)
    else:
        assert failed_reason is not None
        if not failed_reason.strip():
            raise ConfigError("--failed needs a reason the next reader can act on")
        # Stored as last_error: the same rules as every stored error text (no card number).
        failed_reason = sanitize.clean_text(failed_reason, max_chars=2000)
        to_state = states.FAILED
        history = history_params("resolve", to_state, actor, reason, error=failed_reason)
        moved = store.operator.resolve_failed(connection, row_id=row_id, error=failed_reason, history=history)
    if not moved:
        confirmed = (
            connection.execute(_CONFIRMED_ATTEMPT, {"id": row_id}).first()
            if not_sent and _state(connection, row_id) == states.UNKNOWN
            else None
        )
        if confirmed is not None:
            raise InvalidTransition(
                f"row {row_id}: attempt {confirmed.attempt} was confirmed by the provider (outcome "
                f"{confirmed.outcome}), so it is not 'not sent'; find its reference and use --sent REF"
            )
        raise _refusal(connection, row_id, "unknown", "resolved")
    if to_state == states.PENDING:
        _notify(connection)
    return ActionResult(row_id, True, "; ".join([f"row {row_id} resolved: unknown -> {to_state}", *notes]))


_ROW_FOR_PLAN = text(
    "SELECT id, key, step, destination, payload, attempts, deadline, payload_version "
    "FROM outbox_message WHERE id = :id"
)


def _then_plan(
    connection: Connection, row_id: int, confirmed: Confirmed, handlers: Mapping[str, Handler] | None
) -> chains.Plan:
    """The ``then`` steps of ``row_id`` once sent with ``confirmed`` (outbox.chains)."""
    if handlers is None:
        # The reconciler's `chains` job computes them with its module (outbox.chains).
        return chains.UNCOMPUTED
    row = connection.execute(_ROW_FOR_PLAN, {"id": row_id}).mappings().first()
    handler = handlers.get(row["destination"]) if row is not None else None
    if row is None or handler is None:
        return chains.NO_NEXT_STEPS
    return chains.then_plan_for_row(handler, dict(row), confirmed)


def _chain_notes(plan: chains.Plan, written: int, *, with_module: bool) -> list[str]:
    """What an operator is told of the next steps a settlement wrote."""
    if not with_module:
        return ["without MODULE its @then steps, if any, are written by the reconciler"]
    notes = []
    if plan.rows:
        steps = ", ".join(str(r["step"]) for r in plan.rows)
        existed = len(plan.rows) - written
        notes.append(
            f"next steps {steps}: {written} written" + (f", {existed} existed already" if existed else "")
        )
    if plan.problem:
        notes.append(f"next steps not all written: {plan.problem}")
    return notes


# -- cancel ------------------------------------------------------------------------------------------

_CANCEL_CANDIDATES = text(
    f"""
SELECT id, key, step, state, ({store.operator.CANCELLABLE_SQL}) AS cancellable
FROM outbox_message
WHERE destination = :destination AND state IN ('pending', 'dispatched', 'in_flight', 'unknown')
  AND (CAST(:max_id AS bigint) IS NULL OR id <= CAST(:max_id AS bigint))
ORDER BY id
"""
)

_CANCEL_IDS = text(
    f"""
SELECT id, key, step, state, ({store.operator.CANCELLABLE_SQL}) AS cancellable
FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))
"""
)


@dataclass
class CancelPlan:
    """What ``outbox cancel`` did, or would do: rows cancelled (or to cancel) and rows refused."""

    destination: str | None
    applied: bool
    #: (id, key, step, state before) of each row cancelled, or to be cancelled when not applied.
    rows: list[tuple[int, str, str, str]]
    #: (id, why) of each row that cannot be cancelled.
    refused: list[tuple[int, str]]
    #: The highest id previewed: ``--yes --max-id`` acts on no row written after the preview.
    max_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "applied": self.applied,
            "cancelled" if self.applied else "to_cancel": [
                {"id": i, "key": k, "step": st, "state": state} for i, k, st, state in self.rows
            ],
            "refused": [{"id": i, "why": why} for i, why in self.refused],
            "max_id": self.max_id,
        }


def _why_not_cancellable(state: str | None, row_id: int) -> str:
    if state is None:
        return f"no outbox row with id {row_id}"
    if state in ("pending", "dispatched"):
        return (
            f"row {row_id} is {state} but a call for it may have taken effect (an attempt row is "
            "confirmed, or ambiguous and not settled): see outbox show "
            f"{row_id}, and ask the provider"
        )
    return f"row {row_id} is {state}: only pending or dispatched rows can be cancelled"


def cancel_rows(
    connection: Connection,
    ids: Sequence[int] = (),
    *,
    destination: str | None = None,
    reason: str,
    by: str | None = None,
    apply: bool = True,
    max_id: int | None = None,
) -> CancelPlan:
    """Cancel ``pending`` or ``dispatched`` rows none of whose calls may have taken effect (never
    claimed, or every attempt row safe or settled; wider than :func:`outbox.cancel`, which only
    takes never-claimed rows), by id or every such row of ``destination`` (with ids no higher
    than ``max_id`` when given). With ``apply=False`` nothing changes: the plan says what would
    be cancelled and what is refused (by id: what the dashboard's bulk cancel previews).
    Each row moves in one guarded UPDATE; a row whose call may have taken effect since the
    preview is refused."""
    if not reason or not reason.strip():
        raise ConfigError("cancel needs --reason: why these rows will never be sent")
    if bool(ids) == (destination is not None):
        raise ConfigError("cancel takes row ids or --destination D, not both and not neither")
    rows: list[tuple[int, str, str, str]] = []
    refused: list[tuple[int, str]] = []
    if destination is not None:
        require_destination(connection, destination)
        for r in connection.execute(_CANCEL_CANDIDATES, {"destination": destination, "max_id": max_id}):
            if r.cancellable:
                rows.append((int(r.id), r.key, r.step, r.state))
            else:
                refused.append((int(r.id), _why_not_cancellable(r.state, int(r.id))))
        wanted = [r[0] for r in rows]
    else:
        wanted = list(dict.fromkeys(ids))
        if not apply:
            # A preview of named rows (the dashboard's bulk cancel): the same rule as the UPDATE.
            seen = {int(r.id): r for r in connection.execute(_CANCEL_IDS, {"ids": wanted})}
            for row_id in wanted:
                got = seen.get(row_id)
                if got is not None and got.cancellable:
                    rows.append((row_id, got.key, got.step, got.state))
                else:
                    refused.append((row_id, _why_not_cancellable(got.state if got else None, row_id)))
            return CancelPlan(None, False, rows, refused, None)
        # Read only to report what each row was; the guarded UPDATE below decides.
        found = connection.execute(
            text("SELECT id, key, step, state FROM outbox_message WHERE id = ANY(:ids)"), {"ids": wanted}
        )
        rows = [(int(r.id), r.key, r.step, r.state) for r in found]
    top = max([r[0] for r in rows] + [i for i, _ in refused], default=max_id) if destination else None
    if not apply:
        return CancelPlan(destination, False, rows, refused, top)
    done = store.operator.cancel_rows(
        connection,
        ids=wanted,
        error=operator_text(f"cancelled by an operator: {reason}"),
        history=history_params("cancel", states.CANCELLED, by or default_actor(), reason),
    )
    details = {r[0]: r for r in rows}
    cancelled: list[tuple[int, str, str, str]] = []
    for row_id in wanted:
        if row_id in done:
            cancelled.append(details[row_id])
        else:
            state = connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()
            refused.append((row_id, _why_not_cancellable(state, row_id)))
    return CancelPlan(destination, True, cancelled, sorted(refused), top)


# -- skip: let an ordering key go past its failed head ----------------------------------------------

_SKIP_STATE = text(
    "SELECT state, ordering_key, order_skipped_at, skip_when_failed FROM outbox_message WHERE id = :id"
)


def skip(
    connection: Connection, row_id: int, *, by: str | None = None, reason: str | None = None
) -> ActionResult:
    """Let the rows of a ``failed`` row's ordering key behind it go (outbox.ordering); the row
    stays failed, who and why in its history. Only a failed row: an ``unknown`` or ``in_flight``
    head may have charged, and is settled (resolve), never skipped. Replaying a skipped row later
    needs ``--force`` (it would come after rows written after it)."""
    if not reason or not reason.strip():
        raise ConfigError("skip needs --reason: why the rows behind this one may go without it")
    history = history_params("skip", states.FAILED, by or default_actor(), reason)
    if store.operator.skip_head(connection, row_id=row_id, history=history):
        return ActionResult(
            row_id, True, f"row {row_id} skipped: the rows of its ordering key behind it go; it stays failed"
        )
    row = connection.execute(_SKIP_STATE, {"id": row_id}).first()
    if row is None:
        raise NotFound(f"no outbox row with id {row_id}")
    if row.ordering_key is None:
        raise InvalidTransition(f"row {row_id} has no ordering key: nothing waits behind it")
    if row.state != states.FAILED:
        why = (
            "it may have taken effect: settle it (outbox resolve), never skip it"
            if row.state in (states.UNKNOWN, states.IN_FLIGHT)
            else "only a failed row holds its key back for good"
        )
        raise InvalidTransition(f"row {row_id} is {row.state}, not failed: {why}")
    raise InvalidTransition(f"row {row_id} is skipped already (the rows behind it go)")
