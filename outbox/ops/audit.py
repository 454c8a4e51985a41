"""``outbox audit``: the table an operator reads to prove there was no double call.

It compares, per destination, the attempt rows (one per claim, so one per possible provider call)
with the confirmed sends, and lists what must never happen:

* a ``sent`` row without the provider's reference (nothing to reconcile the charge with);
* more than one attempt recorded as confirmed for one message (the provider confirmed twice);
* an attempt recorded as confirmed on a row that is not ``sent`` (an effect the database denies);
* a call that may have taken effect (an ambiguous or confirmed outcome, ``outbox.outcomes``)
  followed by a new call of the same row without a settlement in between (a lookup's "not
  found", ``resolve --not-sent``), a forced replay, or an idempotent retry: the second call may
  have charged again.

"Confirmed" counts ``superseded:sent`` too: a late worker whose row had been taken over still
got a confirmation from the provider, so that call took effect even though it lost the race to
record it. An attempt row whose outcome is ``released`` (a claim given back without a call) is not
an attempt and is not counted. Rows purged after retention take their attempts with them (``ON
DELETE CASCADE``), but the purge leaves each key in the key ledger with its counts (claims,
confirmed claims, ambiguous history, final state, reference): the audit counts those purged keys
too, for as long as the ledger keeps them (``OUTBOX_LEDGER_HORIZON``), and the same violations
apply to them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

from .. import outcomes, states
from ..exceptions import ConfigError
from ..settings import parse_seconds

#: Fence outcomes meaning the provider confirmed the call (see the module docstring).
CONFIRMED_OUTCOMES = ("sent", "superseded:sent")
#: How many multi-claimed keys the report names, and how many violating rows it lists.
EXAMPLE_LIMIT = 10
VIOLATION_LIST_LIMIT = 200

SENT_WITHOUT_REF = "sent_without_provider_ref"
DOUBLE_CONFIRMED = "confirmed_more_than_once"
CONFIRMED_NOT_SENT = "confirmed_attempt_on_unsent_row"
RECALLED_UNSETTLED = "called_again_after_an_unsettled_ambiguous_call"

# A call that may have taken effect (ambiguous or confirmed) followed by a newer call of the same
# row with nothing in between that made the new call safe: a lookup's "not found", an operator's
# `resolve --not-sent`, a forced replay, or an idempotent destination (outbox.outcomes).
_RECALLED = f"""EXISTS (SELECT 1 FROM outbox_attempt b
           WHERE b.message_id = a.message_id AND {outcomes.recalled_without_settlement_sql("a", "b")})"""

# A message is in scope when anything happened to it since T: written, settled, or claimed. A row
# written last week and charged twice yesterday must show up in `--since 24h`.
_SCOPE = f"""
scope AS (
    SELECT m.id, m.key, m.step, m.destination, m.state, m.provider_ref
    FROM outbox_message m
    WHERE CAST(:since AS timestamptz) IS NULL
       OR m.created_at >= CAST(:since AS timestamptz)
       OR m.completed_at >= CAST(:since AS timestamptz)
       OR EXISTS (SELECT 1 FROM outbox_attempt a
                  WHERE a.message_id = m.id AND a.started_at >= CAST(:since AS timestamptz))
),
fence AS (
    SELECT a.message_id,
           -- A released claim made no call: it is on the fence for the record, not counted.
           count(*) FILTER (WHERE a.outcome IS DISTINCT FROM 'released') AS claims,
           count(*) FILTER (WHERE a.outcome IN ('sent', 'superseded:sent')) AS confirmed,
           count(*) FILTER (WHERE a.outcome = 'superseded:sent') AS superseded_confirmed,
           count(*) FILTER (WHERE {_RECALLED}) AS recalled,
           count(*) FILTER (WHERE a.settled = '{outcomes.OPERATOR_FORCED}') AS forced
    FROM outbox_attempt a JOIN scope s ON s.id = a.message_id
    GROUP BY a.message_id
)
"""

_BY_DESTINATION = text(
    "WITH"
    + _SCOPE
    + """
