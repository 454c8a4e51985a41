"""``outbox doctor``: every invariant of the contract, checked against the live services.

Each check says ``ok`` or ``FAIL`` with what to do; a check that cannot run because an earlier
one failed says ``skip`` (and the earlier failure already makes the exit status non-zero); a
check that was not asked for (the handler checks without MODULE) says ``off`` and passes.
Nothing here raises on an unreachable service: telling the operator is the whole point.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
import sqlalchemy.exc
from sqlalchemy import Connection, text

from .. import breaker, features, heartbeat, pauses, transport
from ..db import CAN_SEE_ALL_XACTS, make_engine
from ..exceptions import ConfigError, NotMigrated, OutboxError
from ..handlers import load_module
from ..logs import first_line
from ..migrate import schema_status
from ..settings import Settings, redact_url
from .values import age, seconds

OK = "ok"
FAIL = "FAIL"
SKIP = "skip"
OFF = "off"
#: Worth fixing, but no invariant of the contract is broken: the exit status stays 0.
WARN = "WARN"

#: A sweeper that is this late is not merely busy: it is not running.
LIVENESS_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.status in (OK, OFF, WARN)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "ok": self.ok, "detail": self.detail}


def _held_check(name: str, held: list[str], advice: str, ok: str) -> Check:
    """WARN naming each destination held back (paused, breaker open), else OK."""
    return Check(name, WARN, "; ".join(held) + f": {advice}") if held else Check(name, OK, ok)


# -- database ----------------------------------------------------------------------------------------

_LIVENESS = text(
    """
SELECT
  count(*) FILTER (WHERE state = 'in_flight'
                     AND lease_expires_at < now() - :grace * interval '1 second') AS stale_in_flight,
  EXTRACT(EPOCH FROM now() - min(lease_expires_at) FILTER (WHERE state = 'in_flight'))
      AS in_flight_overdue,
  count(*) FILTER (WHERE state = 'dispatched'
                     AND dispatched_at < now() - :redispatch * interval '1 second') AS stale_dispatched,
  EXTRACT(EPOCH FROM now() - min(dispatched_at) FILTER (WHERE state = 'dispatched'))
      AS dispatched_age,
  count(*) FILTER (WHERE state = 'pending'
                     AND available_at < now() - :grace * interval '1 second') AS stale_pending,
  EXTRACT(EPOCH FROM now() - min(available_at) FILTER (WHERE state = 'pending')) AS pending_overdue
FROM outbox_message m
WHERE state IN ('in_flight', 'dispatched', 'pending')
  -- A paused destination's rows, and those behind an open breaker, wait by design (the
  -- `pauses` and `breakers` checks report them).
  AND NOT EXISTS (SELECT 1 FROM outbox_destination d WHERE d.destination = m.destination
                  AND (d.paused_until > now() OR d.breaker_opened_at IS NOT NULL))
"""
)

# Failed rows count: a replay would hand them to a deploy that cannot run them. Destinations with
# only sent/cancelled rows are history, not work.
_LIVE_DESTINATIONS = text(
    "SELECT DISTINCT destination FROM outbox_message WHERE state NOT IN ('sent', 'cancelled') ORDER BY 1"
)


def _liveness_checks(conn: Connection, cfg: Settings) -> list[Check]:
    row = conn.execute(
        _LIVENESS,
        {"grace": LIVENESS_GRACE_SECONDS, "redispatch": cfg.redispatch_after_seconds * 2},
    ).one()
    checks = []
    if row.stale_in_flight:
        checks.append(
            Check(
                "leases",
                FAIL,
                f"{row.stale_in_flight} in_flight row(s) past their lease by more than "
                f"{LIVENESS_GRACE_SECONDS:g} s (oldest by {float(row.in_flight_overdue):.0f} s): the "
                "reconciler is not running; start `outbox reconcile MODULE`",
            )
        )
    else:
        checks.append(Check("leases", OK, "no in_flight row is past its lease"))
    limit = cfg.redispatch_after_seconds * 2
    if row.stale_dispatched:
        checks.append(
            Check(
                "dispatched",
                FAIL,
                f"{row.stale_dispatched} dispatched row(s) unclaimed for more than {limit:g} s "
                f"(twice OUTBOX_REDISPATCH_AFTER; oldest {float(row.dispatched_age):.0f} s): no worker "
                "consumes their queue and the reconciler does not re-queue them; start "
                "`outbox worker MODULE` and `outbox reconcile MODULE`",
            )
        )
    else:
        checks.append(Check("dispatched", OK, f"no dispatched row waits longer than {limit:g} s"))
    if row.stale_pending:
        checks.append(
            Check(
                "relay",
                FAIL,
                f"{row.stale_pending} pending row(s) due for more than {LIVENESS_GRACE_SECONDS:g} s "
                f"(oldest {float(row.pending_overdue):.0f} s): the relay is not running; start "
                "`outbox relay`",
            )
        )
    else:
        checks.append(Check("relay", OK, f"no pending row is due for more than {LIVENESS_GRACE_SECONDS:g} s"))
    return checks


_ATTENTION = text(
    """
