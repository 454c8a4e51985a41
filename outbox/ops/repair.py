"""Chains that stopped, and their repair: ``outbox chains --stalled`` and ``outbox repair``.

A key's work stops at its first step that is not confirmed (``failed``, ``unknown``, or waiting
too long), or at a confirmed step whose next steps could not be written (its ``chain_problem``,
:mod:`outbox.chains`). Repair resumes it there, and only there, one step per key per run:

===========================  ==================================================================
the step where it stopped    what ``outbox repair`` does
===========================  ==================================================================
``sent``, next steps missing computes them with the handler module and writes them (one
                             guarded statement; a step that exists with other contents stays a
                             problem, reported)
``unknown``                  asks the provider through the lookup (the reconciler's own path):
                             found -> ``sent`` with its next steps in the same statement; not
                             found -> re-run (``pending``); past ``key_ttl`` -> a human
``failed``, ambiguous        (a call that may have taken effect) asks the provider first: found
                             -> ``sent`` with its next steps; not found within ``key_ttl`` ->
                             re-run; else refused
``failed`` by an operator    (``resolve --failed``: "refunded by hand") refused, neither continued
                             nor re-run: only ``--force`` with a reason, and then as ambiguous
``failed`` for good          (the provider's certain answer) refused: only ``--force`` re-runs it
``failed``, compensated      refused: ``outbox replay ID --force`` if it must run again
waiting                      nothing: the relay, a worker or the reconciler moves it
===========================  ==================================================================

A confirmed step is never re-run: every move is a guarded statement out of ``failed`` or
``unknown`` (or the next steps of a ``sent`` row). The plan is read first and printed; nothing
changes without ``--yes``, and each action re-checks, in its own statement, that the row is still
what the plan saw. Who and why are appended to the row's history.

Lookups talk to providers, so acting holds no transaction open: each row's action is its own
statement (autocommit), like the reconciler's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, text

from .. import chains, outcomes, states, store
from ..exceptions import ConfigError, NotFound
from ..handlers import Confirmed, Handler
from .actions import (
    COMPENSATED,
    FAILED_OUT_OF_UNKNOWN,
    ORDER_PASSED,
    default_actor,
    history_params,
    operator_text,
    plan_replay,
)
from .inspect import IN_STATE_SINCE, key_steps, require_destination
from .values import age, seconds

if TYPE_CHECKING:
    import psycopg

    from ..settlement import LookupClients

#: A waiting step (pending, dispatched, in flight) counts as stalled after this long in its state.
DEFAULT_STALLED_AFTER_SECONDS = 900.0
DEFAULT_STALLED_LIMIT = 50

# -- chains --stalled ---------------------------------------------------------------------------------

# Per key, the first step (in written order) where its work stopped: failed, unknown, waiting, or
# confirmed without its next steps, in that state for at least :older seconds. A step settled sent
# by hand without the module (chains.NOT_COMPUTED) is the reconciler's to complete: it counts
# only once it is as old as the threshold too.
_STALLED = text(
    f"""
WITH stopped AS (
    SELECT DISTINCT ON (m.key) m.id, m.key, m.step, m.destination, m.state, m.last_error,
           m.chain_problem, EXTRACT(EPOCH FROM now() - {IN_STATE_SINCE}) AS age
    FROM outbox_message m
    WHERE m.state IN ('failed', 'unknown', 'pending', 'dispatched', 'in_flight', 'sent')
      AND (m.state <> 'sent' OR m.chain_problem IS NOT NULL)
      -- A failed step whose compensation was written is handled: the chain goes on with it;
      -- so is a failed member of a batch that ended with its catch row.
      AND NOT (m.state = 'failed' AND {chains.COMPENSATED_SQL})
      AND NOT (m.state = 'failed' AND {chains.caught_sql("m")})
      AND {IN_STATE_SINCE} <= now() - CAST(:older AS float8) * interval '1 second'
      AND (CAST(:destination AS text) IS NULL OR m.destination = CAST(:destination AS text))
    ORDER BY m.key, m.created_at, m.id
)
SELECT s.*,
       (SELECT count(*) FROM outbox_message k WHERE k.key = s.key)
       + (SELECT count(*) FROM outbox_key_ledger l WHERE l.key = s.key
          AND NOT EXISTS (SELECT 1 FROM outbox_message k WHERE k.key = l.key AND k.step = l.step)) AS steps,
       EXISTS (SELECT 1 FROM outbox_message k WHERE k.key = s.key AND k.via IS NOT NULL)
       OR EXISTS (SELECT 1 FROM outbox_key_ledger l WHERE l.key = s.key AND l.via IS NOT NULL) AS chained,
       count(*) OVER () AS matching
