"""Commands for the person on call: look (status, show, failed, unknown, audit, doctor) and act
(replay, resolve).

Every action is one guarded statement per row (``UPDATE … WHERE id = :id AND state = …``), so a
row that moved since the operator looked is refused, never overwritten; who did it and why is
appended to the row's ``history``. Looking never writes: those commands run in read-only
transactions. Payloads may hold personal data, so they are only printed on request.

The functions below take a SQLAlchemy ``Connection`` and never commit: the caller owns the
transaction (and a NOTIFY sent by an action is delivered when it commits).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, text

from . import settings, states
from .audit import AuditReport, audit, format_table, parse_since
from .exceptions import ConfigError, InvalidTransition, NotFound, OutboxError
from .schema import NOTIFY_CHANNEL

__all__ = [
    "COMMANDS",
    "ActionResult",
    "AuditReport",
    "ListedRow",
    "RowDetail",
    "RowList",
    "StatusReport",
    "audit",
    "list_rows",
    "replay",
    "replay_destination",
    "resolve",
    "show",
    "status",
]

DEFAULT_LIST_LIMIT = 50

# -- status ------------------------------------------------------------------------------------------

# "Oldest pending age" is measured from when the row became due, not from when it was written:
# a row waiting out its retry backoff is not late, a due row nobody publishes is (stalled relay).
_STATUS = text(
    """
SELECT destination, state, count(*) AS n,
       EXTRACT(EPOCH FROM now() - min(available_at)
               FILTER (WHERE state = 'pending' AND available_at <= now())) AS oldest_pending_age
FROM outbox_message
GROUP BY destination, state
ORDER BY destination, state
"""
)


@dataclass
class StatusReport:
    generated_at: datetime
    #: destination → state → count (every state present, zeros included).
    counts: dict[str, dict[str, int]]
    #: destination → seconds the oldest due `pending` row has waited (None: none due).
    oldest_pending_age: dict[str, float | None]

    def totals(self) -> dict[str, int]:
        return {s: sum(c[s] for c in self.counts.values()) for s in states.ALL}

    @property
    def total(self) -> int:
        return sum(self.totals().values())

    @property
    def oldest_pending_age_seconds(self) -> float | None:
        ages = [a for a in self.oldest_pending_age.values() if a is not None]
        return max(ages) if ages else None

    def to_dict(self) -> dict[str, Any]:
        totals = self.totals()
        return {
            "generated_at": self.generated_at.isoformat(),
            "destinations": {
                d: {**c, "total": sum(c.values()), "oldest_pending_age_seconds": self.oldest_pending_age[d]}
                for d, c in self.counts.items()
            },
            "by_state": totals,
            "unknown": totals[states.UNKNOWN],
            "failed": totals[states.FAILED],
            "total": self.total,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
        }

    def render(self) -> str:
        if not self.counts:
            return "no outbox rows"
        totals = self.totals()
        rows: list[list[Any]] = [
            [d, *(c[s] for s in states.ALL), sum(c.values()), _age(self.oldest_pending_age[d])]
            for d, c in self.counts.items()
        ]
        rows.append(
            ["TOTAL", *(totals[s] for s in states.ALL), self.total, _age(self.oldest_pending_age_seconds)]
        )
        table = format_table(["destination", *states.ALL, "total", "oldest pending"], rows)
        summary = (
            f"unknown: {totals[states.UNKNOWN]}   failed: {totals[states.FAILED]}   total: {self.total}   "
            f"oldest due pending row: {_age(self.oldest_pending_age_seconds) or 'none'}"
        )
        return f"{table}\n\n{summary}"


def status(connection: Connection) -> StatusReport:
    """Counts by destination and state and the age of the oldest due pending row."""
    generated_at = connection.execute(text("SELECT now()")).scalar_one()
    counts: dict[str, dict[str, int]] = {}
    ages: dict[str, float | None] = {}
    for row in connection.execute(_STATUS):
        counts.setdefault(row.destination, dict.fromkeys(states.ALL, 0))[row.state] = int(row.n)
        if row.state == states.PENDING:
            ages[row.destination] = _seconds(row.oldest_pending_age)
    for d in counts:
        ages.setdefault(d, None)
    return StatusReport(generated_at, counts, ages)


# -- show --------------------------------------------------------------------------------------------

# Every column but the payload, whose size and top-level keys stand in for it: what is in it may
# be personal data, and an operator rarely needs more than its shape.
_ROW_COLUMNS = """
    id, key, step, destination, state, attempts, available_at, deadline, created_at,
    dispatched_at, claimed_at, lease_expires_at, completed_at, unknown_since, alerted_at,
    claim_token, provider_ref, response, last_error, history, releases,
    octet_length(payload::text) AS payload_bytes,
    CASE WHEN jsonb_typeof(payload) = 'object'
         THEN ARRAY(SELECT jsonb_object_keys(payload) ORDER BY 1) END AS payload_keys