SELECT count(*) FILTER (WHERE state = 'failed') AS failed,
       EXTRACT(EPOCH FROM now() - min(completed_at) FILTER (WHERE state = 'failed')) AS failed_age,
       count(*) FILTER (WHERE state = 'unknown'
                          AND unknown_since < now() - :after * interval '1 second') AS unknown,
       EXTRACT(EPOCH FROM now() - min(unknown_since) FILTER (WHERE state = 'unknown')) AS unknown_age
FROM outbox_message
WHERE state IN ('failed', 'unknown')
"""
)


def _attention_checks(conn: Connection, cfg: Settings) -> list[Check]:
    """Rows waiting for a person: failed ones, and unknown ones the reconciler has not settled
    within OUTBOX_UNKNOWN_ALERT_AFTER. Not broken invariants (WARN): the outbox did its job by
    stopping there, but someone has to look."""
    row = conn.execute(_ATTENTION, {"after": cfg.unknown_alert_after_seconds}).one()
    after = age(cfg.unknown_alert_after_seconds)
    checks = []
    if row.failed:
        checks.append(
            Check(
                "failed",
                WARN,
                f"{row.failed} failed row(s) (oldest failed {age(seconds(row.failed_age)) or '?'} "
                "ago): look at them with `outbox failed`, fix the cause, then `outbox replay`",
            )
        )
    else:
        checks.append(Check("failed", OK, "no failed row"))
    if row.unknown:
        checks.append(
            Check(
                "unknown",
                WARN,
                f"{row.unknown} row(s) unknown for more than {after} (OUTBOX_UNKNOWN_ALERT_AFTER; "
                f"oldest {age(seconds(row.unknown_age))}): look at them with `outbox unknown`, ask "
                "the provider, then `outbox resolve`",
            )
        )
    else:
        checks.append(Check("unknown", OK, f"no row unknown for more than {after}"))
    return checks


def _features_check(conn: Connection) -> Check:
    """The gated features (outbox.features): off ones are fine (their rows are refused); an
    enabled one with a live process whose code does not know it is a deploy gone wrong."""
    found = features.states(conn)
    wrong = [
        f"{s.feature.name} is on, but {h} does not know it" for s in found if s.enabled for h in s.holdouts
    ]
    if wrong:
        return Check("features", FAIL, "; ".join(wrong) + ": stop those processes (docs/production.md)")
    shown = ", ".join(f"{s.feature.name} {'on' if s.enabled else 'off'}" for s in found)
    off = [s for s in found if not s.enabled]
    if off:
        return Check(
            "features",
            OK,
            f"{shown} (an off feature's rows are refused until `outbox features enable NAME`)",
        )
    return Check("features", OK, shown)


def _transport_checks(conn: Connection, cfg: Settings) -> list[Check]:
    """From the heartbeats in the database: destinations no live worker consumes, and each
    live process's clock against the database's."""
    checks = []
    gaps = heartbeat.no_consumer(conn.execute(text(heartbeat.NO_CONSUMER_SQL)))
    if gaps:
        checks.append(
            Check(
                "consumers",
                FAIL,
                "; ".join(g.describe() for g in gaps) + ": start `outbox worker MODULE` serving them, "
                "or cancel rows that will never be sent (`outbox cancel --destination D --reason R`)",
            )
        )
    else:
        checks.append(Check("consumers", OK, "every destination with rows waiting has a live worker"))
    checks.append(
        _held_check(
            "pauses",
            [p.describe() for p in pauses.paused(conn)],
            "its rows wait, none is claimed; `outbox resume D` when the provider is back",
            "no destination is paused",
        )
    )
    checks.append(
        _held_check(
            "breakers",
            [b.describe() for b in breaker.open_breakers(conn)],
            "its rows wait without spending attempts and a probe goes through when it half-opens; "
            "`outbox resume D` closes it by hand",
            "no destination's breaker is open",
        )
    )
    checks.append(_features_check(conn))
    processes = heartbeat.live_processes(conn.execute(text(heartbeat.LIVE_PROCESSES_SQL)))
    limit = cfg.clock_skew_warn_seconds
    skewed = [p for p in processes if abs(p.skew_seconds) > limit]
    shown = ", ".join(f"{p.name} {p.skew_seconds:+.3f} s" for p in processes)
    if not processes:
        checks.append(Check("clocks", OK, "no live process heartbeat to compare"))
    elif skewed:
        checks.append(
            Check(
                "clocks",
                WARN,
                f"{len(skewed)} process(es) with a clock more than {limit:g} s from the database's "
                f"(OUTBOX_CLOCK_SKEW_WARN): {shown}; fix their time synchronisation (NTP/chrony)",
            )
        )
    else:
        checks.append(Check("clocks", OK, f"every live process within {limit:g} s of the database: {shown}"))
    return checks


#: How far past OUTBOX_RETENTION a sent/cancelled row may be before the purge counts as stalled:
#: one run moves at most 20,000 rows, and a backlog after a pause takes a few runs.
PURGE_GRACE_SECONDS = 86400.0

_PURGE_OVERDUE = text(
    """