FROM stopped s
ORDER BY s.age DESC, s.id
LIMIT :limit
"""
)


@dataclass
class StalledReport:
    """``outbox chains --stalled``: the keys whose work stopped, the longest stopped first."""

    older_than_seconds: float
    destination: str | None
    keys: list[dict[str, Any]]
    #: How many keys matched (``keys`` holds at most the limit).
    matching: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "older_than_seconds": self.older_than_seconds,
            "destination": self.destination,
            "matching": self.matching,
            "keys": self.keys,
        }


def _why(row: Mapping[str, Any]) -> str:
    if row["state"] == states.SENT:
        return f"its next steps are not written: {row['chain_problem']}"
    if row["state"] in states.WAITING:
        waited = age(seconds(row["age"]))
        return f"{row['state']} for {waited}: not moving (outbox doctor says why)"
    return str(row["last_error"] or "no reason recorded")


def stalled(
    connection: Connection,
    *,
    destination: str | None = None,
    older_than_seconds: float = DEFAULT_STALLED_AFTER_SECONDS,
    limit: int = DEFAULT_STALLED_LIMIT,
) -> StalledReport:
    """Every key whose work stopped at a step in that state for at least ``older_than_seconds``
    (optionally a step of ``destination``), with where and why. The database cannot tell a lone
    step from a chain's first step (that is the handler module's ``@then``), so every stopped key
    is listed, ``chained`` when a step of it was written by another's ``then``/``on_failure``."""
    if older_than_seconds < 0:
        raise ConfigError("--older-than must be 0 or more")
    if limit < 1:
        raise ConfigError("--limit must be 1 or more")
    if destination is not None:
        require_destination(connection, destination)
    params = {"older": float(older_than_seconds), "destination": destination, "limit": limit}
    rows = [dict(r) for r in connection.execute(_STALLED, params).mappings()]
    matching = int(rows[0]["matching"]) if rows else 0
    keys = [
        {
            "key": r["key"],
            "id": int(r["id"]),
            "step": r["step"],
            "destination": r["destination"],
            "state": r["state"],
            "age_seconds": seconds(r["age"]),
            "steps": int(r["steps"]),
            "chained": bool(r["chained"]),
            "why": _why(r),
        }
        for r in rows
    ]
    return StalledReport(float(older_than_seconds), destination, keys, matching)


# -- repair: the plan ---------------------------------------------------------------------------------

#: What repair does for a key (``RepairItem.action``).
NOTHING = "nothing"  # every step confirmed, next steps written
UNDER_WAY = "under_way"  # stopped at a waiting step: not ours to move
WRITE_NEXT = "write_next_steps"  # a confirmed step's next steps are missing
LOOK_UP = "look_up"  # unknown: ask the provider, then settle (or re-run when idempotent)
LOOK_UP_FAILED = "ask_provider"  # failed with an ambiguous history: ask the provider first
RERUN = "rerun"  # failed for good, and --force
REFUSED = "refused"

_ACTS = (WRITE_NEXT, LOOK_UP, LOOK_UP_FAILED, RERUN)