"""
_SHOW_BY_ID = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE id = :id")
_SHOW_BY_KEY = text(f"SELECT {_ROW_COLUMNS} FROM outbox_message WHERE key = :key AND step = :step")
_PAYLOAD = text("SELECT payload FROM outbox_message WHERE id = :id")
_ATTEMPTS = text(
    """
SELECT attempt, claim_token, started_at, finished_at, outcome, http_status, error
FROM outbox_attempt WHERE message_id = :id ORDER BY started_at, id
"""
)


@dataclass
class RowDetail:
    row: dict[str, Any]
    attempts: list[dict[str, Any]]
    history: list[dict[str, Any]]
    #: Only when asked for (`--payload`).
    payload: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        row = dict(self.row)
        if self.payload is not None:
            row["payload"] = self.payload
        return {"row": row, "attempts": self.attempts, "history": self.history}

    def render(self) -> str:
        width = max(len(k) for k in self.row)
        lines = [
            f"{k.ljust(width)}  {_cell(v, long=True) if v is not None else '-'}" for k, v in self.row.items()
        ]
        if self.payload is not None:
            lines.append(f"{'payload'.ljust(width)}  {json.dumps(self.payload, ensure_ascii=False)}")
        lines += ["", f"attempts ({len(self.attempts)} fence rows):"]
        if self.attempts:
            headers = [
                "attempt",
                "claim_token",
                "started_at",
                "finished_at",
                "outcome",
                "http_status",
                "error",
            ]
            lines.append(
                _indent(format_table(headers, [[_cell(a[h]) for h in headers] for a in self.attempts]))
            )
        else:
            lines.append("  none: never claimed")
        lines += ["", f"history ({len(self.history)} operator actions):"]
        if self.history:
            keys = ["at", "by", "action", "from", "to", "reason"]
            extra = sorted({k for h in self.history for k in h} - set(keys))
            lines.append(
                _indent(
                    format_table(
                        keys + extra, [[_cell(h.get(k)) for k in keys + extra] for h in self.history]
                    )
                )
            )
        else:
            lines.append("  none")
        return "\n".join(lines)


def show(
    connection: Connection,
    row_id: int | None = None,
    *,
    key: str | None = None,
    step: str | None = None,
    payload: bool = False,
) -> RowDetail:
    """One row by id (or by ``key`` and ``step``) with its fence rows and history.

    Raises :class:`NotFound` when there is no such row.
    """
    if row_id is not None:
        found = connection.execute(_SHOW_BY_ID, {"id": row_id}).mappings().first()
        missing = f"no outbox row with id {row_id}"
    elif key is not None and step is not None:
        found = connection.execute(_SHOW_BY_KEY, {"key": key, "step": step}).mappings().first()
        missing = f"no outbox row with key {key!r} and step {step!r}"
    else:
        raise ConfigError("show needs an id, or a key and a step")
    if found is None:
        raise NotFound(missing)
    row = dict(found)
    history = list(row.pop("history") or [])
    attempts = [dict(a) for a in connection.execute(_ATTEMPTS, {"id": row["id"]}).mappings()]
    body = connection.execute(_PAYLOAD, {"id": row["id"]}).scalar_one() if payload else None
    return RowDetail(row, attempts, history, body)


# -- failed / unknown lists --------------------------------------------------------------------------

# Age is the time spent in the state, the number an on-call compares with alert thresholds:
# `unknown_since` for unknown rows, `completed_at` (when it failed) for failed rows.
_LIST = text(
    """
SELECT id, key, step, destination, attempts, created_at, last_error,
       EXTRACT(EPOCH FROM now() - COALESCE(
           CASE WHEN state = 'unknown' THEN unknown_since ELSE completed_at END, created_at)) AS age,
       count(*) OVER () AS matching