SELECT s.destination, s.state,
       count(*) AS messages,
       COALESCE(sum(f.claims), 0) AS attempts,
       COALESCE(sum(f.confirmed), 0) AS confirmed_calls,
       count(*) FILTER (WHERE f.claims > 1) AS claimed_more_than_once,
       count(*) FILTER (WHERE s.state = 'sent' AND COALESCE(s.provider_ref, '') = '')
           AS sent_without_ref,
       count(*) FILTER (WHERE f.confirmed > 1) AS double_confirmed,
       count(*) FILTER (WHERE f.confirmed >= 1 AND s.state <> 'sent') AS confirmed_not_sent,
       count(*) FILTER (WHERE f.recalled > 0) AS recalled_unsettled,
       count(*) FILTER (WHERE f.forced > 0) AS forced_replays
FROM scope s LEFT JOIN fence f ON f.message_id = s.id
GROUP BY s.destination, s.state
"""
)

_MULTI_CLAIMED = text(
    "WITH"
    + _SCOPE
    + """
SELECT s.id, s.key, s.step, s.destination, s.state, f.claims
FROM scope s JOIN fence f ON f.message_id = s.id
WHERE f.claims > 1
ORDER BY f.claims DESC, s.id
LIMIT :limit
"""
)

_VIOLATIONS = text(
    "WITH"
    + _SCOPE
    + """
SELECT s.id, s.key, s.step, s.destination, s.state, s.provider_ref,
       COALESCE(f.confirmed, 0) AS confirmed, COALESCE(f.superseded_confirmed, 0) AS superseded,
       COALESCE(f.recalled, 0) AS recalled
FROM scope s LEFT JOIN fence f ON f.message_id = s.id
WHERE (s.state = 'sent' AND COALESCE(s.provider_ref, '') = '')
   OR f.confirmed > 1
   OR (f.confirmed >= 1 AND s.state <> 'sent')
   OR f.recalled > 0
ORDER BY s.id
LIMIT :limit
"""
)


# Purged keys, in scope by the time their row completed (the only time the ledger keeps).
_LEDGER_SCOPE = """
FROM outbox_key_ledger l
WHERE CAST(:since AS timestamptz) IS NULL OR l.completed_at >= CAST(:since AS timestamptz)
"""

_LEDGER_BY_DESTINATION = text(
    """
SELECT l.destination, l.state,
       count(*) AS keys,
       COALESCE(sum(l.attempts), 0) AS attempts,
       count(*) FILTER (WHERE l.attempts > 1) AS claimed_more_than_once,
       count(*) FILTER (WHERE l.state = 'sent' AND COALESCE(l.provider_ref, '') = '') AS sent_without_ref,
       count(*) FILTER (WHERE l.confirmed > 1) AS double_confirmed,
       count(*) FILTER (WHERE l.confirmed >= 1 AND l.state <> 'sent') AS confirmed_not_sent,
       count(*) FILTER (WHERE l.ambiguous) AS ambiguous
"""
    + _LEDGER_SCOPE
    + "GROUP BY l.destination, l.state"
)

_LEDGER_VIOLATIONS = text(
    """
SELECT l.message_id AS id, l.key, l.step, l.destination, l.state, l.provider_ref,
       l.confirmed, 0 AS superseded,
       -- Rows are purged only once sent or cancelled; a re-call after an unsettled ambiguous
       -- call is reported while the row lives, and the ledger keeps only `ambiguous`.
       0 AS recalled
"""
    + _LEDGER_SCOPE
    + """
  AND ((l.state = 'sent' AND COALESCE(l.provider_ref, '') = '')
       OR l.confirmed > 1
       OR (l.confirmed >= 1 AND l.state <> 'sent'))
ORDER BY l.completed_at, l.key, l.step
LIMIT :limit
"""
)


@dataclass
class LedgerAudit:
    """One destination's purged keys, from the key ledger."""

    states: dict[str, int] = field(default_factory=lambda: dict.fromkeys(states.TERMINAL, 0))
    attempts: int = 0
    claimed_more_than_once: int = 0
    sent_without_ref: int = 0
    double_confirmed: int = 0
    confirmed_not_sent: int = 0
    #: Keys whose history held an unknown outcome or an operator's resolution of one.
    ambiguous: int = 0

    @property
    def keys(self) -> int:
        return sum(self.states.values())

    @property
    def violations(self) -> int:
        return self.sent_without_ref + self.double_confirmed + self.confirmed_not_sent

    def add(self, other: LedgerAudit) -> None:
        for s, n in other.states.items():
            self.states[s] = self.states.get(s, 0) + n
        self.attempts += other.attempts
        self.claimed_more_than_once += other.claimed_more_than_once
        self.sent_without_ref += other.sent_without_ref
        self.double_confirmed += other.double_confirmed
        self.confirmed_not_sent += other.confirmed_not_sent
        self.ambiguous += other.ambiguous

    def to_dict(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "by_state": dict(self.states),
            "attempts": self.attempts,
            "claimed_more_than_once": self.claimed_more_than_once,
            "sent_without_provider_ref": self.sent_without_ref,
            "confirmed_more_than_once": self.double_confirmed,
            "confirmed_attempt_on_unsent_row": self.confirmed_not_sent,
            "ambiguous": self.ambiguous,
        }


