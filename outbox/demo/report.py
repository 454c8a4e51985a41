"""What ``outbox demo`` measures: progress while it runs, and the audit that decides its exit.

The audit trusts nobody's summary. It joins each order of this run to its outbox row and to
the provider simulator's own effect counter for that row's Idempotency-Key, and calls the run
clean only if every order was charged exactly once (with the provider's reference stored) or
ended failed/cancelled with a reason and no charge, and no charge exists without an order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from sqlalchemy import Connection, text

from .. import states
from ..ops.audit import AuditReport, audit

#: Table names the demo accepts: quoted nowhere, so kept to plain identifiers.
TABLE_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}\Z")


@dataclass(frozen=True)
class RunScope:
    """Which rows belong to this run of the demo (the database may hold earlier runs')."""

    orders_table: str
    key_prefix: str
    destination: str
    #: Orders with a larger id, and outbox rows with a larger id, were written by this run.
    order_floor: int
    message_floor: int
    #: Database time when the run began, for ``outbox.ops.audit(since=…)``.
    started_at: datetime

    def __post_init__(self) -> None:
        if not TABLE_NAME_RE.match(self.orders_table):
            raise ValueError(f"orders table name {self.orders_table!r} is not a plain identifier")

    def idempotency_key(self, order_id: int) -> str:
        return f"{self.key_prefix}:{order_id}:charge"


def floors(conn: Connection, orders_table: str) -> tuple[int, int]:
    """The largest order id and outbox row id before the run starts."""
    if not TABLE_NAME_RE.match(orders_table):
        raise ValueError(f"orders table name {orders_table!r} is not a plain identifier")
    order_floor = conn.execute(text(f"SELECT COALESCE(max(id), 0) FROM {orders_table}")).scalar_one()
    message_floor = conn.execute(text("SELECT COALESCE(max(id), 0) FROM outbox_message")).scalar_one()
    return int(order_floor), int(message_floor)


def orders_written(conn: Connection, scope: RunScope) -> int:
    sql = text(f"SELECT count(*) FROM {scope.orders_table} WHERE id > :floor")
    return int(conn.execute(sql, {"floor": scope.order_floor}).scalar_one())


_STATES = text(
    """
SELECT state, count(*) FROM outbox_message
WHERE id > :floor AND destination = :destination AND step = 'charge'
GROUP BY state
"""
)


def state_counts(conn: Connection, scope: RunScope) -> dict[str, int]:
    counts = dict.fromkeys(states.ALL, 0)
    params = {"floor": scope.message_floor, "destination": scope.destination}
    for state, n in conn.execute(_STATES, params):
        counts[state] = int(n)
    return counts


# -- the final audit -----------------------------------------------------------------------------


@dataclass
class DemoAudit:
    orders: int = 0
    rows: int = 0
    by_state: dict[str, int] = field(default_factory=lambda: dict.fromkeys(states.ALL, 0))
    provider_charges: int = 0
    charged_twice: list[str] = field(default_factory=list)
    #: Orders not settled as "one charge, reference stored" or "failed/cancelled with a reason".
    unsettled: list[str] = field(default_factory=list)
    #: Provider charges whose key belongs to no order of this run.
    orphan_charges: list[str] = field(default_factory=list)
    failed_with_reason: int = 0
    #: Rows that went through `unknown` (an ambiguous answer, or a worker killed mid-call).
    went_unknown: int = 0
    #: Rows the reconciler settled through the provider lookup, now terminal.
    resolved_by_reconciler: int = 0
    lookup_found: int = 0
    lookup_not_found: int = 0
    provider_faults: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False
    ops_report: AuditReport | None = None

    @property
    def not_terminal(self) -> int:
        return sum(n for s, n in self.by_state.items() if s not in states.TERMINAL)

    @property
    def ops_ok(self) -> bool:
        return self.ops_report is None or bool(self.ops_report.ok)

    @property
    def problems(self) -> list[str]:
        found = []
        if self.timed_out:
            found.append("timed out before every row was terminal")
        if self.charged_twice:
            found.append(
                f"{len(self.charged_twice)} key(s) charged twice: {', '.join(self.charged_twice[:5])}"
            )
        if self.not_terminal:
            found.append(f"{self.not_terminal} row(s) not terminal")
        if self.rows != self.orders:
            found.append(f"{self.orders} orders but {self.rows} outbox rows")
        found.extend(self.unsettled[:10])
        if len(self.unsettled) > 10:
            found.append(f"… and {len(self.unsettled) - 10} more unsettled orders")
        if self.orphan_charges:
            found.append(
                f"{len(self.orphan_charges)} charge(s) without an order: {', '.join(self.orphan_charges[:5])}"
            )
        if not self.ops_ok:
            found.append("outbox audit reports violations (below)")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems

    def rows_for_table(self, elapsed_seconds: float) -> list[tuple[str, str, str]]:
        """(what, value, expectation or detail) for the audit table, plain or rich."""
        detail = (
            f"lookup found the charge: {self.lookup_found}, found none so retried: {self.lookup_not_found}"
        )
        return [
            ("orders written", str(self.orders), ""),
            ("provider charges", str(self.provider_charges), ""),
            ("keys charged twice", str(len(self.charged_twice)), "must be 0"),
            ("rows not terminal", str(self.not_terminal), "must be 0"),
            ("orders not settled exactly once", str(len(self.unsettled)), "must be 0"),
            ("charges without an order", str(len(self.orphan_charges)), "must be 0"),
            ("failed with a reason, not charged", str(self.failed_with_reason), ""),
            ("rows that went through unknown", str(self.went_unknown), ""),
            ("unknowns resolved by the reconciler", str(self.resolved_by_reconciler), detail),
            ("elapsed", f"{elapsed_seconds:.1f} s", ""),
        ]

    def render_plain(self, elapsed_seconds: float) -> str:
        rows = self.rows_for_table(elapsed_seconds)
        what = max(len(r[0]) for r in rows)
        value = max(len(r[1]) for r in rows)
        return "\n".join(f"  {a.ljust(what)}  {b.rjust(value)}  {c}".rstrip() for a, b, c in rows)


_ORDERS = """
SELECT o.id AS order_id, m.id AS row_id, m.state, m.provider_ref, m.last_error,
       m.unknown_since IS NOT NULL
         OR EXISTS (SELECT 1 FROM outbox_attempt a
                    WHERE a.message_id = m.id AND a.outcome IN ('unknown', 'lease_expired'))
         AS went_unknown,
       COALESCE(m.history @> CAST('[{{"by": "reconciler", "action": "lookup", "result": "found"}}]' AS jsonb),
                false) AS lookup_found,
       COALESCE(m.history @> CAST('[{{"by": "reconciler", "action": "lookup", "result": "not_found"}}]'
                                  AS jsonb), false) AS lookup_not_found
FROM {table} o
LEFT JOIN outbox_message m
  ON m.key = :prefix || ':' || o.id::text AND m.step = 'charge' AND m.id > :message_floor
WHERE o.id > :order_floor
ORDER BY o.id
"""

_ROWS = text(
    """
SELECT count(*) FROM outbox_message
WHERE id > :floor AND destination = :destination AND step = 'charge'
"""
)


def final_audit(
    conn: Connection,
    scope: RunScope,
    provider: httpx.Client,
    *,
    timed_out: bool = False,
) -> DemoAudit:
    """Compare the database with the provider's own counters; read-only."""
    result = DemoAudit(timed_out=timed_out)
    stats = provider.get("/_stats").raise_for_status().json()
    effects: dict[str, int] = {k: int(v) for k, v in stats["effects"].items()}
    result.provider_faults = {k: int(v) for k, v in stats.get("faults", {}).items() if v}
    result.by_state = state_counts(conn, scope)
    result.rows = int(
        conn.execute(_ROWS, {"floor": scope.message_floor, "destination": scope.destination}).scalar_one()
    )
    params = {
        "prefix": scope.key_prefix,
        "order_floor": scope.order_floor,
        "message_floor": scope.message_floor,
    }
    known_keys: set[str] = set()
    for r in conn.execute(text(_ORDERS.format(table=scope.orders_table)), params):
        result.orders += 1
        key = scope.idempotency_key(r.order_id)
        known_keys.add(key)
        charges = effects.get(key, 0)
        if charges > 1:
            result.charged_twice.append(key)
        if r.row_id is None:
            result.unsettled.append(f"order {r.order_id} has no outbox row")
            continue
        result.went_unknown += bool(r.went_unknown)
        if r.lookup_found or r.lookup_not_found:
            if r.state in states.TERMINAL:
                result.resolved_by_reconciler += 1
            result.lookup_found += bool(r.lookup_found)
            result.lookup_not_found += bool(r.lookup_not_found)
        if r.state == states.SENT:
            if charges == 0:
                result.unsettled.append(f"order {r.order_id} is sent but the provider has no charge")
            elif charges == 1:
                # The stored reference must be the provider's charge for this very key.
                charge = provider.get("/charges", params={"idempotency_key": key})
                ref = charge.json().get("id") if charge.status_code == 200 else None
                if ref != r.provider_ref:
                    result.unsettled.append(
                        f"order {r.order_id}: stored reference {r.provider_ref!r}, provider has {ref!r}"
                    )
        elif r.state in (states.FAILED, states.CANCELLED):
            if charges:
                result.unsettled.append(f"order {r.order_id} is {r.state} but was charged {charges}x")
            elif r.state == states.FAILED and not r.last_error:
                result.unsettled.append(f"order {r.order_id} failed without a reason")
            else:
                result.failed_with_reason += 1
    result.provider_charges = sum(effects.values())
    result.orphan_charges = sorted(k for k in effects if k not in known_keys)
    return result


def ops_audit(conn: Connection, since: datetime) -> AuditReport:
    """``outbox audit`` over the run's time window."""
    return audit(conn, since=since)


def breaker_state(conn: Connection, destination: str) -> str:
    """The destination's circuit breaker, in words, for the progress display."""
    row = conn.execute(
        text(
            "SELECT breaker_opened_at IS NOT NULL, breaker_open_until <= now(), "
            "COALESCE(breaker_probe_until > now(), false), breaker_probes, breaker_trips "
            "FROM outbox_destination WHERE destination = :d"
        ),
        {"d": destination},
    ).first()
    if row is None or not row[4]:
        return "closed"
    opened, half, probing, probes, trips = row
    if not opened:
        return f"closed (tripped {trips}x)"
    now = "a probe under way" if probing else ("half-open" if half else "open")
    return f"{now}: rows wait, attempts untouched ({probes} probe(s) so far, tripped {trips}x)"


def breaker_totals(conn: Connection, destination: str) -> tuple[int, int]:
    """(trips, probes of the latest episode) of the destination's breaker."""
    row = conn.execute(
        text("SELECT breaker_trips, breaker_probes FROM outbox_destination WHERE destination = :d"),
        {"d": destination},
    ).first()
    return (int(row[0]), int(row[1])) if row else (0, 0)
