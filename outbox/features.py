"""Features an operator enables once no older process is left to break them (migration 0022).

A rolling deploy runs the previous release beside this one: ``outbox migrate`` changes the schema
under processes that checked it when they started, and keep running. A rule a take or a claim must
obey holds for them in one of two ways (docs/production.md, "Rolling deploys", per revision):

* the database enforces it, so that an older statement obeys it too (a row trigger restricted by
  ``WHEN`` to the rows that use the feature: ordering, an operator's ``resolve --failed``);
* or the feature is **gated**, listed here: rows that use it are not claimed until an operator
  runs ``outbox features enable NAME`` (a BEFORE UPDATE trigger, ``WHEN`` the row uses it), and
  the application's own writes of such rows are refused meanwhile (SQLSTATE :data:`SQLSTATE`;
  ``outbox.write`` raises :class:`~outbox.exceptions.FeatureNotEnabled`), so that it learns at
  once. Enabling refuses while any live process cannot handle the feature: by its heartbeat
  (relays, workers and reconcilers beat with the schema range their code accepts; a beat without
  one is a release before 0022 and counts as older) and by its connection (every relay, worker
  and reconciler holds its failover check's connection from its start, named
  ``outbox-failover`` before 0022 and ``outbox-failover/<revision>`` since: older relays and
  reconcilers do not beat). It raises the floor to the feature's revision first, so that no
  such process starts any more, waits for one that started just before to show itself, and
  looks again.

Who moves a feature: ``outbox features enable`` (on), migration 0022 (on, when no process was live
or rows already used it); nothing turns one off but a downgrade.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy.exc
from sqlalchemy import Connection, Engine, text

from . import store
from .exceptions import ConfigError, FeatureNotEnabled, FeatureRefused

# outbox.write imports this module for :func:`refusal`: the heartbeat's and the migrations'
# modules (Alembic) are imported by the operator's functions only.

#: The SQLSTATE of the gate triggers' refusal.
SQLSTATE = "OB001"


@dataclass(frozen=True)
class Feature:
    name: str
    #: The revision a process's code must know (``schema_newest`` at least) to be left running.
    needs_code: str
    #: What an older process would do with a row that uses it.
    why: str


FEATURES: dict[str, Feature] = {
    feature.name: feature
    for feature in (
        Feature(
            "payload_versions",
            "0016",
            "a worker older than 0016 would hand a payload of a newer shape to its handler",
        ),
        Feature(
            "fairness",
            "0025",
            "a relay older than 0025 would publish a limited destination's rows oldest first, past "
            "its window and its priority and fairness turns",
        ),
    )
}


@dataclass(frozen=True)
class FeatureState:
    feature: Feature
    enabled_at: datetime | None
    enabled_by: str | None
    reason: str | None
    #: Live processes whose code does not know it: they keep it off; once it is on, one is a
    #: process that passed its start-up check as it was enabled (stop it).
    holdouts: tuple[str, ...]

    @property
    def enabled(self) -> bool:
        return self.enabled_at is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.feature.name,
            "needs_code": self.feature.needs_code,
            "enabled": self.enabled,
            "enabled_at": self.enabled_at.isoformat() if self.enabled_at else None,
            "enabled_by": self.enabled_by,
            "reason": self.reason,
            "holdouts": list(self.holdouts),
            "why": self.feature.why,
        }


# The live processes whose code does not know revision :needs: no range (a release before
# ranges) or a newest revision below it. Numbers compare as numbers: revisions are "0001"….
_HOLDOUTS = """
SELECT kind, hostname, pid, COALESCE(schema_newest, 'no range')
FROM outbox_process
WHERE {live}
  AND (schema_newest IS NULL OR schema_newest !~ '^[0-9]+$'
       OR CAST(schema_newest AS integer) < CAST(:needs AS integer))
ORDER BY kind, hostname, pid
"""


def _feature(name: str) -> Feature:
    try:
        return FEATURES[name]
    except KeyError:
        known = ", ".join(sorted(FEATURES))
        raise ConfigError(f"no feature named {name!r}; the features are: {known}") from None


# Connections of a relay, worker or reconciler whose code does not know revision :needs: the
# failover check's, which every such process holds from its start, before it takes any message
# (every release the floor lets start has one), a worker's heartbeat and a reconciler's per-job
# connections; named without a revision before 0022 ("outbox-failover", "outbox-worker",
# "outbox-reconcile-<job>"), with one since ("…/0022"). They see what heartbeats cannot: relays
# and reconcilers before 0022 do not beat, and a worker beats only once it consumes. An older
# process's failover connection, dropped (an idle timeout, a blip), comes back at its next check,
# every 30 s: hence the settle time of DEFAULT_SETTLE_SECONDS, and its job connections.
_OLD_CONNECTIONS = """
SELECT COALESCE(host(client_addr), 'local') || ':' || COALESCE(client_port, 0), application_name
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND application_name ~ '^outbox-(failover|worker|reconcile-[a-z_]+)(/[0-9]+)?$'
  AND COALESCE(CAST(substring(application_name FROM '/([0-9]+)$') AS integer), 0) < CAST(:needs AS integer)
