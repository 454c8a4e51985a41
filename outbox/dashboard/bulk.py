"""Actions on a set of rows, previewed first: ``replay`` (failed rows), ``cancel`` (pending or
dispatched rows no call of which may have taken effect) and ``resolve-failed`` (unknown rows an
operator gives up on). The rules are the CLI's own (``outbox.ops.actions``): this module only
decides which rows a preview names and checks that the confirmation acts on exactly those.

A preview ends in a fingerprint of the rows it would act on, each with the version it saw (when
the row failed, its state, since when it is unknown). The confirmation sends the ids and the
fingerprint back; :func:`apply` previews those ids again and acts only if the fingerprint is
the same, so a row that moved in between stops the whole action, which is then previewed again.
Never in bulk, as in the CLI: ``resolve --sent`` (each row has its own reference),
``--not-sent`` and ``--force``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from .. import states
from ..exceptions import ConfigError, OutboxError
from ..ops import actions

ACTIONS = {
    "replay": "Replay (failed → pending)",
    "cancel": "Cancel (never sent)",
    "resolve-failed": "Resolve as failed (give up)",
}


@dataclass
class Preview:
    action: str
    #: rows the action will move: id, key, step, destination, state
    to_act: list[dict[str, Any]]
    #: (id, why) of each row it will not touch
    refused: list[tuple[int, str]]
    fingerprint: str
    #: the filter matched more rows than one preview takes
    more: bool = False

    @property
    def ids(self) -> list[int]:
        return [int(r["id"]) for r in self.to_act] + [i for i, _ in self.refused]


@dataclass
class BulkResult:
    action: str
    done: list[tuple[int, str]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    #: Set when nothing was done because the rows changed since the preview.
    stale: str | None = None


def _fingerprint(action: str, versions: Sequence[str]) -> str:
    return hashlib.sha256(" ".join([action, *sorted(versions)]).encode()).hexdigest()[:16]


_ROWS = text(
    """
SELECT id, key, step, destination, state, unknown_since
FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))
"""
)


def preview(connection: Connection, action: str, ids: Sequence[int], *, more: bool = False) -> Preview:
    """What ``action`` would do to ``ids``; changes nothing."""
    wanted = list(dict.fromkeys(int(i) for i in ids))
    if not wanted:
        raise ConfigError("no rows selected")
    if action == "replay":
        plan = actions.plan_replay(connection, wanted)
        to_act = [
            {"id": r.id, "key": r.key, "step": r.step, "destination": r.destination, "state": r.state}
            for r in plan.to_replay
        ]
        refused = [(r.id, r.refusal()) for r in plan.refused] + [
            (i, f"no outbox row with id {i}") for i in plan.missing
        ]
        # ReplayPlan's fingerprint names each row with the failure it saw.
        return Preview(action, to_act, refused, _fingerprint(action, [plan.fingerprint]), more)
    if action == "cancel":
        cancel = actions.cancel_rows(connection, wanted, reason="preview", apply=False)
        to_act = []
        details = {int(r.id): r for r in connection.execute(_ROWS, {"ids": [c[0] for c in cancel.rows]})}
        for row_id, key, step, state in cancel.rows:
            to_act.append(
                {
                    "id": row_id,
                    "key": key,
                    "step": step,
                    "destination": details[row_id].destination,
                    "state": state,
                }
            )
        versions = [f"{r['id']}@{r['state']}" for r in to_act]
        return Preview(action, to_act, list(cancel.refused), _fingerprint(action, versions), more)
    if action == "resolve-failed":
        found = {int(r.id): r for r in connection.execute(_ROWS, {"ids": wanted})}
        to_act, refused, versions = [], [], []
        for i in wanted:
            r = found.get(i)
            if r is None:
                refused.append((i, f"no outbox row with id {i}"))
            elif r.state != states.UNKNOWN:
                refused.append((i, f"row {i} is {r.state}: only unknown rows are resolved"))
            else:
                to_act.append(
                    {"id": i, "key": r.key, "step": r.step, "destination": r.destination, "state": r.state}
                )
                versions.append(f"{i}@{r.unknown_since.isoformat() if r.unknown_since else '-'}")
        return Preview(action, to_act, refused, _fingerprint(action, versions), more)
    raise ConfigError(f"unknown action {action!r}; actions are {', '.join(ACTIONS)}")


def apply(
    connection: Connection,
    action: str,
    ids: Sequence[int],
    *,
    fingerprint: str,
    by: str,
    reason: str,
) -> BulkResult:
    """Act on the rows a preview of ``ids`` named, if they are still what it saw."""
    if not reason or not reason.strip():
        raise ConfigError("a reason is required: it is kept in each row's history")
    now = preview(connection, action, ids)
    if now.fingerprint != fingerprint:
        return BulkResult(
            action,
            stale="the rows changed since the preview (one moved, failed again or was settled): "
            "nothing was done; preview again",
        )
    out = BulkResult(action, refused=list(now.refused))
    chosen = [int(r["id"]) for r in now.to_act]
    if not chosen:
        return out
    if action == "replay":
        replay = actions.plan_replay(connection, chosen)
        for r in actions.execute_replay(connection, replay, by=by, reason=reason):
            message = "; ".join([r.message, *r.warnings])
            (out.done if r.done else out.refused).append((r.id, message))
    elif action == "cancel":
        cancel = actions.cancel_rows(connection, chosen, reason=reason, by=by)
        out.done.extend((i, f"row {i} cancelled ({state} -> cancelled)") for i, _k, _s, state in cancel.rows)
        out.refused.extend(cancel.refused)
    else:
        for row_id in chosen:
            try:
                r = actions.resolve(connection, row_id, failed_reason=reason, by=by, reason=reason)
                out.done.append((row_id, r.message))
            except OutboxError as exc:
                out.refused.append((row_id, str(exc)))
    return out
