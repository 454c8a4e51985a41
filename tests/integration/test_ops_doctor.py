"""``outbox doctor`` against the live services: passes on a healthy deployment and names the
broken invariant (and what to do) for each way a deployment can be broken."""

from __future__ import annotations

import json
import textwrap
import uuid
from typing import Any

import psycopg
from helpers import elapse, sql, wait_for
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.cli import main
from outbox.heartbeat import Heartbeat
from outbox.settings import libpq_url

HANDLERS = """
import outbox

@outbox.handler("payments.charge", time_limit=5, backoff=(1, 2))
def charge(d):
    return outbox.Confirmed(ref="x")
"""


def doctor(services, capsys, *extra: str, database_url: str | None = None) -> tuple[int, dict[str, Any]]:
    """Run doctor with --json; returns the exit code and check name -> (status, detail)."""
    code = main(
        [
            "doctor",
            *extra,
            "--database-url",
            database_url or services.database_url,
            "--redis-url",
            services.redis_url,
            "--namespace",
            services.namespace,
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is (code == 0)
    return code, {c["name"]: (c["status"], c["detail"]) for c in data["checks"]}


def handler_module(tmp_path, monkeypatch, source: str) -> str:
    """A handler module with a name of its own, so no earlier import is reused."""
    name = f"ops_doctor_handlers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def write(engine, key: str, destination: str = "payments.charge") -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=destination, payload={"n": 1}).id


def connect(services) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(services.database_url), autocommit=True)


def claim(conn: psycopg.Connection[Any], row_id: int, *, lease_seconds: float = 30) -> store.delivery.Claimed:
    claimed = store.delivery.claim(
        conn, row_id=row_id, destination="payments.charge", lease_seconds=lease_seconds
    )
    assert claimed is not None
    return claimed


def settle(conn: psycopg.Connection[Any], row_id: int, state: str) -> None:
    """Claim the row and record ``state`` (``failed`` or ``unknown``), as a consumer does."""
    claimed = claim(conn, row_id)
    error = "card declined" if state == "failed" else "ReadTimeout"
    moved = store.delivery.record(
        conn, row_id=row_id, token=claimed.token, state=state, outcome=state, error=error
    ).state
    assert moved == state


def test_healthy_deployment_passes(clean, engine, capsys, tmp_path, monkeypatch):
    write(engine, "order:1")  # due now: not late
    module = handler_module(tmp_path, monkeypatch, HANDLERS)
    sql(clean, "TRUNCATE outbox_process")
    # A worker serving the row's destination records its heartbeat (issue 9 class 7).
    beat = Heartbeat(clean.database_url, kind="worker", queues=["payments.charge"]).start()
    try:
        wait_for(lambda: sql(clean, "SELECT 1 FROM outbox_process"), 10, "the first heartbeat")
        _healthy(clean, capsys, module)
    finally:
        beat.stop()


def _healthy(clean, capsys, module):
    code, checks = doctor(clean, capsys, module)
    assert code == 0, checks
    assert set(checks) == {
        "database",
        "schema",
        "redis",
        "eviction",
        "namespace",
        "handlers",
        "destinations",
        "leases",
        "dispatched",
        "relay",
        "consumers",
        "pauses",
        "breakers",
        "features",
        "clocks",
        "failed",
        "unknown",
        "purge",
        "retention",
    }
    assert all(status == "ok" for status, _ in checks.values())

    # The human form: one line per check, then the verdict.
    flags = ["--database-url", clean.database_url, "--redis-url", clean.redis_url]
    assert main(["doctor", *flags, "--namespace", clean.namespace]) == 0
    lines = capsys.readouterr().out.splitlines()
    statuses = {line.split()[1]: line.split()[0] for line in lines[:-1]}
    # Without MODULE the handler checks are said to be off, not silently left out; they pass.
    assert statuses == {name: "off" if name in ("handlers", "destinations") else "ok" for name in checks}
    assert lines[-1] == "all checks passed"


def test_missing_schema_fails_and_says_to_migrate(clean, capsys, empty_database_url):
    code, checks = doctor(clean, capsys, database_url=empty_database_url)
    assert code == 1
    assert checks["database"][0] == "ok"
    status, detail = checks["schema"]
    assert status == "FAIL" and "run `outbox migrate`" in detail
    # The liveness queries would hit missing tables: they are skipped, not crashed.
    assert checks["relay"][0] == "skip"


def test_unreachable_database_is_reported_not_raised(clean, capsys):
    code, checks = doctor(clean, capsys, database_url="postgresql://postgres@127.0.0.1:1/nothing")
    assert code == 1
    status, detail = checks["database"]
    assert status == "FAIL" and "cannot reach PostgreSQL" in detail
    assert checks["redis"][0] == "ok"


def test_evicting_redis_fails(clean, capsys, redis_client):
    original = redis_client.config_get("maxmemory*")
    # Far above what the server uses, so that nothing is actually evicted while the policy is set.
    limit = int(redis_client.info("memory")["used_memory"]) + 1024**3
    try:
        redis_client.config_set("maxmemory", limit)
        redis_client.config_set("maxmemory-policy", "allkeys-lru")
        code, checks = doctor(clean, capsys)
    finally:
        redis_client.config_set("maxmemory-policy", original["maxmemory-policy"])
        redis_client.config_set("maxmemory", original["maxmemory"])
    assert code == 1
    status, detail = checks["eviction"]
    assert status == "FAIL" and "allkeys-lru" in detail and "noeviction" in detail
    assert checks["namespace"][0] == "ok"


def test_foreign_key_in_namespace_fails(clean, capsys, redis_client):
    redis_client.set(f"{clean.namespace}:session:abc", "cached page")
    code, checks = doctor(clean, capsys)
    assert code == 1
    status, detail = checks["namespace"]
    assert status == "FAIL" and f"{clean.namespace}:session:abc" in detail and "OUTBOX_NAMESPACE" in detail


def test_bad_handler_declaration_is_reported_with_its_reason(clean, capsys, tmp_path, monkeypatch):
    module = handler_module(
        tmp_path,
        monkeypatch,
        """
        import outbox

        @outbox.handler("payments.charge", time_limit=30, lease_seconds=20)
        def charge(d):
            return None
        """,
    )
    code, checks = doctor(clean, capsys, module)
    assert code == 1
    status, detail = checks["handlers"]
    assert status == "FAIL" and "lease_seconds (20) must be longer than time_limit (30)" in detail
    assert checks["destinations"][0] == "skip"


def test_unimportable_module_fails(clean, capsys):
    code, checks = doctor(clean, capsys, "no_such_module_for_ops_doctor")
    assert code == 1
    assert checks["handlers"][0] == "FAIL" and "cannot import" in checks["handlers"][1]


def test_destination_without_handler_fails(clean, engine, capsys, tmp_path, monkeypatch):
    write(engine, "order:1")
    write(engine, "user:1", destination="mail.welcome")
    write(engine, "user:2", destination="sms.old")
    with Session(engine) as s, s.begin():
        assert outbox.cancel(s, key="user:2", step="charge")
    module = handler_module(tmp_path, monkeypatch, HANDLERS)
    code, checks = doctor(clean, capsys, module)
    assert code == 1
    status, detail = checks["destinations"]
    assert status == "FAIL" and "mail.welcome" in detail
    # Only terminal history left: a retired destination needs no handler.
    assert "sms.old" not in detail


def test_liveness_hints_name_the_process_that_is_not_running(clean, engine, capsys):
    pending, in_flight, dispatched = (write(engine, f"order:{i}") for i in range(3))
    with connect(clean) as conn:
        claim(conn, in_flight, lease_seconds=30)
        # The relay publishes the oldest due row first: make `dispatched` the oldest, alone.
        elapse(conn, 1, [dispatched])
        assert [r[0] for r in store.relay.dispatch_due(conn, limit=1)] == [dispatched]
        elapse(conn, 5 * 60, [pending])  # due for 5 minutes
        elapse(conn, 30 + 3 * 60, [in_flight])  # its lease ran out 3 minutes ago
        elapse(conn, 30 * 60, [dispatched])  # dispatched 30 minutes ago
    code, checks = doctor(clean, capsys)
    assert code == 1
    assert checks["relay"][0] == "FAIL" and "the relay is not running" in checks["relay"][1]
    assert checks["leases"][0] == "FAIL" and "the reconciler is not running" in checks["leases"][1]
    assert checks["dispatched"][0] == "FAIL" and "1 dispatched row(s)" in checks["dispatched"][1]


def test_a_lease_just_expired_is_not_yet_an_alarm(clean, engine, capsys):
    row_id = write(engine, "order:1")
    with connect(clean) as conn:
        claim(conn, row_id, lease_seconds=30)
        elapse(conn, 30 + 30, [row_id])  # its lease ran out 30 seconds ago
    code, checks = doctor(clean, capsys)
    assert code == 0 and checks["leases"][0] == "ok"


def test_failed_and_long_unknown_rows_warn_without_a_module(clean, engine, capsys, monkeypatch):
    failed = [write(engine, f"order:{i}") for i in range(2)]
    old_unknown, new_unknown = write(engine, "order:7"), write(engine, "order:8")
    with connect(clean) as conn:
        for row_id in failed:
            settle(conn, row_id, "failed")
        for row_id, since in ((old_unknown, 2 * 3600), (new_unknown, 10 * 60)):
            settle(conn, row_id, "unknown")
            elapse(conn, since, [row_id])
    code, checks = doctor(clean, capsys)
    # Rows waiting for a person break no invariant: WARN, exit 0, with the command to look.
    assert code == 0, checks
    assert checks["handlers"][0] == "off"
    status, detail = checks["failed"]
    assert (
        status == "WARN"
        and detail.startswith("2 failed row(s) (oldest failed ")
        and "`outbox failed`" in detail
    )
    status, detail = checks["unknown"]
    assert status == "WARN" and detail.startswith("1 row(s) unknown for more than 1h00m")
    assert "OUTBOX_UNKNOWN_ALERT_AFTER; oldest 2h00m)" in detail and "`outbox unknown`" in detail

    monkeypatch.setenv("OUTBOX_UNKNOWN_ALERT_AFTER", "5m")
    code, checks = doctor(clean, capsys)
    assert code == 0 and checks["unknown"][0] == "WARN"
    assert checks["unknown"][1].startswith("2 row(s) unknown for more than 5m00s")

    flags = ["--database-url", clean.database_url, "--redis-url", clean.redis_url]
    assert main(["doctor", *flags, "--namespace", clean.namespace]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["WARN", "failed"] for line in lines)
    # The verdict never says "all checks passed" under WARN lines: it counts them.
    warned = sum(1 for line in lines[:-1] if line.split()[0] == "WARN")
    assert warned >= 2 and lines[-1] == f"passed with {warned} warning(s)"


def test_handlers_are_checked_by_their_own_rules(clean, capsys, tmp_path, monkeypatch):
    # One set of declaration rules, Handler.problems (also behind @handler): doctor asks it.
    from outbox.handlers import Handler

    module = handler_module(tmp_path, monkeypatch, HANDLERS)
    # problems() names the destination in each sentence (declaration_problems): doctor adds no copy.
    monkeypatch.setattr(Handler, "problems", lambda self: [f"{self.destination}: the rule under test"])
    code, checks = doctor(clean, capsys, module)
    assert code == 1
    assert checks["handlers"] == ("FAIL", "handler payments.charge: the rule under test")


def test_schema_reports_the_range_this_code_works_with(clean, capsys):
    from outbox.migrate import SCHEMA_OLDEST, head_revision

    _, checks = doctor(clean, capsys)
    status, detail = checks["schema"]
    assert status == "ok"
    assert f"this code works with {SCHEMA_OLDEST} to {head_revision()}" in detail