FROM outbox_message
WHERE state = :state AND (CAST(:destination AS text) IS NULL OR destination = CAST(:destination AS text))
ORDER BY COALESCE(CASE WHEN state = 'unknown' THEN unknown_since ELSE completed_at END, created_at), id
LIMIT :limit
"""
)
_DESTINATION_EXISTS = text("SELECT EXISTS (SELECT 1 FROM outbox_message WHERE destination = :d)")
_DESTINATIONS = text("SELECT DISTINCT destination FROM outbox_message ORDER BY 1")


@dataclass(frozen=True)
class ListedRow:
    id: int
    key: str
    step: str
    destination: str
    attempts: int
    created_at: datetime
    age_seconds: float | None
    last_error: str | None


@dataclass
class RowList:
    state: str
    destination: str | None
    rows: list[ListedRow]
    #: How many rows match, beyond the limit.
    matching: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "destination": self.destination,
            "matching": self.matching,
            "rows": [vars(r) for r in self.rows],
        }

    def render(self) -> str:
        where = f" for destination {self.destination}" if self.destination else ""
        if not self.rows:
            return f"no {self.state} rows{where}"
        table = format_table(
            ["id", "key", "step", "destination", "attempts", "age", "last_error"],
            [
                [r.id, r.key, r.step, r.destination, r.attempts, _age(r.age_seconds), _short(r.last_error)]
                for r in self.rows
            ],
        )
        more = (
            f"\nshowing {len(self.rows)} of {self.matching}; use --limit"
            if self.matching > len(self.rows)
            else ""
        )
        return f"{table}{more}"


def _require_destination(connection: Connection, destination: str) -> None:
    """A destination no row names is a typo, not an empty result; say which ones exist."""
    if connection.execute(_DESTINATION_EXISTS, {"d": destination}).scalar_one():
        return
    known = [r[0] for r in connection.execute(_DESTINATIONS)]
    raise NotFound(
        f"no outbox rows for destination {destination!r} (known: {', '.join(known) if known else 'none'})"
    )


def list_rows(
    connection: Connection, state: str, *, destination: str | None = None, limit: int = DEFAULT_LIST_LIMIT
) -> RowList:
    """Rows in ``state``, longest in that state first. Raises :class:`NotFound` for a destination
    no row names."""
    if state not in states.ALL:
        raise ConfigError(f"unknown state {state!r}; states are {', '.join(states.ALL)}")
    if limit < 1:
        raise ConfigError("--limit must be at least 1")
    if destination is not None:
        _require_destination(connection, destination)
    result = connection.execute(_LIST, {"state": state, "destination": destination, "limit": limit})
    rows, matching = [], 0
    for r in result:
        matching = int(r.matching)
        rows.append(
            ListedRow(
                int(r.id),
                r.key,
                r.step,
                r.destination,
                int(r.attempts),
                r.created_at,
                _seconds(r.age),
                r.last_error,
            )
        )
    return RowList(state, destination, rows, matching)


# -- replay and resolve ------------------------------------------------------------------------------

# `from` is the state the row had (SET expressions read the old row), `at` the database clock.
_HISTORY_ENTRY = """
history = history || jsonb_build_array(jsonb_build_object(
    'at', now(), 'by', CAST(:by AS text), 'action', CAST(:action AS text),
    'reason', CAST(:reason AS text), 'from', state, 'to', CAST(:to_state AS text)) || CAST(:extra AS jsonb))
"""

# claim_token and provider_ref stay: they are the evidence of the earlier attempts. The replayed
# row goes through the normal claim, which is what rules out a call for a row already sent.
_REPLAY_SET = (
    """
SET state = 'pending', attempts = 0, available_at = now(),
    dispatched_at = NULL, completed_at = NULL, alerted_at = NULL,
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
)
_REPLAY_RETURNING = "RETURNING id, deadline IS NOT NULL AND deadline <= now() AS past_deadline"
_REPLAY_ONE = text(
    f"UPDATE outbox_message {_REPLAY_SET} WHERE id = :id AND state = 'failed' {_REPLAY_RETURNING}"
)
_REPLAY_DESTINATION = text(
    f"UPDATE outbox_message {_REPLAY_SET} WHERE destination = :destination AND state = 'failed' "
    f"{_REPLAY_RETURNING}"
)

