"""Apply and check the packaged Alembic migrations (shipped as ``outbox.migrations``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from .exceptions import NotMigrated
from .logs import first_line
from .schema import FLOOR_TABLE, VERSION_TABLE

logger = logging.getLogger(__name__)


def alembic_config(connection: Connection | None = None, script_location: str | None = None) -> Config:
    """The packaged migrations, or those in ``script_location`` (tests add revisions there)."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location or str(resources.files("outbox.migrations")))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


#: The oldest schema revision this code works with; the newest is :func:`head_revision`. Raise
#: it when the code starts to need what a revision added (a table, a column, a constraint it
#: relies on). 0006 adds ``outbox_db_identity``, which the failover check of the relay, the
#: worker and the reconciler reads and writes; 0007 adds the CHECK that keeps a plain-SQL writer
#: from inserting a step with ':' (two rows would send the same Idempotency-Key, and a
#: deduplicating provider would answer the second with the first one's charge): the guarantee
#: (docs/guarantee.md) relies on it, so a database without it is refused; 0008 adds the
#: ``trace_context`` column that ``write`` inserts and the claim returns; 0009 the paused
#: destinations (``outbox_destination``), which every claim reads; 0010 the breaker's columns of
#: that table, which the claim reads and reserves (outbox.breaker); 0012 the chain columns
#: (``parent_id``, ``via``, ``chain_problem``) that the record and the purge write (outbox.chains);
#: 0014 the batches (``outbox_batch``, ``batch_id``) that ``write(batch=)`` and the reconciler's
#: ``batches`` job use; 0016 ``payload_version``, which ``write`` inserts and the claim returns;
#: 0017 the ordering columns and triggers (outbox.ordering) that the relay and the claim read;
#: 0022 the heartbeat's schema range and ``outbox_feature`` (outbox.features), which every
#: process's beat writes and ``write`` relies on to refuse a feature an older process would break;
#: 0023 the in-flight limits (``declared_in_flight``, ``landing_until``) that the heartbeat, the
#: record and the lease expiry write (outbox.limits); 0024 the rates (``declared_per_second``,
#: ``call_at``) that the heartbeat writes and the claim returns; 0025 ``priority`` and
#: ``fairness_key``, which ``write`` inserts and the next steps inherit (0026's indexes only make
#: the relay's windowed take cheaper: the code works without them).
SCHEMA_OLDEST = "0025"

#: Advisory lock serialising concurrent migrations: held for the session by :func:`upgrade`, for
#: the transaction by env.py (which also serves a plain ``alembic`` run).
MIGRATION_LOCK_ID = 0x6F7574626F78  # "outbox"
_LOCK_POLL_SECONDS = 0.2


def revision_number(revision: str) -> int | None:
    """The position of ``revision`` in the chain: revisions are numbered ``0001``, ``0002``, …
    (tests/integration/test_schema_compat.py holds every revision file to it), which is what lets
    this code tell a revision newer than it knows from a foreign one."""
    return int(revision) if revision.isdigit() else None


@dataclass(frozen=True)
class SchemaStatus:
    """The database's schema revision against the range this code works with."""

    current: str | None  # None: no outbox schema at all
    oldest: str
    head: str
    floor: str | None  # the database's demand on the code (contract migrations); None: none
    problem: str | None  # None: this code may run on the database

    @property
    def ok(self) -> bool:
        return self.problem is None

    def describe(self) -> str:
        """One line for ``outbox doctor``: the problem, or where the database stands."""
        if self.problem is not None:
            return self.problem
        works = f"this code works with {self.oldest} to {self.head}"
        if (revision_number(self.current or "") or 0) > (revision_number(self.head) or 0):
            return f"at revision {self.current}, newer than this code ({works}; no contract excludes it)"
        return f"at revision {self.current} ({works})"


def schema_status(connection: Connection) -> SchemaStatus:
    """Where the database's schema stands for this code. Read-only, and it sends no statement
    that can fail, so the caller's transaction stays usable whatever it finds."""
    head = head_revision()
    exists = connection.execute(text("SELECT to_regclass('outbox_message') IS NOT NULL")).scalar()
    if not exists:
        return SchemaStatus(None, SCHEMA_OLDEST, head, None, "table outbox_message does not exist")
    current = current_revision(connection)
    floor = _floor(connection)
    return SchemaStatus(current, SCHEMA_OLDEST, head, floor, _problem(current, floor, head))