SELECT count(*) AS n, EXTRACT(EPOCH FROM now() - min(completed_at)) AS oldest
FROM outbox_message
WHERE state IN ('sent', 'cancelled')
  AND completed_at < now() - (:retention + :grace) * interval '1 second'
"""
)


def _purge_checks(conn: Connection, cfg: Settings) -> list[Check]:
    """Whether the purge can run on this role, and whether it keeps up. A reconciler on a role
    that cannot see other roles' open transactions skips the purge (outbox.reconciler.jobs.purge)."""
    role = conn.execute(text("SELECT current_user")).scalar_one()
    if conn.execute(text(CAN_SEE_ALL_XACTS)).scalar():
        checks = [Check("purge", OK, f"role {role} sees every session's open transaction")]
    else:
        checks = [
            Check(
                "purge",
                FAIL,
                f"role {role} is neither superuser nor a member of pg_read_all_stats: a reconciler "
                "on this role skips the purge (it cannot see other roles' open transactions, "
                f"which the purge must wait for); run GRANT pg_read_all_stats TO {role} (or "
                "pg_monitor)",
            )
        ]
    row = conn.execute(
        _PURGE_OVERDUE, {"retention": cfg.retention_seconds, "grace": PURGE_GRACE_SECONDS}
    ).one()
    if row.n:
        checks.append(
            Check(
                "retention",
                FAIL,
                f"{row.n} sent/cancelled row(s) completed more than OUTBOX_RETENTION "
                f"({cfg.retention_seconds:g} s) plus {PURGE_GRACE_SECONDS:g} s ago (oldest "
                f"{float(row.oldest):.0f} s): the purge is not running, is skipped for want of "
                'pg_read_all_stats (the reconciler logs "purge skipped"), or waits for a '
                "transaction left open (pg_stat_activity, idle in transaction)",
            )
        )
    else:
        checks.append(Check("retention", OK, "no sent/cancelled row is overdue for the purge"))
    return checks