_RESOLVE_SENT = text(
    """
UPDATE outbox_message
SET state = 'sent', provider_ref = :ref, completed_at = now(), last_error = NULL,
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
)
# attempts stay: the earlier call is known not to have taken effect, but it counted.
_RESOLVE_NOT_SENT = text(
    """
UPDATE outbox_message
SET state = 'pending', available_at = now(), dispatched_at = NULL, completed_at = NULL,
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
)
_RESOLVE_FAILED = text(
    """
UPDATE outbox_message
SET state = 'failed', last_error = :error, completed_at = now(),
    unknown_since = NULL, lease_expires_at = NULL,
"""
    + _HISTORY_ENTRY
    + " WHERE id = :id AND state = 'unknown' RETURNING id"
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


def default_actor() -> str:
    """Who is acting: $USER, else the login name."""
    with contextlib.suppress(Exception):
        return os.environ.get("USER") or getpass.getuser()
    return "unknown"


def _history_params(action: str, to_state: str, by: str, reason: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "action": action,
        "to_state": to_state,
        "by": by,
        "reason": reason,
        "extra": json.dumps(extra),
    }


def _refusal(connection: Connection, row_id: int, wanted: str, verb: str) -> OutboxError:
    # Read only to explain a refusal: the guarded UPDATE already decided.
    current = connection.execute(_STATE_OF, {"id": row_id}).scalar_one_or_none()
    if current is None:
        return NotFound(f"no outbox row with id {row_id}")
    return InvalidTransition(f"row {row_id} is {current}, only {wanted} rows can be {verb}")


def _notify(connection: Connection) -> None:
    """Wake the relays; delivered when the caller commits (the insert trigger does the same)."""
    connection.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL})


def _replayed(row: Any) -> ActionResult:
    warnings = []
    if row.past_deadline:
        warnings.append(
            "its deadline has passed: the consumer will fail it again without calling the provider"
        )
    return ActionResult(int(row.id), True, f"row {row.id} replayed: failed -> pending", warnings)


