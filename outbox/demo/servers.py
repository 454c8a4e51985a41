"""The servers of ``outbox demo``: embedded ones it owns, or yours, on which it keeps to its own names.

On a database of yours the demo refuses unfinished rows that are not its own (its reconciler
would sweep them with demo timings) and closes the rows an interrupted earlier run left behind;
on a Redis of yours it deletes only its own namespace.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import redis
from sqlalchemy import Engine, text

from .. import settings, transitions, transport
from ..exceptions import ConfigError
from ..testing.embedded import embedded_postgres, embedded_redis
from .base import DEMO_DESTINATIONS


@dataclass(frozen=True)
class Servers:
    database_url: str
    redis_url: str
    #: Started by the demo (embedded), so everything on them is the demo's.
    database_owned: bool
    redis_owned: bool

    def describe(self, namespace: str) -> str:
        where = {True: "embedded", False: "yours"}
        return (
            f"servers: PostgreSQL {where[self.database_owned]} ({settings.redact_url(self.database_url)}), "
            f"Redis {where[self.redis_owned]} ({settings.redact_url(self.redis_url)}), "
            f"namespace {namespace!r}"
        )


def start_servers(
    stack: contextlib.ExitStack, directory: Path, database_url: str | None, redis_url: str | None
) -> Servers:
    """Yours where a URL is given, else embedded ones in ``directory``, stopped by ``stack``."""
    # pgserver narrates every step at INFO; the demo says what matters itself.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    directory.mkdir()
    database_owned = redis_owned = False
    with warnings.catch_warnings():
        # platformdirs warns about XDG_RUNTIME_DIR when pgserver imports it; not our concern.
        warnings.simplefilter("ignore")
        if database_url is None:
            database_url = stack.enter_context(embedded_postgres(str(directory)))
            database_owned = True
        if redis_url is None:
            redis_url = stack.enter_context(embedded_redis(str(directory)))
            redis_owned = True
    return Servers(database_url, redis_url, database_owned, redis_owned)


def make_engine(stack: contextlib.ExitStack, database_url: str) -> Engine:
    from ..db import make_engine

    engine = make_engine(database_url, pool_size=2, max_overflow=2)
    stack.callback(engine.dispose)
    return engine


def migrate(engine: Engine) -> str | None:
    """Bring the outbox schema to its head; a line saying so when it moved."""
    from ..migrate import upgrade

    before, after = upgrade(engine)
    if before != after:
        return f"outbox schema migrated from {before or 'empty'} to {after}"
    return None


def refuse_foreign_rows(engine: Engine) -> None:
    sql = text(
        """
        SELECT destination, count(*) FROM outbox_message
        WHERE state NOT IN ('sent', 'failed', 'cancelled') AND destination <> ALL(:destinations)
        GROUP BY destination ORDER BY 2 DESC
        """
    )
    with engine.connect() as conn:
        foreign = conn.execute(sql, {"destinations": list(DEMO_DESTINATIONS)}).fetchall()
    if foreign:
        shown = ", ".join(f"{d}: {n}" for d, n in foreign[:5])
        raise ConfigError(
            f"this database holds unfinished outbox rows that are not the demo's ({shown}); the "
            "demo's reconciler would sweep them with demo timings. Run the demo against a "
            "database of its own (e.g. createdb outbox_demo), or with no URL for embedded servers"
        )


def settle_earlier_runs(engine: Engine) -> tuple[int, int]:
    """Close the demo rows an interrupted earlier run left unfinished: (cancelled, failed).

    Their provider simulator is gone with its memory: nobody can ever learn whether an
    in-flight or unknown one took effect, and charging a pending one now would be a charge
    the audit of this run could not attribute to any of its orders.
    """
    cancelled = failed = 0
    with engine.begin() as conn:
        for destination in DEMO_DESTINATIONS:
            c, f = transitions.close_abandoned(
                conn,
                destination=destination,
                unclaimed_reason="cancelled by a later outbox demo run",
                open_reason="left unfinished by an interrupted outbox demo run, whose provider simulator "
                "is gone: its outcome cannot be known",
            )
            cancelled, failed = cancelled + c, failed + f
    return cancelled, failed


def delete_namespace(redis_url: str, namespace: str) -> int:
    """Delete the keys of the demo's namespace (and only those) on a Redis of yours."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return transport.delete_namespace(client, namespace)
    finally:
        client.close()


def flushdb(redis_url: str) -> None:
    """Empty the demo's own (embedded) Redis."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