_CONFIRMED_ATTEMPT = text(
    f"""
SELECT a.attempt FROM outbox_attempt a
WHERE a.message_id = :id AND {outcomes.is_confirmed_sql("a")}
  AND a.settled IS DISTINCT FROM '{outcomes.OPERATOR_FORCED}'
LIMIT 1
"""
)


@dataclass(frozen=True)
class RepairItem:
    """One key of a repair plan: where its work stopped and what repair will do there."""

    key: str
    action: str
    #: What the plan says, for a human.
    detail: str
    row_id: int | None = None
    step: str | None = None
    destination: str | None = None
    state: str | None = None
    #: The failure the plan saw (a failed row's ``completed_at``): the acting statement's guard.
    failed_at: datetime | None = None
    #: The attempt rows behind an ambiguous failure: forced over when the lookup finds no record.
    blockers: tuple[int, ...] = ()
    refusals: tuple[str, ...] = ()
    #: Planned only because of --force: over a certain failure, or over an operator's decision.
    forced: bool = False

    @property
    def acts(self) -> bool:
        return self.action in _ACTS

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "action": self.action,
            "detail": self.detail,
            "id": self.row_id,
            "step": self.step,
            "destination": self.destination,
            "state": self.state,
        }


@dataclass
class RepairPlan:
    items: list[RepairItem]
    force: bool = False

    @property
    def refused(self) -> list[RepairItem]:
        return [i for i in self.items if i.action == REFUSED]

    def to_dict(self) -> dict[str, Any]:
        return {"force": self.force, "keys": [i.to_dict() for i in self.items]}


def _no_handler(key: str, s: Mapping[str, Any], module: str, what: str) -> RepairItem:
    return _item(
        key, REFUSED, s, f"no handler for destination {s['destination']} in {module}: {what} cannot be done"
    )


def _item(key: str, action: str, s: Mapping[str, Any], detail: str, **more: Any) -> RepairItem:
    return RepairItem(
        key=key,
        action=action,
        detail=detail,
        row_id=int(s["id"]),
        step=s["step"],
        destination=s["destination"],
        state=s["state"],
        **more,
    )


def _plan_failed(
    connection: Connection, key: str, s: Mapping[str, Any], handler: Handler | None, module: str, force: bool
) -> RepairItem:
    row_id = int(s["id"])
    [candidate] = plan_replay(connection, [row_id]).rows
    guard = {"failed_at": candidate.failed_at, "blockers": tuple(candidate.blockers)}
    error = s["last_error"] or "no reason recorded"
    if candidate.replayable:
        if force:
            return _item(
                key, RERUN, s, f"re-run step {s['step']} (failed for good: {error})", forced=True, **guard
            )
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} failed for good (the provider's certain answer: {error}); repair "
            "never re-runs it on its own: fix the cause, then "
            f"outbox repair {module} {key} --force --reason WHY",
        )
    # An operator gave up on this step on purpose (support refunded the customer by hand): asking
    # the provider would find the charge and go on with the chain, a "not found" would re-run it.
    # Both undo a human's decision, so only another human does, by name and with a reason.
    overrules = FAILED_OUT_OF_UNKNOWN in candidate.refusals
    if overrules and not force:
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} was failed by an operator (resolve --failed: {error}); repair neither "
            "continues nor re-runs it on its own: if it must, "
            f"outbox repair {module} {key} --force --reason WHY",
        )
    if COMPENSATED in candidate.refusals:
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} failed and its @on_failure compensation was written; if the step "
            f"must run again anyway: outbox replay {row_id} --force --reason WHY",
        )
    if ORDER_PASSED in candidate.refusals:
        # Its ordering key went on without it: re-run, it would come after rows written after it,
        # and could be in flight with one of them.
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} failed and its ordering key went on without it; if it must run "
            f"again anyway, out of order: outbox replay {row_id} --force --reason WHY",
        )
    confirmed = connection.execute(_CONFIRMED_ATTEMPT, {"id": row_id}).first()
    if confirmed is not None:
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} is failed but its attempt {confirmed.attempt} was confirmed by the "
            f"provider: look at outbox show {row_id} before anything else",
        )
    if handler is None:
        return _no_handler(key, s, module, "asking its provider")
    if handler.lookup_fn is None:
        return _item(
            key,
            REFUSED,
            s,
            f"step {s['step']} failed after a call that may have taken effect "
            f"({'; '.join(candidate.refusals)}) and {s['destination']} has no lookup: check the "
            f"provider, then outbox replay {row_id} --force --reason WHY if it has no record",
        )
    return _item(
        key,
        LOOK_UP_FAILED,
        s,
        f"ask the provider (lookup) whether step {s['step']} took effect ({'; '.join(candidate.refusals)}): "
        f"found -> sent and its next steps written; not found -> re-run"
        + (" (overruling the operator's resolve --failed: --force)" if overrules else ""),
        refusals=tuple(candidate.refusals),
        forced=overrules,
        **guard,
    )


