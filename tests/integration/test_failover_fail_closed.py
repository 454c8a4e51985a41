"""Finding F2: the failover guard fails closed. A failover breaks every connection, the guard's
own too; a check that cannot run is retried once on a new connection, and while no check
succeeds the guard reports halted instead of keeping its last "unchanged"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers import sql

from outbox.failover import FailoverGuard


@pytest.fixture
def guard(clean: Any) -> Iterator[FailoverGuard]:
    sql(clean, "DELETE FROM outbox_db_identity")
    g = FailoverGuard(clean.database_url, process="test", interval_seconds=3600)
    yield g
    g.stop()
    sql(clean, "DELETE FROM outbox_db_identity")


def test_a_failover_that_broke_the_guards_connection_is_still_seen(clean: Any, guard: FailoverGuard) -> None:
    assert guard.check_now() is False
    assert guard._conn is not None
    pid = guard._conn.info.backend_pid
    # What a failover does to this process: the connection is gone and the history is new.
    sql(clean, "SELECT pg_terminate_backend(%s)", (pid,))
    sql(clean, "UPDATE outbox_db_identity SET timeline = timeline + 1")
    assert guard.check_now() is True
    assert guard.halted
    assert guard.last is not None and not guard.last.ok


def test_an_unreachable_database_halts_until_a_check_succeeds(clean: Any, guard: FailoverGuard) -> None:
    assert guard.check_now() is False
    good_url = guard.database_url
    guard.stop()  # closes its connection; check_now still runs
    # Nothing listens on port 1: every connection attempt fails.
    guard.database_url = "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2"
    assert guard.check_now() is True
    assert guard.halted
    assert guard.check_now() is True
    guard.database_url = good_url
    assert guard.check_now() is False
    assert not guard.halted