def _floor(connection: Connection) -> str | None:
    exists = connection.execute(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": FLOOR_TABLE}).scalar()
    if not exists:
        return None
    needs = connection.execute(text(f"SELECT needs_code FROM {FLOOR_TABLE}")).scalars().all()
    foreign = [n for n in needs if revision_number(n) is None]
    if foreign:  # a demand this code cannot even place: it can only be refused
        return str(foreign[0])
    return max(needs, key=revision_number, default=None)  # type: ignore[arg-type]


def _problem(current: str | None, floor: str | None, head: str) -> str | None:
    newest = revision_number(head)
    assert newest is not None
    position = 0 if current is None else revision_number(current)
    if position is None:
        return f"database is at revision {current}, which this version does not know"
    if position < int(SCHEMA_OLDEST):
        return f"database is at revision {current}, this version needs {SCHEMA_OLDEST} or later"
    floor_at = None if floor is None else revision_number(floor)
    if floor is not None and (floor_at is None or floor_at > newest):
        return f"the database needs outbox code from revision {floor}; this is {head}"
    return None


def check_schema(connection: Connection) -> None:
    """Raise :class:`NotMigrated` unless this code may run on the database's schema: a revision
    from :data:`SCHEMA_OLDEST` on, or a newer one no contract migration closed to this code."""
    status = schema_status(connection)
    if status.problem is not None:
        raise NotMigrated(status.problem)


def _lock(connection: Connection) -> None:
    """Hold :data:`MIGRATION_LOCK_ID` for the session. Polled, with no transaction open between
    tries: a revision that builds an index CONCURRENTLY commits mid-run (so a transaction-level
    lock would end there), and waits for every transaction older than it, which a run blocked in
    ``pg_advisory_lock`` would be: the two would deadlock."""
    waited = False
    while True:
        got = connection.execute(text("SELECT pg_try_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID}).scalar()
        connection.commit()
        if got:
            return
        if not waited:
            logger.info("another outbox migrate is running; waiting for it")
            waited = True
        time.sleep(_LOCK_POLL_SECONDS)


def _newer_than(revision: str, script_location: str | None) -> bool:
    head = ScriptDirectory.from_config(alembic_config(None, script_location)).get_current_head()
    position, newest = revision_number(revision), revision_number(head or "")
    return position is not None and newest is not None and position > newest


def upgrade(
    engine: Engine, revision: str = "head", *, script_location: str | None = None
) -> tuple[str | None, str]:
    """Bring the schema to ``revision``; returns (before, after). Safe to run concurrently."""
    with engine.connect() as connection:
        # Wait for a concurrent run before reading the revision, so that the run that waited
        # reports that it found the schema already there, not that it migrated it from empty.
        _lock(connection)
        try:
            before = current_revision(connection)
            connection.commit()
            if revision == "head" and before is not None and _newer_than(before, script_location):
                # A newer release migrated first (a rolling deploy): an older pod's own migrate
                # step has nothing to do, where Alembic would fail on a revision it cannot find.
                logger.info("outbox schema at revision %s, newer than this release's; nothing to do", before)
                return before, before
            # No transaction open: env.py begins its own, which Alembic may then end early for
            # a block that must run outside one (migrations.helpers.create_index_concurrently).
            command.upgrade(alembic_config(connection, script_location), revision)
            after = current_revision(connection)
            connection.commit()
        finally:
            connection.rollback()
            connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID})
            connection.commit()
    assert after is not None
    return before, after


#: How long the start-up check waits for a PostgreSQL that is down or starting up. Running
#: processes ride out a database restart; one started during it (a supervisor's replacement
#: child, a deploy) exited at once, and a process manager's growing restart backoff then kept it
#: down long after the database was back.
START_WAIT_SECONDS = 30.0
_START_RETRY_MAX_DELAY_SECONDS = 2.0
# Worth waiting for: no server on the socket or port yet, or one refusing connections while it
# starts up, shuts down or recovers from a crash. libpq reports connection failures without an
# SQLSTATE, hence the messages; one not listed (a wrong password or database name, a message in
# another language) fails at once, as before.
_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P03"})
_TRANSIENT_MESSAGES = (
    "No such file or directory",
    "Connection refused",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "server closed the connection unexpectedly",
)


def _waitable(exc: sqlalchemy.exc.OperationalError) -> bool:
    if getattr(exc.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
        return True
    text_ = str(exc.orig or exc)
    return any(m in text_ for m in _TRANSIENT_MESSAGES)


def check_database(database_url: str, *, wait_seconds: float = START_WAIT_SECONDS) -> None:
    """:func:`check_schema` on a short-lived connection of its own: the start-up check of the
    long-running processes. Waits up to ``wait_seconds`` for a server that is not accepting
    connections yet; any other error raises at once."""
    from .db import make_engine

    engine = make_engine(database_url)
    try:
        _when_accepting(engine, wait_seconds, check_schema)
    finally:
        engine.dispose()


def upgrade_when_accepting(engine: Engine, *, wait_seconds: float) -> tuple[str | None, str]:
    """:func:`upgrade`, first waiting up to ``wait_seconds`` for a server that is not accepting
    connections yet (``outbox migrate --wait``: a fresh database container starts, stops and
    starts again before it takes connections)."""
    _when_accepting(engine, wait_seconds, lambda conn: conn.execute(text("SELECT 1")))
    return upgrade(engine)


def _when_accepting(engine: Engine, wait_seconds: float, use: Callable[[Connection], object]) -> None:
    deadline = time.monotonic() + wait_seconds
    delay = 0.25
    while True:
        try:
            with engine.connect() as conn:
                use(conn)
            return
        except sqlalchemy.exc.OperationalError as exc:
            if not _waitable(exc) or time.monotonic() + delay > deadline:
                raise
            if delay == 0.25:
                logger.warning(
                    "PostgreSQL is not accepting connections (%s); waiting up to %.0f s",
                    first_line(exc.orig or exc),
                    wait_seconds,
                    extra={"error": type(exc.orig or exc).__name__},
                )
            time.sleep(delay)
            delay = min(delay * 2, _START_RETRY_MAX_DELAY_SECONDS)