def _plan_key(
    connection: Connection, key: str, handlers: Mapping[str, Handler], module: str, force: bool
) -> RepairItem:
    try:
        found = key_steps(connection, key)
    except NotFound as exc:
        hint = f"; {key} reads as a row id: outbox show {key} gives its key" if key.strip().isdigit() else ""
        return RepairItem(key, REFUSED, f"{exc}{hint}")
    s = found.stopped_at
    if s is None:
        return RepairItem(
            key, NOTHING, "every step is confirmed, cancelled, or failed and compensated: nothing to repair"
        )
    handler = handlers.get(s["destination"])
    state = s["state"]
    if state == states.SENT:
        if handler is None:
            return _no_handler(key, s, module, "computing its next steps")
        return _item(
            key,
            WRITE_NEXT,
            s,
            f"write the next steps of step {s['step']} (confirmed, ref {s['provider_ref']}): "
            f"{s['chain_problem']}",
        )
    if state in states.WAITING:
        return _item(
            key, UNDER_WAY, s, f"step {s['step']} is {state}: under way, nothing to do (outbox show {key})"
        )
    if state == states.UNKNOWN:
        if handler is None:
            return _no_handler(key, s, module, "asking its provider")
        if handler.lookup_fn is None and not handler.idempotent:
            return _item(
                key,
                REFUSED,
                s,
                f"step {s['step']} is unknown and {s['destination']} has neither a lookup nor "
                f"idempotency: check the provider, then outbox resolve {module} {s['id']} --sent REF "
                "(or --not-sent)",
            )
        how = "ask the provider (lookup)" if handler.lookup_fn else "re-run (the destination is idempotent)"
        return _item(
            key,
            LOOK_UP,
            s,
            f"{how} whether step {s['step']} took effect: found -> sent and its next steps written; "
            "not found -> re-run",
        )
    return _plan_failed(connection, key, s, handler, module, force)


def plan_repair(
    connection: Connection,
    keys: Sequence[str],
    *,
    handlers: Mapping[str, Handler],
    module: str = "the handler module",
    force: bool = False,
) -> RepairPlan:
    """What ``outbox repair`` would do for each key; changes nothing."""
    if not keys:
        raise ConfigError("repair needs keys (or --stalled)")
    if force and len(set(keys)) != 1:
        raise ConfigError(
            "--force re-runs a step that failed for good, or overrules an operator's resolve --failed: "
            "one key named alone, never in bulk"
        )
    wanted = list(dict.fromkeys(keys))
    return RepairPlan([_plan_key(connection, k, handlers, module, force) for k in wanted], force)


# -- repair: acting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepairResult:
    key: str
    done: bool
    message: str
    row_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "id": self.row_id, "done": self.done, "message": self.message, **self.extra}