def replay(
    connection: Connection, ids: Sequence[int], *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """``failed`` → ``pending`` for each id, attempts reset; other rows are refused untouched."""
    params = _history_params("replay", states.PENDING, by or default_actor(), reason)
    results = []
    for row_id in dict.fromkeys(ids):  # a repeated id is one request
        row = connection.execute(_REPLAY_ONE, {**params, "id": row_id}).first()
        if row is None:
            refusal = _refusal(connection, row_id, "failed", "replayed")
            results.append(ActionResult(row_id, False, str(refusal)))
        else:
            results.append(_replayed(row))
    if any(r.done for r in results):
        _notify(connection)
    return results


def replay_destination(
    connection: Connection, destination: str, *, by: str | None = None, reason: str | None = None
) -> list[ActionResult]:
    """Replay every ``failed`` row of ``destination``. Raises :class:`NotFound` for a destination
    no row names (a typo must not read as "nothing to replay")."""
    _require_destination(connection, destination)
    params = _history_params("replay", states.PENDING, by or default_actor(), reason)
    rows = connection.execute(_REPLAY_DESTINATION, {**params, "destination": destination}).all()
    results = sorted((_replayed(r) for r in rows), key=lambda r: r.id)
    if results:
        _notify(connection)
    return results


def resolve(
    connection: Connection,
    row_id: int,
    *,
    sent_ref: str | None = None,
    not_sent: bool = False,
    failed_reason: str | None = None,
    by: str | None = None,
    reason: str | None = None,
) -> ActionResult:
    """Settle an ``unknown`` row by hand, exactly one of: the provider has it (``sent_ref``), it
    certainly has not (``not_sent``: back to pending, attempts kept), or give up
    (``failed_reason``). Raises :class:`InvalidTransition` (or :class:`NotFound`) and changes
    nothing when the row is not ``unknown``."""
    chosen = [sent_ref is not None, not_sent, failed_reason is not None]
    if sum(chosen) != 1:
        raise ConfigError("resolve needs exactly one of --sent REF, --not-sent, --failed REASON")
    actor = by or default_actor()
    if sent_ref is not None:
        if not sent_ref.strip():
            raise ConfigError("--sent needs the provider's reference, e.g. --sent ch_123")
        statement, to_state = _RESOLVE_SENT, states.SENT
        params = {
            **_history_params("resolve", to_state, actor, reason, provider_ref=sent_ref),
            "ref": sent_ref,
        }
    elif not_sent:
        statement, to_state = _RESOLVE_NOT_SENT, states.PENDING
        params = _history_params("resolve", to_state, actor, reason)
    else:
        assert failed_reason is not None
        if not failed_reason.strip():
            raise ConfigError("--failed needs a reason the next reader can act on")
        statement, to_state = _RESOLVE_FAILED, states.FAILED
        params = {
            **_history_params("resolve", to_state, actor, reason, error=failed_reason),
            "error": failed_reason,
        }
    if connection.execute(statement, {**params, "id": row_id}).first() is None:
        raise _refusal(connection, row_id, "unknown", "resolved")
    if to_state == states.PENDING:
        _notify(connection)
    return ActionResult(row_id, True, f"row {row_id} resolved: unknown -> {to_state}")


# -- formatting helpers ------------------------------------------------------------------------------


def _seconds(value: Decimal | float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _short(value: str | None, width: int = 80) -> str | None:
    if value is None:
        return None
    flat = " ".join(value.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _cell(value: Any, *, long: bool = False) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=_json_default)
    if isinstance(value, str) and not long:
        return _short(value)
    return value


def _indent(block: str) -> str:
    return textwrap.indent(block, "  ")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _out(text: str) -> None:
    """Print to stdout; a reader that went away (``outbox failed | head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _print_json(data: Any) -> None:
    _out(json.dumps(data, indent=2, ensure_ascii=False, default=_json_default))


# -- the commands ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _connection(cfg: settings.Settings, *, write: bool = False) -> Iterator[Connection]:
    """A connection in one transaction: read-only with one snapshot for looking, committed on
    success for acting."""
    from .db import make_engine

    engine = make_engine(cfg.require_database_url(), connect_args={"application_name": "outbox ops"})
    try:
        if write:
            with engine.begin() as conn:
                yield conn
        else:
            options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            with engine.connect().execution_options(**options) as conn, conn.begin():
                yield conn
    finally:
        engine.dispose()


def _add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url", help="PostgreSQL URL, postgresql://… (default: $OUTBOX_DATABASE_URL)"
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _describe(parser: argparse.ArgumentParser, description: str) -> None:
    # cli.build_parser uses the one-line help as the description; the long one replaces it here.
    parser.description = textwrap.dedent(description).strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _by_and_reason(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", help="why, recorded in the row's history")
    parser.add_argument("--by", help="who, recorded in the row's history (default: $USER or the login name)")


def _err(message: str) -> None:
    print(f"outbox: {message}", file=sys.stderr)


# status


def _status_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Counts of outbox rows by destination and state, the unknown and failed counts, the total,
        and the oldest pending age: how long the longest-waiting *due* pending row has been due
        (rows waiting out a retry backoff are not late). A growing oldest pending age means no
        relay is publishing. Read-only.
        """,
    )
    _add_database_url(p)
    _add_json(p)


def _status_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    with _connection(cfg) as conn:
        report = status(conn)
    if args.json:
        _print_json(report.to_dict())
    else:
        _out(report.render())
    return 0


# show


def _show_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        One outbox row, by id (outbox show 42) or by business key and step
        (outbox show order:42 charge): every column, every attempt (the fence rows: attempt,
        claim token, started/finished, outcome, HTTP status, error) and the operator history.
        The payload is replaced by its size and top-level keys, since it may hold personal data;
        pass --payload to print it. Exit 1 when there is no such row.
        """,
    )
    p.add_argument("target", metavar="ID|KEY", help="the row id, or its business key (then give STEP)")
    p.add_argument("step", nargs="?", metavar="STEP", help="the step, with KEY: outbox show order:42 charge")
    p.add_argument(
        "--payload", action="store_true", help="also print the payload (may contain personal data)"
    )
    _add_database_url(p)
    _add_json(p)


def _show_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.step is None:
        lookup: dict[str, Any] = {
            "row_id": _parse_id(args.target, "to look a row up by key, give its step too")
        }
    else:
        lookup = {"key": args.target, "step": args.step}
    with _connection(cfg) as conn:
        detail = show(conn, **lookup, payload=args.payload)
    if args.json:
        _print_json(detail.to_dict())
    else:
        _out(detail.render())
    return 0


def _parse_id(raw: str, hint: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{raw!r} is not a row id; {hint}") from None
    if not 1 <= value < 2**63:
        raise ConfigError(f"{raw!r} is not a row id; ids are positive 64-bit integers")
    return value


# failed / unknown


def _list_arguments(state: str, description: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        _describe(p, description)
        p.add_argument("--destination", help="only rows of this destination (exit 1 if no row names it)")
        p.add_argument(
            "--limit",
            type=int,
            default=DEFAULT_LIST_LIMIT,
            help=f"at most N rows (default {DEFAULT_LIST_LIMIT})",
        )
        _add_database_url(p)
        _add_json(p)
        p.set_defaults(list_state=state)

    return add


def _list_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    with _connection(cfg) as conn:
        listed = list_rows(conn, args.list_state, destination=args.destination, limit=args.limit)
    if args.json:
        _print_json(listed.to_dict())
    else:
        _out(listed.render())
    return 0


# replay


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Give failed rows another chance: failed -> pending, attempts reset to 0, due now. Only
        failed rows move (each row is one guarded UPDATE … WHERE state = 'failed'); any other row
        is refused untouched, so a sent row can never be replayed. The replayed row goes through
        the normal claim, like a new one. The claim token and provider reference of the earlier
        attempts are kept, and who/when/why is appended to the row's history. The relay is woken
        with NOTIFY.

        outbox replay 41 42 --reason "card updated"     replay these rows
        outbox replay --destination payments.charge     replay every failed row of a destination

        Exit 1 if any requested row was refused or does not exist (the others are replayed).
        """,
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="row ids to replay")
    p.add_argument("--destination", help="replay every failed row of this destination instead")
    _by_and_reason(p)
    _add_database_url(p)
    _add_json(p)


