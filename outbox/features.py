"""Features an operator enables once no older process is left to break them (migration 0022).

A rolling deploy runs the previous release beside this one: ``outbox migrate`` changes the schema
under processes that checked it when they started, and keep running. A rule a take or a claim must
obey holds for them in one of two ways (docs/production.md, "Rolling deploys", per revision):

* the database enforces it, so that an older statement obeys it too (a row trigger restricted by
  ``WHEN`` to the rows that use the feature: ordering, an operator's ``resolve --failed``);
* or the feature is **gated**, listed here: the database refuses rows that use it (SQLSTATE
  :data:`SQLSTATE`; ``outbox.write`` raises :class:`~outbox.exceptions.FeatureNotEnabled`) until
  an operator runs ``outbox features enable NAME``. That refuses while any live process (relay,
  worker and reconciler all beat, with the schema range their code accepts; a beat without a range
  is an older release's) cannot handle the feature, and it raises the floor to the feature's
  revision, so that such a process, restarted later, refuses to start.

Who moves a feature: ``outbox features enable`` (on), migration 0022 (on, when no process was live
or rows already used it); nothing turns one off but a downgrade.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy.exc
from sqlalchemy import Connection, text

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


def holdouts(conn: Connection, feature: Feature) -> list[str]:
    """The live processes that keep ``feature`` off, one line each."""
    from .heartbeat import LIVE

    rows = conn.execute(text(_HOLDOUTS.format(live=LIVE)), {"needs": feature.needs_code}).all()
    return [f"{kind} {host}:{pid} (code up to {newest})" for kind, host, pid, newest in rows]


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


def enable(conn: Connection, name: str, *, by: str, reason: str | None = None) -> FeatureState:
    """Turn ``name`` on in the caller's transaction (which commits it), and raise the floor to
    its revision; raises :class:`FeatureRefused` while a live process cannot handle it. Enabling
    an enabled feature changes nothing and returns its state."""
    from .migrate import FLOOR_TABLE, revision_number

    feature = _feature(name)
    # One enable at a time. A process of older code starting during it passes its schema check
    # before this commits the floor and beats within its first interval: `outbox features`
    # lists it as a holdout then (docs/production.md says to look once more).
    conn.execute(text("LOCK TABLE outbox_feature IN SHARE ROW EXCLUSIVE MODE"))
    row = conn.execute(
        text("SELECT enabled_at, enabled_by, reason FROM outbox_feature WHERE name = :n"), {"n": name}
    ).first()
    if row is not None:
        return FeatureState(feature, row.enabled_at, row.enabled_by, row.reason, ())
    blocking = holdouts(conn, feature)
    if blocking:
        raise FeatureRefused(name, blocking)
    row = conn.execute(
        text(
            "INSERT INTO outbox_feature (name, needs_code, enabled_by, reason) "
            "VALUES (:n, :needs, :by, :reason) RETURNING enabled_at, enabled_by, reason"
        ),
        {"n": name, "needs": feature.needs_code, "by": by, "reason": reason},
    ).one()
    assert revision_number(feature.needs_code) is not None
    conn.execute(
        text(
            f"INSERT INTO {FLOOR_TABLE} (migration, needs_code) VALUES (:m, :c) "
            "ON CONFLICT (migration) DO UPDATE SET needs_code = excluded.needs_code"
        ),
        {"m": f"feature:{name}", "c": feature.needs_code},
    )
    return FeatureState(feature, row.enabled_at, row.enabled_by, row.reason, ())


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
    return "payload_versions"