_ROW = """
SELECT id, key, step, destination, payload, attempts, deadline, state, provider_ref, response,
       chain_problem, last_error, completed_at, trace_context, payload_version
FROM outbox_message WHERE id = %(id)s
"""
_OLD_CALL = f"""
SELECT EXISTS ({store.recovery.CALL_OLDER_THAN_KEY_TTL_SQL}) FROM outbox_message WHERE id = %(id)s
"""


# Until when a call of the row may still land at the provider: the reconciler's own first lookup
# of an expired claim is a lease plus a time_limit after the claim (expire_leases), so a "not
# found" before then proves nothing. Seconds left (<= 0 or NULL: none can).
_LANDING = f"""
SELECT EXTRACT(EPOCH FROM max(a.started_at)
       + CAST(%(wait)s AS float8) * interval '1 second' - now())
FROM outbox_attempt a
WHERE a.message_id = %(id)s AND {outcomes.may_have_taken_effect_sql("a")}
"""


@dataclass
class _Acting:
    conn: psycopg.Connection[Any]
    handlers: Mapping[str, Handler]
    module: str
    clients: LookupClients
    by: str
    reason: str | None
    database_url: str

    def row(self, row_id: int) -> dict[str, Any] | None:
        from psycopg.rows import dict_row

        with self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(_ROW, {"id": row_id}).fetchone()

    def note(self, row_id: int, **extra: Any) -> None:
        store.operator.note_history(
            self.conn, row_id=row_id, by=self.by, action="repair", reason=self.reason, extra=json.dumps(extra)
        )

    def still_landing(self, item: RepairItem, handler: Handler) -> RepairResult | None:
        """Refused while a call of the row may still land at the provider, which would answer a
        lookup "not found" meanwhile (a re-run would charge twice); None once none can. Checked
        before the lookup: a slow lookup answering after the bound proves nothing more."""
        assert item.row_id is not None
        found = self.conn.execute(
            _LANDING, {"id": item.row_id, "wait": handler.lease_seconds + handler.time_limit}
        ).fetchone()
        landing = max(0.0, float(found[0])) if found and found[0] is not None else 0.0
        if landing <= 0:
            return None
        return RepairResult(
            item.key,
            False,
            f"step {item.step}: its last call may still be landing at the provider for "
            f"{landing:.0f} s more (lease_seconds + time_limit after its claim): nothing changed, "
            "repair it after that",
            item.row_id,
        )

    def wake(self) -> None:
        from ..schema import NOTIFY_CHANNEL

        self.conn.execute("SELECT pg_notify(%s, '')", (NOTIFY_CHANNEL,))


def execute_repair(
    database_url: str,
    plan: RepairPlan,
    *,
    handlers: Mapping[str, Handler],
    module: str = "the handler module",
    by: str | None = None,
    reason: str | None = None,
    clients: LookupClients | None = None,
) -> list[RepairResult]:
    """Do what ``plan`` says, key by key, each action one guarded statement that re-checks the
    row is still what the plan saw (a lookup runs with no transaction open)."""
    from ..db import connect_raw
    from ..settlement import LookupClients

    if plan.force and not (reason and reason.strip()):
        raise ConfigError("--force needs --reason: why re-running this step is right now")
    own = clients is None
    acting = _Acting(
        connect_raw(database_url, autocommit=True, application_name="outbox repair"),
        handlers,
        module,
        LookupClients() if clients is None else clients,
        by or default_actor(),
        operator_text(reason),
        database_url,
    )
    try:
        return [_act(acting, item) for item in plan.items]
    finally:
        acting.conn.close()
        if own:
            acting.clients.close()


def _act(acting: _Acting, item: RepairItem) -> RepairResult:
    if not item.acts:
        return RepairResult(item.key, item.action != REFUSED, item.detail, item.row_id)
    assert item.row_id is not None
    if item.action == WRITE_NEXT:
        return _write_next(acting, item)
    if item.action == LOOK_UP:
        return _look_up_unknown(acting, item)
    if item.action == LOOK_UP_FAILED:
        return _look_up_failed(acting, item)
    return _rerun(acting, item, forced=False, result="forced")