def _replay_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if bool(args.ids) == bool(args.destination):
        raise ConfigError("replay takes row ids or --destination D, not both and not neither")
    ids = [_parse_id(raw, "replay takes row ids") for raw in args.ids]
    with _connection(cfg, write=True) as conn:
        if args.destination:
            results = replay_destination(conn, args.destination, by=args.by, reason=args.reason)
        else:
            results = replay(conn, ids, by=args.by, reason=args.reason)
    refused = [r for r in results if not r.done]
    replayed = len(results) - len(refused)
    if args.json:
        _print_json(
            {
                "destination": args.destination,
                "replayed": replayed,
                "refused": len(refused),
                "results": [r.to_dict() for r in results],
            }
        )
    else:
        for r in results:
            if r.done:
                _out(r.message + "".join(f" (warning: {w})" for w in r.warnings))
            else:
                _err(r.message)
        if args.destination:
            _out(f"replayed {replayed} failed row(s) of {args.destination}")
    return 1 if refused else 0


# resolve


def _resolve_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Settle an unknown row by hand once you have asked the provider (the reconciler does this
        itself when the destination has a lookup). Exactly one of:

          --sent REF       the provider has it: sent, with its reference REF
          --not-sent       the provider certainly has no record of it: back to pending, retried
                           now (attempts kept); the relay is woken with NOTIFY
          --failed REASON  give up: failed, with REASON as last_error (outbox replay can retry it)

        Only an unknown row moves (one guarded UPDATE … WHERE state = 'unknown'); any other row
        is refused untouched with exit 1. Who/when/why is appended to the row's history.
        """,
    )
    p.add_argument("id", metavar="ID", help="the row id")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--sent", metavar="REF", help="the provider's reference of the effect")
    how.add_argument("--not-sent", action="store_true", help="the call did not take effect: retry it")
    how.add_argument("--failed", metavar="REASON", help="give up with this reason")
    _by_and_reason(p)
    _add_database_url(p)
    _add_json(p)


def _resolve_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    row_id = _parse_id(args.id, "resolve takes one row id")
    with _connection(cfg, write=True) as conn:
        result = resolve(
            conn,
            row_id,
            sent_ref=args.sent,
            not_sent=args.not_sent,
            failed_reason=args.failed,
            by=args.by,
            reason=args.reason,
        )
    if args.json:
        _print_json(result.to_dict())
    else:
        _out(result.message)
    return 0


# doctor


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Check every invariant of the contract against the live database and Redis, one line per
        check (ok / FAIL with what to do / skip when an earlier failure prevents it):

          database      reachable
          schema        at the migration head (else: run `outbox migrate`)
          redis         reachable
          eviction      maxmemory-policy is not allkeys-* when maxmemory is set
          namespace     set, and holding no cache or session keys
          handlers      MODULE imports and its declarations hold (time_limit < lease, backoff > 0,
                        total backoff < key_ttl)                                  [with MODULE]
          destinations  every destination with non-terminal or failed rows has a handler
                                                                                  [with MODULE]
          leases        no in_flight row past its lease by more than a minute (else the
                        reconciler is not running)
          dispatched    no dispatched row older than twice OUTBOX_REDISPATCH_AFTER
          relay         no pending row due for more than a minute (else the relay is not running)

        Exit 0 only when every check is ok, 1 otherwise.
        """,
    )
    p.add_argument(
        "module", nargs="?", metavar="MODULE", help="handler module to check too, e.g. myapp.handlers"
    )
    _add_database_url(p)
    p.add_argument("--redis-url", help="Redis URL, redis://… (default: $OUTBOX_REDIS_URL)")
    p.add_argument(
        "--namespace", help="prefix of the broker's Redis keys (default: $OUTBOX_NAMESPACE or outbox)"
    )
    _add_json(p)