@dataclass
class DestinationAudit:
    destination: str
    states: dict[str, int] = field(default_factory=lambda: dict.fromkeys(states.ALL, 0))
    #: Attempt rows: one per claim, i.e. one per call that may have reached the provider.
    attempts: int = 0
    #: Attempt rows whose outcome says the provider confirmed the call.
    confirmed_calls: int = 0
    claimed_more_than_once: int = 0
    sent_without_ref: int = 0
    double_confirmed: int = 0
    confirmed_not_sent: int = 0
    #: Keys whose rows were purged, still in the key ledger.
    purged: LedgerAudit = field(default_factory=LedgerAudit)
    #: Rows called again after a call that may have taken effect, with no settlement between.
    recalled_unsettled: int = 0
    #: Rows an operator replayed with --force over such a call (an accepted risk, not a violation).
    forced_replays: int = 0

    @property
    def messages(self) -> int:
        return sum(self.states.values())

    @property
    def sent(self) -> int:
        return self.states[states.SENT]

    @property
    def not_terminal(self) -> int:
        return sum(n for s, n in self.states.items() if s not in states.TERMINAL)

    @property
    def violations(self) -> int:
        return (
            self.sent_without_ref
            + self.double_confirmed
            + self.confirmed_not_sent
            + self.purged.violations
            + self.recalled_unsettled
        )

    def add(self, other: DestinationAudit) -> None:
        for s, n in other.states.items():
            self.states[s] += n
        self.attempts += other.attempts
        self.confirmed_calls += other.confirmed_calls
        self.claimed_more_than_once += other.claimed_more_than_once
        self.sent_without_ref += other.sent_without_ref
        self.double_confirmed += other.double_confirmed
        self.confirmed_not_sent += other.confirmed_not_sent
        self.purged.add(other.purged)
        self.recalled_unsettled += other.recalled_unsettled
        self.forced_replays += other.forced_replays

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "by_state": dict(self.states),
            "attempts": self.attempts,
            "confirmed_calls": self.confirmed_calls,
            "sent": self.sent,
            "claimed_more_than_once": self.claimed_more_than_once,
            "sent_without_provider_ref": self.sent_without_ref,
            "confirmed_more_than_once": self.double_confirmed,
            "confirmed_attempt_on_unsent_row": self.confirmed_not_sent,
            RECALLED_UNSETTLED: self.recalled_unsettled,
            "forced_replays": self.forced_replays,
            "not_terminal": self.not_terminal,
            "purged_keys": self.purged.to_dict(),
        }


@dataclass(frozen=True)
class ClaimExample:
    id: int
    key: str
    step: str
    destination: str
    state: str
    claims: int


@dataclass(frozen=True)
class Violation:
    kind: str
    id: int
    key: str
    step: str
    destination: str
    state: str
    detail: str


@dataclass
class AuditReport:
    generated_at: datetime
    since: datetime | None
    destinations: dict[str, DestinationAudit]
    multi_claimed_examples: list[ClaimExample]
    #: Up to VIOLATION_LIST_LIMIT violating rows; the exact counts are in `destinations`.
    violations: list[Violation]

    @property
    def totals(self) -> DestinationAudit:
        total = DestinationAudit("TOTAL")
        for d in self.destinations.values():
            total.add(d)
        return total

    @property
    def violation_count(self) -> int:
        return self.totals.violations

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "generated_at": self.generated_at.isoformat(),
            "since": self.since.isoformat() if self.since else None,
            "destinations": {name: d.to_dict() for name, d in sorted(self.destinations.items())},
            "totals": self.totals.to_dict(),
            "claimed_more_than_once_examples": [vars(e) for e in self.multi_claimed_examples],
            "violation_count": self.violation_count,
            "violations": [vars(v) for v in self.violations],
        }