def _changed(item: RepairItem, row: Mapping[str, Any] | None) -> RepairResult:
    """The guarded statement moved nothing: someone else (the reconciler, a worker, another
    repair) moved the row first. Done when it moved on the way repair would have (on its way to
    the provider again, or confirmed with its next steps); else left for a look."""
    now = row["state"] if row is not None else "gone"
    if row is not None and (
        row["state"] in states.WAITING or (row["state"] == states.SENT and row["chain_problem"] is None)
    ):
        return RepairResult(
            item.key,
            True,
            f"step {item.step} moved on meanwhile (now {now}): nothing left to do",
            item.row_id,
        )
    return RepairResult(
        item.key, False, f"step {item.step} changed since the plan (now {now}): left alone", item.row_id
    )


def _write_next(acting: _Acting, item: RepairItem) -> RepairResult:
    assert item.row_id is not None and item.destination is not None
    row = acting.row(item.row_id)
    if row is None or row["state"] != states.SENT or row["chain_problem"] is None:
        return _changed(item, row)
    handler = acting.handlers[item.destination]
    plan = chains.then_plan_for_row(
        handler, row, Confirmed(ref=row["provider_ref"], response=row["response"])
    )
    done = store.recovery.write_next_steps(
        acting.conn, row_id=item.row_id, follow=plan, expected_problem=row["chain_problem"]
    )
    if done is None:
        return _changed(item, acting.row(item.row_id))
    acting.note(item.row_id, result="next_steps_written", written=done.followed, problem=done.chain_problem)
    if done.chain_problem:
        return RepairResult(
            item.key,
            False,
            f"step {item.step}: {done.followed} next step(s) written, still missing: {done.chain_problem}",
            item.row_id,
        )
    if not plan.rows:
        return RepairResult(
            item.key,
            True,
            f"step {item.step}: its @then declares no next step: nothing was missing",
            item.row_id,
        )
    acting.wake()
    steps = ", ".join(str(r["step"]) for r in plan.rows)
    return RepairResult(
        item.key,
        True,
        f"step {item.step}: next steps written ({steps}; {done.followed} new); the chain goes on",
        item.row_id,
    )


def _look_up_unknown(acting: _Acting, item: RepairItem) -> RepairResult:
    from ..settlement import resolve_one

    assert item.row_id is not None and item.destination is not None
    # The reconciler's own first lookup comes no sooner (expire_leases).
    refused = acting.still_landing(item, acting.handlers[item.destination])
    if refused is not None:
        return refused
    outcome = resolve_one(
        acting.conn, acting.handlers, item.row_id, module=acting.module, clients=acting.clients
    )
    row = acting.row(item.row_id)
    if outcome is None or outcome == "raced" or row is None:
        return _changed(item, row)
    acting.note(item.row_id, result=outcome)
    if outcome == states.SENT:
        return RepairResult(
            item.key,
            True,
            f"step {item.step}: the provider has it (ref {row['provider_ref']}): sent, no second call; "
            "its next steps are written, the chain goes on",
            item.row_id,
        )
    if outcome == states.PENDING:
        acting.wake()
        return RepairResult(
            item.key,
            True,
            f"step {item.step}: the provider has no record of it: re-run (pending)",
            item.row_id,
        )
    if outcome == states.FAILED:
        return RepairResult(
            item.key,
            False,
            f"step {item.step}: the provider has no record of it, and it is out of attempts or past "
            f"its deadline: failed ({row['last_error']})",
            item.row_id,
        )
    return RepairResult(
        item.key, False, f"step {item.step} left unknown ({outcome}): {row['last_error']}", item.row_id
    )


