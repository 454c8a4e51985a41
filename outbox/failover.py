"""Failover detection: a process that finds itself on another database history stops acting.

A failover to an asynchronous standby, or a point-in-time restore, can lose committed claims:
the provider was called, the attempt row that says so is gone, and the row is `pending` or
`dispatched` again — relaying and claiming it would charge twice. PostgreSQL names its history
by the cluster's *system identifier* (changes when the cluster is re-created or restored from a
logical dump) and the *timeline* (changes at every promotion and at the end of every
point-in-time recovery). The database records the pair it last ran on in
``outbox_db_identity``; the relay, worker and reconciler compare it with what the server reports,
at start and every ``OUTBOX_FAILOVER_CHECK_INTERVAL`` seconds (default 30; never per delivery),
and on a difference they alert and stop relaying, claiming and reconciling until an operator
runs ``outbox failover --accept --reason …`` (docs/runbook.md).

The system identifier comes from ``pg_control_system()``, the timeline from the name of the
current WAL file (``pg_walfile_name(pg_current_wal_lsn())``, up to date right after a promotion)
or else ``pg_control_checkpoint()`` (up to date after the next checkpoint). All three are
executable by any role on PostgreSQL 15 and 16 unless an administrator revoked them; a value that
cannot be read is reported once and left out of the comparison, and with neither readable the
detection is off, said loudly at start (``outbox failover`` shows it).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import psycopg

from . import store
from .db import connect_raw
from .sanitize import clean_text

logger = logging.getLogger(__name__)

#: While halted, the alert is repeated this often (in checks), so a missed page is not the end.
_REMIND_EVERY_CHECKS = 10


@dataclass(frozen=True)
class Identity:
    """Which database history a server is on; None where the value could not be read."""

    system_identifier: str | None
    timeline: int | None

    def describe(self) -> str:
        sysid = self.system_identifier or "unreadable"
        tli = self.timeline if self.timeline is not None else "unreadable"
        return f"system identifier {sysid}, timeline {tli}"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check."""

    ok: bool
    current: Identity
    recorded: Identity | None
    message: str
    #: True when neither value could be read: detection is off.
    unavailable: bool = False


def _read(conn: psycopg.Connection[Any], statement: str) -> tuple[Any, str | None]:
    try:
        row = conn.execute(statement).fetchone()
    except psycopg.OperationalError:
        raise
    except psycopg.Error as exc:
        # Revoked EXECUTE, a managed service hiding the function, a standby: not fatal.
        if not conn.autocommit:
            conn.rollback()
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return (row[0] if row else None), None


def read_identity(conn: psycopg.Connection[Any]) -> tuple[Identity, list[str]]:
    """The server's current identity, and why any part of it could not be read."""
    problems: list[str] = []
    sysid, why = _read(conn, "SELECT system_identifier::text FROM pg_control_system()")
    if why:
        problems.append(f"pg_control_system(): {why}")
    walfile, why = _read(conn, "SELECT pg_walfile_name(pg_current_wal_lsn())")
    timeline: int | None = None
    if walfile:
        timeline = int(str(walfile)[:8], 16)
    else:
        if why:
            problems.append(f"pg_walfile_name(pg_current_wal_lsn()): {why}")
        value, why = _read(conn, "SELECT timeline_id FROM pg_control_checkpoint()")
        if why:
            problems.append(f"pg_control_checkpoint(): {why}")
        timeline = int(value) if value is not None else None
    return Identity(str(sysid) if sysid is not None else None, timeline), problems


#: The recorded identity (outbox failover shows it beside the server's).
SHOW_RECORDED = """
SELECT system_identifier, timeline, recorded_at, recorded_by, note, mismatch_seen_at, mismatch
FROM outbox_db_identity WHERE id = 1
"""


def differences(recorded: Identity, current: Identity) -> list[str]:
    """What changed from the recorded identity to the current one, one phrase each."""
    changes = []
    if None not in (recorded.system_identifier, current.system_identifier) and (
        recorded.system_identifier != current.system_identifier
    ):
        changes.append(f"system identifier {recorded.system_identifier} -> {current.system_identifier}")
    if None not in (recorded.timeline, current.timeline) and recorded.timeline != current.timeline:
        changes.append(f"timeline {recorded.timeline} -> {current.timeline}")
    return changes


def check(conn: psycopg.Connection[Any], *, process: str) -> Verdict:
    """Compare the server's identity with the recorded one (recording it the first time).

    ``conn`` is an autocommit psycopg connection. Raises ``psycopg.OperationalError`` when the
    database cannot be reached: ``FailoverGuard`` then retries once on a new connection and,
    failing that, reports halted (fails closed) until a check succeeds.
    """
    current, problems = read_identity(conn)
    if current.system_identifier is None and current.timeline is None:
        return Verdict(
            True,
            current,
            None,
            "failover detection is off: neither the system identifier nor the timeline can be "
            f"read ({'; '.join(problems)}); grant EXECUTE on pg_control_system() and "
            "pg_control_checkpoint() to this role",
            unavailable=True,
        )
    params = {"sysid": current.system_identifier, "timeline": current.timeline, "by": process}
    row = store.processes.record_identity(conn, params)
    if row is None:
        # Another process recorded the row first, on an empty table (the relay, a worker and the
        # reconciler starting together): our INSERT waited for its commit and conflicted, but the
        # statement's snapshot predates that commit, so its SELECT saw no row. A new statement
        # sees it.
        row = store.processes.record_identity(conn, params)
    if row is None:
        raise psycopg.OperationalError("the database identity row could not be read or recorded")
    recorded = Identity(row[0], row[1])
    changes = differences(recorded, current)
    if not changes:
        partial = f" ({'; '.join(problems)})" if problems else ""
        return Verdict(True, current, recorded, f"database identity unchanged: {current.describe()}{partial}")
    mismatch = "; ".join(changes)
    store.processes.note_identity_mismatch(conn, mismatch)
    return Verdict(
        False,
        current,
        recorded,
        f"the database is not the one this outbox last ran on ({mismatch}): a failover or a "
        "restore may have lost committed claims, so relaying, claiming and reconciling are "
        "stopped. Check the provider for calls made since the last recorded state, then run "
        "`outbox failover --accept --reason '…'` (docs/runbook.md, \"After a failover\")",
    )