ORDER BY 1
"""


def holdouts(conn: Connection, feature: Feature) -> list[str]:
    """The live processes that keep ``feature`` off, one line each: by their heartbeat, and by
    the connection each holds (processes of a release before 0022 that do not beat)."""
    from .heartbeat import LIVE

    rows = conn.execute(text(_HOLDOUTS.format(live=LIVE)), {"needs": feature.needs_code}).all()
    found = [
        f"{kind} {host}:{pid} ("
        + ("a release before schema ranges" if newest == "no range" else f"code up to revision {newest}")
        + ")"
        for kind, host, pid, newest in rows
    ]
    for client, name in conn.execute(text(_OLD_CONNECTIONS), {"needs": feature.needs_code}).all():
        revision = name.rpartition("/")[2] if "/" in name else None
        release = f"code up to revision {revision}" if revision else "a release before 0022"
        found.append(f"a relay, worker or reconciler connected from {client} as {name} ({release})")
    return found


def states(conn: Connection) -> list[FeatureState]:
    """Every gated feature, on or off, with what keeps it off."""
    enabled = {
        r.name: r
        for r in conn.execute(text("SELECT name, enabled_at, enabled_by, reason FROM outbox_feature")).all()
    }
    result = []
    for feature in FEATURES.values():
        row = enabled.get(feature.name)
        below = tuple(holdouts(conn, feature))
        if row is not None:
            result.append(FeatureState(feature, row.enabled_at, row.enabled_by, row.reason, below))
        else:
            result.append(FeatureState(feature, None, None, None, below))
    return result


#: How long ``enable`` waits between raising the floor and its last look for older processes:
#: one that passed its start-up check just before the floor connects its failover check (before
#: it takes a message) well within it, and an older process's dropped failover connection comes
#: back at its next check (OUTBOX_FAILOVER_CHECK_INTERVAL, 30 s by default).
DEFAULT_SETTLE_SECONDS = 35.0


def enable(
    engine: Engine,
    name: str,
    *,
    by: str,
    reason: str | None = None,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
) -> FeatureState:
    """Turn ``name`` on; raises :class:`FeatureRefused` while a live process cannot handle it.
    Enabling an enabled feature changes nothing and returns its state.

    Three steps, each committed: look for older processes (refuse at once); raise the floor to
    the feature's revision, so that no older process starts from now on; wait ``settle_seconds``
    for one that passed its check just before, look again, and turn the feature on (or take the
    floor back down and refuse)."""
    feature = _feature(name)
    with engine.begin() as conn:
        current = _enabled(conn, feature)
        if current is not None:
            return current
        blocking = holdouts(conn, feature)
    if blocking:
        raise FeatureRefused(name, blocking)
    with engine.begin() as conn:
        _raise_floor(conn, feature)
    if settle_seconds > 0:
        time.sleep(settle_seconds)
    with engine.begin() as conn:
        # One enable at a time: the second waits here and finds the feature on.
        conn.execute(text("LOCK TABLE outbox_feature IN SHARE ROW EXCLUSIVE MODE"))
        current = _enabled(conn, feature)
        if current is not None:
            return current
        blocking = holdouts(conn, feature)
        if blocking:
            _lower_floor(conn, feature)
        else:
            row = store.operator.enable_feature(
                conn, name=name, needs_code=feature.needs_code, by=by, reason=reason
            )
    if blocking:
        raise FeatureRefused(name, blocking)
    return FeatureState(feature, row.enabled_at, row.enabled_by, row.reason, ())


def _enabled(conn: Connection, feature: Feature) -> FeatureState | None:
    row = conn.execute(
        text("SELECT enabled_at, enabled_by, reason FROM outbox_feature WHERE name = :n"), {"n": feature.name}
    ).first()
    return None if row is None else FeatureState(feature, row.enabled_at, row.enabled_by, row.reason, ())


def _raise_floor(conn: Connection, feature: Feature) -> None:
    store.operator.set_floor(conn, f"feature:{feature.name}", needs_code=feature.needs_code)


def _lower_floor(conn: Connection, feature: Feature) -> None:
    store.operator.drop_floor(conn, f"feature:{feature.name}")


@contextlib.contextmanager
def gated(what: str) -> Iterator[None]:
    """The database's refusal of a feature not enabled yet, raised as
    :class:`~outbox.exceptions.FeatureNotEnabled` (``what``: the row or batch, for the message);
    the caller's transaction is aborted, as after any failed statement."""
    try:
        yield
    except sqlalchemy.exc.DBAPIError as exc:
        feature = refusal(exc)
        if feature is None:
            raise
        raise FeatureNotEnabled(feature, f"{what} uses it") from exc


def refusal(exc: BaseException) -> str | None:
    """The feature a database error refused (the gate triggers' SQLSTATE), else None."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) != SQLSTATE:
        return None
    # Each gate's HINT names its feature ("… outbox features enable NAME").
    hint = getattr(getattr(orig, "diag", None), "message_hint", None) or ""
    named = re.search(r"outbox features enable (\w+)", hint)
    return named.group(1) if named else "payload_versions"