def _look_up_failed(acting: _Acting, item: RepairItem) -> RepairResult:
    assert item.row_id is not None and item.destination is not None
    row = acting.row(item.row_id)
    if row is None or row["state"] != states.FAILED or row["completed_at"] != item.failed_at:
        return _changed(item, row)
    handler = acting.handlers[item.destination]
    assert handler.lookup_fn is not None  # planned only with one
    refused = acting.still_landing(item, handler)
    if refused is not None:
        return refused
    from ..settlement import ask_provider

    # No transaction is open: the connection is in autocommit mode.
    try:
        delivery, found = ask_provider(
            acting.clients,
            handler,
            row_id=item.row_id,
            key=row["key"],
            step=row["step"],
            payload=row["payload"],
            attempts=row["attempts"],
            deadline=row["deadline"],
            trace_context=row["trace_context"],
            payload_version=row["payload_version"],
        )
    except Exception as exc:
        return RepairResult(
            item.key,
            False,
            f"step {item.step}: the lookup failed ({type(exc).__name__}: {str(exc)[:200]}): nothing changed",
            item.row_id,
        )
    if found is not None:
        written = store.operator.repair_found(
            acting.conn,
            row_id=item.row_id,
            version=item.failed_at,
            ref=found.ref,
            response=found.response,
            follow=chains.then_plan(handler, delivery, chains.as_stored(found)),
            by=acting.by,
            reason=acting.reason,
            overrule=item.forced,
            extra={"forced": True, "overrode": list(item.refusals)} if item.forced else None,
        )
        if written is None:
            return _changed(item, acting.row(item.row_id))
        acting.wake()
        return RepairResult(
            item.key,
            True,
            f"step {item.step}: the provider has it (ref {found.ref}): failed -> sent, no second call; "
            f"{written} next step(s) written",
            item.row_id,
        )
    old = acting.conn.execute(_OLD_CALL, {"id": item.row_id, "key_ttl": handler.key_ttl}).fetchone()
    if old is not None and old[0]:
        acting.note(item.row_id, result="not_found_past_key_ttl")
        return RepairResult(
            item.key,
            False,
            f"step {item.step}: the provider has no record, but a call is older than key_ttl "
            f"({handler.key_ttl:g} s): it may have forgotten it, so 'not found' proves nothing; check "
            f"its records, then outbox replay {item.row_id} --force --reason WHY",
            item.row_id,
        )
    return _rerun(acting, item, forced=True, result="not_found")


def _rerun(acting: _Acting, item: RepairItem, *, forced: bool, result: str) -> RepairResult:
    """failed -> pending through the replay's own guarded statements, recorded as a repair:
    ``forced`` over the ambiguous calls the plan saw (the lookup found no record of them)."""
    from ..db import make_engine

    assert item.row_id is not None
    engine = make_engine(acting.database_url, connect_args={"application_name": "outbox repair"})
    try:
        with engine.begin() as conn:
            history = history_params(
                "repair",
                states.PENDING,
                acting.by,
                acting.reason,
                result=result,
                overrode=list(item.refusals),
                **({"forced": True} if item.forced else {}),
            )
            if forced:
                moved = store.operator.replay_forced(
                    conn,
                    row_id=item.row_id,
                    version=item.failed_at,
                    seen=item.blockers,
                    history=history,
                    overrule=item.forced,
                )
            else:
                rows = store.operator.replay_planned(
                    conn, ids=[item.row_id], versions=[item.failed_at], history=history
                )
                moved = rows[0] if rows else None
            if moved is not None:
                from ..schema import NOTIFY_CHANNEL

                conn.execute(text("SELECT pg_notify(:c, '')"), {"c": NOTIFY_CHANNEL})
    finally:
        engine.dispose()
    if moved is None:
        return _changed(item, acting.row(item.row_id))
    why = "the provider has no record of it" if result == "not_found" else "forced"
    return RepairResult(item.key, True, f"step {item.step}: {why}: re-run (failed -> pending)", item.row_id)
