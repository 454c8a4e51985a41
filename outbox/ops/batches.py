"""Looking at a batch (:mod:`outbox.batches`): ``outbox batch show`` and ``outbox batch watch``.

Read-only: the caller owns the (read-only) transaction. While the batch is open its progress is
counted from its members; once finished, from the counts its finishing statement stored (members
may be purged after that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from .. import states
from ..exceptions import NotFound
from .values import printable

_BATCH = text(
    """
SELECT id, name, then_step, catch_step, created_at, finished_at, outcome, total, sent, failed,
       cancelled, written_id, problem, now() AS generated_at
FROM outbox_batch
WHERE (CAST(:id AS bigint) IS NOT NULL AND id = CAST(:id AS bigint))
   OR (CAST(:id AS bigint) IS NULL AND name = CAST(:name AS text))
"""
)
_MEMBERS = text("SELECT state, count(*) AS n FROM outbox_message WHERE batch_id = :id GROUP BY state")
_ROW = text(
    """
(SELECT id, state FROM outbox_message WHERE id = :id)
UNION ALL
(SELECT message_id, state FROM outbox_key_ledger WHERE message_id = :id)
LIMIT 1
"""
)

#: The groups a batch's progress is shown in, in order.
GROUPS = ("sent", "failed", "unknown", "waiting", "cancelled")


def _group(state: str) -> str:
    return "waiting" if state in states.WAITING else state


@dataclass
class BatchReport:
    """One batch: its members by group (sent, failed, unknown, waiting, cancelled) of ``total``,
    and, once finished, its outcome and the then/catch row it wrote."""

    id: int
    name: str
    created_at: datetime
    generated_at: datetime
    then_step: dict[str, Any] | None
    catch_step: dict[str, Any] | None
    counts: dict[str, int]
    total: int
    finished_at: datetime | None = None
    outcome: str | None = None
    #: The row its end wrote: ``{"step", "destination", "id", "state"}`` (id None: not written).
    written: dict[str, Any] | None = field(default=None)
    #: Why its end wrote no row although a step was declared (a row of that key and step existed).
    problem: str | None = None
    #: A finished batch's members as they are now, when they moved since (a failed member
    #: confirmed later, a replay): the stored counts are the ones its outcome was decided on.
    now: dict[str, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def done(self) -> int:
        return self.total - self.counts["waiting"] - self.counts["unknown"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "generated_at": self.generated_at,
            "total": self.total,
            "counts": self.counts,
            "finished_at": self.finished_at,
            "outcome": self.outcome,
            "then": self.then_step,
            "catch": self.catch_step,
            "written": self.written,
            "problem": self.problem,
            "members_now": self.now,
        }

    def line(self) -> str:
        """One line of progress: what ``batch watch`` prints at each refresh off a terminal."""
        parts = ", ".join(
            f"{self.counts[g]} {g}" for g in GROUPS if self.counts[g] or g in ("sent", "failed")
        )
        head = f"batch {printable(self.name)}: {self.done}/{self.total} done ({parts})"
        return f"{head}; {self.ending()}" if self.finished else head

    def ending(self) -> str:
        """How it ended (or will end), for a human."""
        if not self.finished:
            return "open: once every member is sent, failed or cancelled, the reconciler ends it"
        step = self.written
        if step is None:
            ended = f"finished {self.outcome} (no {self.outcome} step declared)"
        elif step["id"] is None:
            ended = f"finished {self.outcome}, but {self.problem or 'its row is missing'}"
        else:
            where = f"row {step['id']}, {step['state'] or 'purged'}"
            ended = f"finished {self.outcome}: wrote step {step['step']} to {step['destination']} ({where})"
        if self.now is not None:
            moved = ", ".join(f"{self.now[g]} {g}" for g in GROUPS if self.now[g])
            ended += f"; its members moved since: now {moved}"
        return ended


def batch_report(
    connection: Connection, *, batch_id: int | None = None, name: str | None = None
) -> BatchReport:
    """The batch by id or by name. Raises :class:`NotFound` when there is none."""
    found = connection.execute(_BATCH, {"id": batch_id, "name": name}).mappings().first()
    if found is None:
        raise NotFound(f"no batch {batch_id if batch_id is not None else repr(name)}")
    live = dict.fromkeys(GROUPS, 0)
    for state, n in connection.execute(_MEMBERS, {"id": found["id"]}).all():
        live[_group(state)] += int(n)
    counts, now = live, None
    if found["finished_at"] is not None:
        counts = dict.fromkeys(GROUPS, 0)
        counts.update(sent=found["sent"], failed=found["failed"], cancelled=found["cancelled"])
        # Purged members are gone from `live`; moved ones show as a difference of groups.
        if live["failed"] != counts["failed"] or any(live[g] for g in ("unknown", "waiting")):
            now = live
    total = int(found["total"]) if found["finished_at"] is not None else sum(counts.values())
    written = None
    if found["outcome"] is not None:
        step = found["then_step"] if found["outcome"] == "then" else found["catch_step"]
        if step is not None:
            row = (
                connection.execute(_ROW, {"id": found["written_id"]}).first()
                if found["written_id"] is not None
                else None
            )
            written = {
                "step": step["step"],
                "destination": step["destination"],
                "id": int(row.id) if row is not None else found["written_id"],
                "state": row.state if row is not None else None,
            }
    return BatchReport(
        id=int(found["id"]),
        name=found["name"],
        created_at=found["created_at"],
        generated_at=found["generated_at"],
        then_step=found["then_step"],
        catch_step=found["catch_step"],
        counts=counts,
        total=total,
        finished_at=found["finished_at"],
        outcome=found["outcome"],
        written=written,
        problem=found["problem"],
        now=now,
    )