@contextlib.contextmanager
def _database(cfg: Settings) -> Iterator[tuple[list[Check], Connection | None]]:
    """Yield the database checks so far and a connection when the schema is usable."""
    checks: list[Check] = []
    try:
        url = cfg.require_database_url()
    except ConfigError as exc:
        checks.append(Check("database", FAIL, str(exc)))
        yield checks, None
        return
    shown = redact_url(url)
    engine = make_engine(url, pool_pre_ping=False, connect_args={"connect_timeout": 5})
    try:
        try:
            conn = engine.connect().execution_options(postgresql_readonly=True)
        except (sqlalchemy.exc.DBAPIError, psycopg.Error) as exc:
            checks.append(
                Check(
                    "database",
                    FAIL,
                    f"cannot reach PostgreSQL at {shown}: {first_line(exc)}; check "
                    "--database-url / OUTBOX_DATABASE_URL and that the server is up",
                )
            )
            yield checks, None
            return
        with conn:
            checks.append(Check("database", OK, f"reachable ({shown})"))
            # The range this code works with (outbox.migrate), not merely the head revision.
            schema = schema_status(conn)
            if schema.problem is not None:
                checks.append(Check("schema", FAIL, str(NotMigrated(schema.problem))))
            else:
                checks.append(Check("schema", OK, schema.describe()))
            yield checks, conn if schema.ok else None
    finally:
        engine.dispose()


# -- Redis -------------------------------------------------------------------------------------------


def _redis_checks(cfg: Settings) -> list[Check]:
    try:
        url = cfg.require_redis_url()
    except ConfigError as exc:
        return [
            Check("redis", FAIL, str(exc)),
            Check("eviction", SKIP, "Redis not checked"),
            Check("namespace", SKIP, "Redis not checked"),
        ]
    client = transport.connect(url, socket_connect_timeout=5, socket_timeout=10)
    try:
        try:
            client.ping()
            memory = client.info("memory")
        except redis.RedisError as exc:
            return [
                Check(
                    "redis",
                    FAIL,
                    f"cannot reach Redis at {redact_url(url)}: {exc}; check --redis-url / OUTBOX_REDIS_URL",
                ),
                Check("eviction", SKIP, "Redis unreachable"),
                Check("namespace", SKIP, "Redis unreachable"),
            ]
        checks = [Check("redis", OK, f"reachable ({redact_url(url)})")]
        maxmemory = int(memory.get("maxmemory", 0) or 0)
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        if maxmemory and policy.startswith("allkeys-"):
            # Reported even with OUTBOX_ALLOW_EVICTING_REDIS: the override lets processes start,
            # it does not make a queued job safe from eviction.
            checks.append(
                Check(
                    "eviction",
                    FAIL,
                    f"maxmemory-policy is {policy} with maxmemory={maxmemory}: Redis may evict queued "
                    "messages; set maxmemory-policy noeviction (or a volatile-* policy)",
                )
            )
        elif maxmemory:
            checks.append(Check("eviction", OK, f"maxmemory={maxmemory}, maxmemory-policy {policy}"))
        else:
            checks.append(Check("eviction", OK, f"maxmemory not set (policy {policy})"))
        try:
            # allow_evicting: the policy has its own line above; only the namespace problems remain.
            problems = transport.check_broker_safety(client, cfg.namespace, allow_evicting=True)
        except redis.RedisError as exc:
            checks.append(Check("namespace", FAIL, f"cannot scan the namespace: {exc}"))
        else:
            if problems:
                checks.append(Check("namespace", FAIL, "; ".join(problems)))
            else:
                checks.append(Check("namespace", OK, f"{cfg.namespace!r} holds only broker keys"))
        return checks
    finally:
        client.close()


# -- handlers ----------------------------------------------------------------------------------------


def _module_checks(module: str, conn: Connection | None) -> list[Check]:
    try:
        handlers = load_module(module)
    except OutboxError as exc:
        return [
            Check("handlers", FAIL, f"{module}: {exc}"),
            Check("destinations", SKIP, "handler module not loaded"),
        ]
    except Exception as exc:  # the user's module may raise anything while importing
        return [
            Check("handlers", FAIL, f"importing {module} raised {type(exc).__name__}: {exc}"),
            Check("destinations", SKIP, "handler module not loaded"),
        ]
    # The rules of `@handler` (Handler.problems): a module may build `Handler` objects without it.
    problems = [f"handler {p}" for h in handlers.values() for p in h.problems()]  # p names it
    checks = [
        Check("handlers", FAIL, "; ".join(problems))
        if problems
        else Check("handlers", OK, f"{module}: {len(handlers)} handler(s): {', '.join(sorted(handlers))}")
    ]
    if conn is None:
        checks.append(Check("destinations", SKIP, "database not usable"))
        return checks
    live = [row[0] for row in conn.execute(_LIVE_DESTINATIONS)]
    missing = [d for d in live if d not in handlers]
    if missing:
        checks.append(
            Check(
                "destinations",
                FAIL,
                f"rows wait for destination(s) with no handler in {module}: {', '.join(missing)}; "
                "deploy their handlers (until then they wait, re-published by the reconciler)",
            )
        )
    else:
        checks.append(Check("destinations", OK, "every destination with live rows has a handler"))
    return checks


