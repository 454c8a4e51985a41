"""``outbox doctor MODULE --payloads``: every waiting row checked against the module's payload
models and upgrades (outbox.payloads), before new workers are rolled out.

Waiting rows are the ones a worker (or the reconciler's lookup) may still read: ``pending``,
``dispatched``, ``in_flight``, ``unknown`` and ``failed`` (a replay delivers it again; such
rows are reported apart, as a warning: a row failed for its payload stays failed, and must not
keep every later deploy red). Read in pages by id (keyset), on a read-only connection, never
holding one snapshot over the whole table. For a destination whose handler declares no model and
no upgrades only the version is checked, in one query: a row newer than its handler.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from ..handlers import Handler
from ..payloads import PayloadInvalid, PayloadTooNew

WAITING_STATES = ("pending", "dispatched", "in_flight", "unknown", "failed")
PAGE_ROWS = 1000

_TOO_NEW = text(
    """
    SELECT id, key, step, destination, state, payload_version
    FROM outbox_message
    WHERE destination = ANY(:destinations) AND state = ANY(:states) AND payload_version > 1
    ORDER BY id
    LIMIT :limit
    """
)

_PAGE = text(
    """
    SELECT id, key, step, destination, state, payload, payload_version
    FROM outbox_message
    WHERE id > :after AND destination = ANY(:destinations) AND state = ANY(:states)
    ORDER BY id
    LIMIT :limit
    """
)


@dataclass(frozen=True)
class Incompatible:
    id: int
    key: str
    step: str
    destination: str
    state: str
    version: int
    #: What does not fit: the validation message (fields named, values left out), or that the
    #: row is newer than the module's handler.
    problem: str


@dataclass
class PayloadReport:
    checked: Counter[str] = field(default_factory=Counter)
    #: Rows a worker would still deliver that it cannot (not ``failed``): the deploy must wait.
    incompatible: list[Incompatible] = field(default_factory=list)
    #: ``failed`` rows that a replay could not deliver either (up to ``stop_after``).
    failed: list[Incompatible] = field(default_factory=list)
    #: Destinations with a handler that declares neither a model nor upgrades: not read.
    unchecked: list[str] = field(default_factory=list)
    #: The scan stopped at ``stop_after`` incompatible rows; more may follow.
    stopped: bool = False


def check_payloads(
    conn: Connection,
    handlers: Mapping[str, Handler],
    *,
    stop_after: int = 20,
    progress: Callable[[int], None] | None = None,
) -> PayloadReport:
    """Prepare every waiting row's payload as its handler would; stop at ``stop_after``
    incompatible rows (the first ones, by id)."""
    report = PayloadReport()
    checked = {d: h for d, h in handlers.items() if h.checks_payloads}
    report.unchecked = sorted(set(handlers) - set(checked))
    if report.unchecked:
        # Version 1 handlers: only a row written for a newer release is a problem.
        for row in conn.execute(
            _TOO_NEW,
            {"destinations": report.unchecked, "states": list(WAITING_STATES), "limit": stop_after * 2},
        ):
            found = Incompatible(
                row.id,
                row.key,
                row.step,
                row.destination,
                row.state,
                row.payload_version,
                f"payload version {row.payload_version} is newer than this handler's (1)",
            )
            if not _note(report, found, stop_after):
                return report
    if not checked:
        return report
    after = 0
    params: dict[str, Any] = {
        "destinations": sorted(checked),
        "states": list(WAITING_STATES),
        "limit": PAGE_ROWS,
    }
    while True:
        rows = conn.execute(_PAGE, {**params, "after": after}).fetchall()
        if not rows:
            return report
        for row in rows:
            after = row.id
            report.checked[row.destination] += 1
            problem: str | None = None
            try:
                checked[row.destination].prepare(row.payload, row.payload_version)
            except PayloadTooNew as exc:
                problem = str(exc)
            except PayloadInvalid as exc:
                problem = str(exc)
            if problem is not None:
                found = Incompatible(
                    row.id, row.key, row.step, row.destination, row.state, row.payload_version, problem
                )
                if not _note(report, found, stop_after):
                    return report
        if progress is not None:
            progress(sum(report.checked.values()))


def _note(report: PayloadReport, found: Incompatible, stop_after: int) -> bool:
    """Add ``found`` to its list; False when the scan should stop (``stop_after`` rows a worker
    would still deliver were found)."""
    if found.state == "failed":
        if len(report.failed) < stop_after:
            report.failed.append(found)
        return True
    report.incompatible.append(found)
    if len(report.incompatible) >= stop_after:
        report.stopped = True
        return False
    return True


def stderr_progress(every_seconds: float = 1.0) -> Callable[[int], None] | None:
    """A progress line on a terminal's stderr (none when stderr is not one)."""
    if not sys.stderr.isatty():
        return None
    last = [0.0]

    def show(done: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_seconds:
            last[0] = now
            print(f"\rpayloads: {done:,} rows checked", end="", file=sys.stderr, flush=True)

    return show