def parse_since(value: str, *, now: datetime | None = None) -> datetime:
    """``--since``: an ISO-8601 timestamp (naive means UTC) or a duration back from now (``24h``)."""
    raw = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?\s*(ms|s|m|h|d)?", raw):
        return (now or datetime.now(UTC)) - timedelta(seconds=parse_seconds(raw, "--since"))
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise ConfigError(
            f"--since {value!r} is neither an ISO-8601 timestamp (2025-01-31T12:00:00+00:00) "
            "nor a duration (30m, 24h, 7d)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _since(since: datetime | timedelta | str | None) -> datetime | None:
    if since is None or isinstance(since, datetime):
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        return since
    if isinstance(since, timedelta):
        return datetime.now(UTC) - since
    return parse_since(since)


def _violations_of(row: Any) -> list[Violation]:
    found = []

    def add(kind: str, detail: str) -> None:
        found.append(Violation(kind, int(row.id), row.key, row.step, row.destination, row.state, detail))

    if row.state == states.SENT and not row.provider_ref:
        add(SENT_WITHOUT_REF, "sent without the provider's reference")
    superseded = f" ({row.superseded} by a claim that had been taken over)" if row.superseded else ""
    if row.confirmed > 1:
        add(
            DOUBLE_CONFIRMED,
            f"{row.confirmed} attempts confirmed by the provider{superseded}: a double call; "
            "unless the provider deduplicated on the Idempotency-Key, refund one",
        )
    if row.confirmed >= 1 and row.state != states.SENT:
        add(
            CONFIRMED_NOT_SENT,
            f"an attempt was confirmed by the provider{superseded} but the row is {row.state}; "
            "check the provider and `outbox resolve`/settle it by hand",
        )
    if row.recalled:
        add(
            RECALLED_UNSETTLED,
            f"called again after {row.recalled} call(s) that may have taken effect, with no lookup "
            "'not found' or `resolve --not-sent` in between: check the provider for two charges",
        )
    return found


def audit(connection: Connection, since: datetime | timedelta | str | None = None) -> AuditReport:
    """Audit the outbox rows (those with activity since ``since``, or all).

    Runs a few read-only queries on ``connection``; open it with
    ``execution_options(isolation_level="REPEATABLE READ")`` for one consistent snapshot (the
    command does).
    """
    moment = _since(since)
    params: dict[str, Any] = {"since": moment}
    generated_at = connection.execute(text("SELECT now()")).scalar_one()
    destinations: dict[str, DestinationAudit] = {}
    for row in connection.execute(_BY_DESTINATION, params):
        d = destinations.setdefault(row.destination, DestinationAudit(row.destination))
        d.states[row.state] = d.states.get(row.state, 0) + int(row.messages)
        d.attempts += int(row.attempts)
        d.confirmed_calls += int(row.confirmed_calls)
        d.claimed_more_than_once += int(row.claimed_more_than_once)
        d.sent_without_ref += int(row.sent_without_ref)
        d.double_confirmed += int(row.double_confirmed)
        d.confirmed_not_sent += int(row.confirmed_not_sent)
        d.recalled_unsettled += int(row.recalled_unsettled)
        d.forced_replays += int(row.forced_replays)
    examples = [
        ClaimExample(int(r.id), r.key, r.step, r.destination, r.state, int(r.claims))
        for r in connection.execute(_MULTI_CLAIMED, {**params, "limit": EXAMPLE_LIMIT})
    ]
    for row in connection.execute(_LEDGER_BY_DESTINATION, params):
        purged = destinations.setdefault(row.destination, DestinationAudit(row.destination)).purged
        purged.states[row.state] = purged.states.get(row.state, 0) + int(row.keys)
        purged.attempts += int(row.attempts)
        purged.claimed_more_than_once += int(row.claimed_more_than_once)
        purged.sent_without_ref += int(row.sent_without_ref)
        purged.double_confirmed += int(row.double_confirmed)
        purged.confirmed_not_sent += int(row.confirmed_not_sent)
        purged.ambiguous += int(row.ambiguous)
    violations = [
        v
        for r in connection.execute(_VIOLATIONS, {**params, "limit": VIOLATION_LIST_LIMIT})
        for v in _violations_of(r)
    ]
    violations += [
        dataclasses.replace(v, detail=f"{v.detail} (row purged; from the key ledger)")
        for r in connection.execute(_LEDGER_VIOLATIONS, {**params, "limit": VIOLATION_LIST_LIMIT})
        for v in _violations_of(r)
    ][: max(0, VIOLATION_LIST_LIMIT - len(violations))]
    return AuditReport(generated_at, moment, destinations, examples, violations)