def _doctor_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from .doctor import run_checks

    checks = run_checks(cfg, args.module)
    healthy = all(c.ok for c in checks)
    if args.json:
        _print_json({"ok": healthy, "checks": [c.to_dict() for c in checks]})
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            _out(f"{c.status:<4}  {c.name.ljust(width)}  {c.detail}")
        failed = sum(1 for c in checks if c.status == "FAIL")
        _out("all checks passed" if healthy else f"{failed} check(s) failed")
    return 0 if healthy else 1


# audit


def _audit_arguments(p: argparse.ArgumentParser) -> None:
    _describe(
        p,
        """
        Prove there was no double call. Per destination: messages by state, attempts (fence
        rows, one per claim) against confirmed calls and sent rows, keys claimed more than once
        (retries, with examples), rows not yet terminal. Violations:

          - a sent row without the provider's reference
          - more than one attempt confirmed by the provider for one message
          - an attempt confirmed by the provider on a row that is not sent

        --since T limits the audit to messages written, claimed or settled since T, an ISO-8601
        timestamp (naive means UTC) or a duration back from now (30m, 24h, 7d). Read-only, one
        snapshot. Exit 0 when there is no violation (an empty database included), 1 otherwise.
        """,
    )
    p.add_argument(
        "--since", metavar="T", help="ISO-8601 timestamp or duration such as 24h or 7d (default: everything)"
    )
    _add_database_url(p)
    _add_json(p)


def _audit_run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    since = parse_since(args.since) if args.since else None
    with _connection(cfg) as conn:
        report = audit(conn, since)
    if args.json:
        _print_json(report.to_dict())
    else:
        _out(report.render())
    return 0 if report.ok else 1


COMMANDS: list[
    tuple[
        str,
        str,
        Callable[[argparse.ArgumentParser], None],
        Callable[[argparse.Namespace, settings.Settings], int],
    ]
] = [
    ("status", "counts by destination and state, oldest pending age", _status_arguments, _status_run),
    ("show", "one row with its attempts and history: show ID, or show KEY STEP", _show_arguments, _show_run),
    (
        "failed",
        "list failed rows (--destination, --limit)",
        _list_arguments(
            states.FAILED,
            """
            List failed rows, longest failed first: id, key, step, destination, attempts, age (time
            since it failed) and last error. Fix the cause, then `outbox replay`. Read-only.
            """,
        ),
        _list_run,
    ),
    (
        "unknown",
        "list unknown rows (--destination, --limit)",
        _list_arguments(
            states.UNKNOWN,
            """
            List unknown rows (the call may or may not have taken effect), longest unknown first:
            id, key, step, destination, attempts, age (time since it became unknown) and last
            error. Ask the provider, then `outbox resolve`. Read-only.
            """,
        ),
        _list_run,
    ),
    ("replay", "failed -> pending again: replay ID… or --destination D", _replay_arguments, _replay_run),
    (
        "resolve",
        "settle an unknown row: resolve ID --sent REF | --not-sent | --failed REASON",
        _resolve_arguments,
        _resolve_run,
    ),
    (
        "doctor",
        "check the contract's invariants against the database and Redis",
        _doctor_arguments,
        _doctor_run,
    ),
    (
        "audit",
        "attempts vs confirmed sends per destination; exit 1 on a violation",
        _audit_arguments,
        _audit_run,
    ),
]