def run_payload_checks(cfg: Settings, module: str) -> list[Check]:
    """``--payloads``: the database, the module, and every waiting row's payload against the
    module's models and upgrades (outbox.ops.payload_check); nothing else, so that it runs in a
    deploy pipeline that reaches the database alone."""
    from .payload_check import check_payloads, stderr_progress

    with _database(cfg) as (checks, conn):
        checks = list(checks)
        try:
            handlers = load_module(module)
        except Exception as exc:  # the user's module may raise anything while importing
            return [
                *checks,
                Check("handlers", FAIL, f"importing {module} raised {type(exc).__name__}: {exc}"),
            ]
        problems = [f"handler {p}" for h in handlers.values() for p in h.problems()]
        if problems:
            return [*checks, Check("handlers", FAIL, "; ".join(problems))]
        checks.append(Check("handlers", OK, f"{module}: {len(handlers)} handler(s)"))
        if conn is None:
            return [*checks, Check("payloads", SKIP, "database not usable")]
        progress = stderr_progress()
        report = check_payloads(conn, handlers, progress=progress)
        if progress is not None:
            print(file=sys.stderr)
        total = sum(report.checked.values())

        def shown_rows(rows: list[Any]) -> str:
            return "; ".join(
                f"row {r.id} {r.key}:{r.step} ({r.destination}, {r.state}, version {r.version}): {r.problem}"
                for r in rows
            )

        if report.incompatible:
            shown = shown_rows(report.incompatible)
            more = ", stopped there: more may follow" if report.stopped else ""
            checks.append(
                Check(
                    "payloads",
                    FAIL,
                    f"{len(report.incompatible)} waiting row(s) the handlers of {module} cannot deliver"
                    f"{more}: {shown}; add an upgrade for their version (or keep the old field), then "
                    "check again",
                )
            )
        else:
            unchecked = (
                f"; not read (no payload_model, no upgrades): {', '.join(report.unchecked)}"
                if report.unchecked
                else ""
            )
            checks.append(
                Check("payloads", OK, f"{total} waiting row(s) fit the handlers of {module}{unchecked}")
            )
        if report.failed:
            checks.append(
                Check(
                    "replays",
                    WARN,
                    f"{len(report.failed)} failed row(s) a replay could not deliver with {module}: "
                    f"{shown_rows(report.failed)}; leave them failed, or write the operation again",
                )
            )
        return checks


def run_checks(cfg: Settings, module: str | None = None) -> list[Check]:
    """All the checks, in the order an operator fixes them."""
    with _database(cfg) as (checks, conn):
        checks = list(checks)
        checks += _redis_checks(cfg)
        if module:
            checks += _module_checks(module, conn)
        else:
            # Said, not silently left out: an operator must see what was not checked.
            checks += [
                Check("handlers", OFF, "no MODULE given: outbox doctor myapp.handlers checks timings"),
                Check("destinations", OFF, "no MODULE given: with one, live destinations need a handler"),
            ]
        if conn is not None:
            checks += _liveness_checks(conn, cfg)
            checks += _transport_checks(conn, cfg)
            checks += _attention_checks(conn, cfg)
            checks += _purge_checks(conn, cfg)
        else:
            checks += [
                Check(n, SKIP, "database not usable")
                for n in (
                    "leases",
                    "dispatched",
                    "relay",
                    "consumers",
                    "clocks",
                    "failed",
                    "unknown",
                    "purge",
                    "retention",
                )
            ]
    return checks