def accept(conn: psycopg.Connection[Any], *, reason: str, by: str) -> tuple[Identity, Identity | None]:
    """Record the server's current identity as the one to run on; (new, previous)."""
    # An operator's sentence, stored as it is shown: no card number (outbox.sanitize).
    reason = clean_text(reason, max_chars=2000)
    previous_row = conn.execute(SHOW_RECORDED).fetchone()
    previous = Identity(previous_row[0], previous_row[1]) if previous_row else None
    current, _ = read_identity(conn)
    store.operator.accept_identity(
        conn, {"sysid": current.system_identifier, "timeline": current.timeline, "by": by, "note": reason}
    )
    return current, previous


class FailoverGuard:
    """Checks the database identity at start and every ``interval_seconds`` on a thread of its
    own and connection of its own; ``halted`` is what the hot path reads (an attribute, no I/O).
    """

    def __init__(self, database_url: str, *, process: str, interval_seconds: float | None = None) -> None:
        self.database_url = database_url
        self.process = f"{process}@{socket.gethostname()}:{os.getpid()}"
        if interval_seconds is None:
            interval_seconds = _interval_from_env()
        self.interval_seconds = interval_seconds
        #: True while the database identity differs from the recorded one, or cannot be checked.
        self.halted = False
        self.last: Verdict | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._halted_checks = 0
        #: True while the last check could not run (the database unreachable): halted then too.
        self._unchecked = False
        self._lock = threading.Lock()

    @property
    def unreachable(self) -> bool:
        """Halted because no check could run (the database did not answer), not for a verdict."""
        return self._unchecked

    def check_now(self) -> bool:
        """One check; returns ``halted``. Fails closed: a check that cannot run is retried once on
        a new connection, and while no check succeeds the guard reports ``halted``.

        Called by the periodic thread, and by the processes each time they open a new database
        connection: a failover breaks every connection, so the first claim or batch after it
        runs on a checked server rather than waiting for the next period.
        """
        with self._lock:
            return self._check_locked()

    def _verdict(self) -> Verdict:
        if self._conn is None or self._conn.closed:
            # The revision names this code to `outbox features enable` (outbox.features): a
            # release before 0022 holds an "outbox-failover" connection without one.
            from .migrate import head_revision

            self._conn = connect_raw(
                self.database_url, autocommit=True, application_name=f"outbox-failover/{head_revision()}"
            )
        return check(self._conn, process=self.process)

    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _check_locked(self) -> bool:
        try:
            try:
                verdict = self._verdict()
            except psycopg.Error:
                # The guard's own connection is broken by the very failover it is there to see
                # (every connection is): the callers' new connections may already be on the
                # new history, so the answer comes from a new connection too.
                self._drop_conn()
                verdict = self._verdict()
        except psycopg.Error as exc:
            self._drop_conn()
            # Fail closed: a verdict that cannot be had is not an "unchanged".
            if not self._unchecked:
                logger.error(
                    "failover check failed twice (%s); relaying, claiming and reconciling stop "
                    "until a check succeeds",
                    type(exc).__name__,
                    extra={"outbox_process": self.process, "failover": True},
                )
            self._unchecked = True
            self.halted = True
            return True
        unchecked, self._unchecked = self._unchecked, False
        first = self.last is None
        self.last = verdict
        if not verdict.ok:
            if not self.halted or self._halted_checks % _REMIND_EVERY_CHECKS == 0:
                logger.error(
                    "%s",
                    verdict.message,
                    extra={
                        "outbox_process": self.process,
                        "failover": True,
                        "current": verdict.current.describe(),
                    },
                )
            self._halted_checks += 1
            self.halted = True
        else:
            if self.halted and unchecked:
                logger.warning(
                    "failover check succeeds again and the identity is the recorded one (%s): resuming",
                    verdict.current.describe(),
                    extra={"outbox_process": self.process},
                )
            elif self.halted:
                logger.warning(
                    "database identity accepted by an operator (%s): resuming",
                    verdict.current.describe(),
                    extra={"outbox_process": self.process},
                )
            elif first and verdict.unavailable:
                logger.error("%s", verdict.message, extra={"outbox_process": self.process})
            self.halted = False
            self._halted_checks = 0
        return self.halted

    def start(self) -> FailoverGuard:
        """Check once now, then keep checking on a daemon thread until ``stop``."""
        self.check_now()
        self._thread = threading.Thread(target=self._loop, name="outbox-failover-check", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.check_now()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None


def _interval_from_env() -> float:
    from .settings import from_env

    return from_env().failover_check_interval_seconds
