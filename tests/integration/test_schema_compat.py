"""Schema changes across a rolling deploy (expand/contract): the code works with every revision
from SCHEMA_OLDEST to its head and with newer ones no contract migration closed to it; the
previous release runs on the new head; revisions after 0007 build indexes on live tables
CONCURRENTLY. Real PostgreSQL and Redis; the previous release runs from `git archive`."""

from __future__ import annotations

import ast
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
import redis
from databases import fresh_database
from helpers import relay_once, wait_for, worker_thread
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox.db import make_engine
from outbox.exceptions import NotMigrated
from outbox.migrate import (
    FLOOR_TABLE,
    SCHEMA_OLDEST,
    check_database,
    check_schema,
    current_revision,
    head_revision,
    schema_status,
    upgrade,
)
from outbox.settings import libpq_url
from outbox.transport import delete_namespace

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = Path(str(resources.files("outbox.migrations"))) / "versions"

#: The last release: its tag and commit (docs/releases.md lists them all; a clone without tags
#: still has the commit). Bump both at each release: a revision added after it must leave that
#: code running (test_previous_release_*, test_previous_release_beside.py). History: 9dcb8e0
#: demanded the exact head, which is why issue 10 shipped no revision; 91058b4 (issue 11, schema
#: range 0007 and newer) is the release before 0008; 13b453f (issue 13 parts 1-2) the release
#: before 0010; ffe982d (issue 13) the release before 0012; v0.29 the release before 0022; v0.32
#: the release before 0025 (test_previous_release_beside ran it against the limits and the gate).
PREVIOUS_RELEASE_TAG = "v0.37"
PREVIOUS_RELEASE = "353278b"

#: The oldest code the database's floor lets start (migration 0022: code that knows the breaker,
#: 0010): its relay and worker run beside this code in test_previous_release_beside.py.
FLOOR_RELEASE = "ffe982d"

#: Revisions numbered below this were written before the rule; from this one on, the lint holds.
LINT_FROM = 8


# -- the revision files --------------------------------------------------------------------------


def revision_files() -> list[Path]:
    return sorted(p for p in VERSIONS.glob("*.py") if p.name != "__init__.py")


def _assigned(source: str, name: str) -> object:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no {name} = … in the revision")


def test_revisions_are_one_numbered_chain() -> None:
    """outbox.migrate tells a revision newer than the code from a foreign one by its number."""
    files = revision_files()
    assert files
    for number, path in enumerate(files, start=1):
        source = path.read_text()
        assert _assigned(source, "revision") == f"{number:04d}", path.name
        assert path.name.startswith(f"{number:04d}_"), path.name
        expected_down = None if number == 1 else f"{number - 1:04d}"
        assert _assigned(source, "down_revision") == expected_down, path.name
    assert head_revision() == f"{len(files):04d}"
    assert int(SCHEMA_OLDEST) <= len(files)


_CREATE_TABLE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?\"?(\w+)", re.I)
_CREATE_INDEX = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+(CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?[\w\"]*\s*ON\s+(?:ONLY\s+)?\"?(\w+)",
    re.I,
)
_ADD_UNIQUE = re.compile(
    r"ALTER\s+TABLE\s+(?:ONLY\s+)?\"?(\w+)\"?\s+ADD\s+(?:CONSTRAINT\s+\w+\s+)?(UNIQUE|PRIMARY\s+KEY)\s*\(",
    re.I,
)


def _literal(node: ast.expr | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def blocking_index_builds(source: str) -> list[str]:
    """Indexes a revision builds on a table it did not create, without CONCURRENTLY: each holds
    a lock that stops every write to a live table for the whole build."""
    tree = ast.parse(source)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    created: set[str] = set()
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    for call in calls:
        if call.func.attr == "create_table" and call.args:  # type: ignore[attr-defined]
            created.add(str(_literal(call.args[0])))
    for s in strings:
        created.update(m.group(1) for m in _CREATE_TABLE.finditer(s))
    found: list[str] = []
    for call in calls:
        attr = call.func.attr  # type: ignore[attr-defined]
        kw = {k.arg: k.value for k in call.keywords}
        if attr == "create_index":
            table = _literal(call.args[1] if len(call.args) > 1 else kw.get("table_name"))
            if table not in created and _literal(kw.get("postgresql_concurrently")) is not True:
                found.append(f"op.create_index on {table} without postgresql_concurrently=True")
        elif attr in ("create_unique_constraint", "create_primary_key"):
            table = _literal(call.args[1] if len(call.args) > 1 else kw.get("table_name"))
            if table not in created:
                found.append(f"op.{attr} on {table} builds its index under a lock")
    for s in strings:
        for m in _CREATE_INDEX.finditer(s):
            if not m.group(1) and m.group(2) not in created:
                found.append(f"CREATE INDEX on {m.group(2)} without CONCURRENTLY")
        for m in _ADD_UNIQUE.finditer(s):
            if m.group(1) not in created:
                found.append(f"ADD {m.group(2)} on {m.group(1)} builds its index under a lock")
    return found


def test_revisions_build_indexes_on_live_tables_concurrently() -> None:
    for path in revision_files():
        if int(path.name[:4]) >= LINT_FROM:
            problems = blocking_index_builds(path.read_text())
            assert problems == [], (
                f"{path.name}: {problems}; use outbox.migrations.helpers.create_index_concurrently "
                "(and for a unique constraint, ADD CONSTRAINT … USING INDEX on such an index)"
            )


def test_the_index_lint_catches_what_it_must() -> None:
    bad = """
op.create_index("ix_a", "outbox_message", ["destination"])
op.execute("CREATE INDEX ix_b ON outbox_message (key)")
op.execute("create unique index if not exists ix_c on outbox_attempt (id)")
op.create_unique_constraint("uq", "outbox_message", ["key"])
op.execute("ALTER TABLE outbox_message ADD CONSTRAINT uq2 UNIQUE (key)")
"""
    assert len(blocking_index_builds(bad)) == 5, blocking_index_builds(bad)
    good = """
create_index_concurrently(op, "ix_a", "outbox_message", ["destination"])
op.create_index("ix_b", "outbox_message", ["key"], postgresql_concurrently=True)
op.execute("CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_c ON outbox_message (key)")
op.create_table("outbox_new", sa.Column("id", sa.Integer()))
op.create_index("ix_d", "outbox_new", ["id"])
op.execute("CREATE TABLE outbox_other (id int); CREATE INDEX ix_e ON outbox_other (id)")
"""
    assert blocking_index_builds(good) == []
    assert blocking_index_builds(ADDITIVE) == []


# -- temporary revisions -------------------------------------------------------------------------

ADDITIVE = '''"""Temporary additive revision (test): a nullable column and an index built concurrently."""
import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import create_index_concurrently, drop_index_concurrently

revision = "{rev}"
down_revision = "{down}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_message", sa.Column("tenant", sa.Text(), nullable=True))
    create_index_concurrently(op, "outbox_message_tenant_idx", "outbox_message", ["tenant"])


def downgrade() -> None:
    drop_index_concurrently(op, "outbox_message_tenant_idx", "outbox_message")
    op.drop_column("outbox_message", "tenant")
'''

CONTRACT = '''"""Temporary contract revision (test): code older than {needs} may no longer run."""
from alembic import op

from outbox.migrations.helpers import forget_code_requirement, require_code_from

revision = "{rev}"
down_revision = "{down}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    require_code_from(op, "{needs}", migration=revision)


def downgrade() -> None:
    forget_code_requirement(op, migration=revision)
'''


def _number(n: int) -> str:
    return f"{n:04d}"


def scripts_with(directory: Path, *templates: str) -> str:
    """A copy of the packaged migrations with ``templates`` appended as the next revisions."""
    target = directory / "migrations"
    shutil.copytree(VERSIONS.parent, target, ignore=shutil.ignore_patterns("__pycache__"))
    n = int(head_revision())
    for template in templates:
        n += 1
        rev = _number(n)
        source = template.format(rev=rev, down=_number(n - 1), needs="{needs}")
        (target / "versions" / f"{rev}_temporary.py").write_text(source)
    return str(target)


@pytest.fixture
def database(services) -> Iterator[Engine]:
    with fresh_database(services.database_url, "outbox_compat") as url:
        eng = make_engine(url)
        try:
            yield eng
        finally:
            eng.dispose()


@pytest.fixture
def namespace(services) -> Iterator[str]:
    name = f"compat{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(services.redis_url)
    try:
        delete_namespace(client, name)
    finally:
        client.close()


def url_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def write_one(engine: Engine, key: str = "order:1") -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination="payments.charge", payload={"amount_cents": 100}
        ).id


def relay_all(engine: Engine, services, namespace: str) -> int:
    return relay_once(
        SimpleNamespace(database_url=url_of(engine), redis_url=services.redis_url, namespace=namespace)
    )


def state_of(engine: Engine, row_id: int) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(text("SELECT state FROM outbox_message WHERE id = :i"), {"i": row_id}).scalar()
        )


def fresh_write_engine(engine: Engine) -> Engine:
    # outbox.write checks the schema once per engine: a new engine makes it check again.
    return make_engine(url_of(engine))


# -- (b) this code on the oldest schema it declares ----------------------------------------------


def test_this_code_runs_on_the_oldest_schema_it_declares(
    database, services, namespace, provider, monkeypatch
):
    upgrade(database, SCHEMA_OLDEST)
    with database.connect() as conn:
        assert current_revision(conn) == SCHEMA_OLDEST
        status = schema_status(conn)
    assert status.ok, status
    check_database(url_of(database))
    row = write_one(database)
    assert relay_all(database, services, namespace) == 1
    assert state_of(database, row) == "dispatched"
    monkeypatch.setenv("SHOP_PROVIDER_URL", provider.url)
    import importlib

    import outbox.demo.handlers as shop

    importlib.reload(shop)
    from outbox.handlers import registry

    svc = SimpleNamespace(database_url=url_of(database), redis_url=services.redis_url, namespace=namespace)
    try:
        with worker_thread(svc, threads=1, handlers=registry()):
            wait_for(lambda: state_of(database, row) == "sent", 30, "the row to be delivered")
    finally:
        outbox.handlers.clear_registry()


# -- (e) older than SCHEMA_OLDEST ----------------------------------------------------------------


def test_a_schema_older_than_the_oldest_is_refused(database) -> None:
    older = _number(int(SCHEMA_OLDEST) - 1)
    upgrade(database, older)
    expected = f"database is at revision {older}, this version needs {SCHEMA_OLDEST} or later"
    with database.connect() as conn:
        with pytest.raises(NotMigrated, match=f"run `outbox migrate`.*{expected}"):
            check_schema(conn)
        assert not schema_status(conn).ok
        assert conn.execute(text("SELECT 1")).scalar() == 1  # the transaction is still usable
    with pytest.raises(NotMigrated, match=expected):
        check_database(url_of(database), wait_seconds=0)
    engine = fresh_write_engine(database)
    try:
        with pytest.raises(NotMigrated, match=expected), Session(engine) as s:
            outbox.write(s, key="order:1", step="charge", destination="payments.charge", payload={})
    finally:
        engine.dispose()


# -- (c) an additive revision newer than the code ------------------------------------------------


def test_an_additive_revision_newer_than_the_code_is_tolerated(database, services, namespace, tmp_path):
    scripts = scripts_with(tmp_path, ADDITIVE)
    newer = _number(int(head_revision()) + 1)
    assert upgrade(database, script_location=scripts) == (None, newer)
    with database.connect() as conn:
        status = schema_status(conn)
        definition = conn.execute(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'outbox_message_tenant_idx'")
        ).scalar()
        valid = conn.execute(
            text("SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_message_tenant_idx'::regclass")
        ).scalar()
    # The floor is the feature's that 0022 enabled on this new database (payload versions, 0016),
    # which this code meets.
    assert status.ok and status.current == newer and status.floor == "0016", status
    assert "newer than this code" in status.describe()
    assert definition is not None and valid is True
    check_database(url_of(database))
    row = write_one(database)
    assert relay_all(database, services, namespace) == 1
    assert state_of(database, row) == "dispatched"
    # The run is recorded as one revision at a time even though the index build committed mid-run.
    assert upgrade(database, script_location=scripts) == (newer, newer)


def test_concurrent_migrations_with_a_concurrent_index_both_succeed(database, tmp_path) -> None:
    """The lock is held for the session and polled: a run waiting for it holds no snapshot that
    the index build would wait for (a deadlock with a blocking lock), and the build's commit
    mid-run does not let the other run in."""
    import threading

    scripts = scripts_with(tmp_path, ADDITIVE)
    results: list[object] = []

    def run() -> None:
        try:
            results.append(upgrade(database, script_location=scripts))
        except Exception as exc:  # pragma: no cover - reported below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    newer = _number(int(head_revision()) + 1)
    assert sorted(results, key=str) == sorted([(None, newer), (newer, newer)], key=str), results


# -- (d) a contract revision that needs newer code -----------------------------------------------


def test_a_contract_revision_makes_older_code_refuse_in_one_line(database, tmp_path) -> None:
    needs = _number(int(head_revision()) + 1)
    scripts = scripts_with(tmp_path, ADDITIVE, CONTRACT.replace("{needs}", needs))
    contract = _number(int(head_revision()) + 2)
    upgrade(database, script_location=scripts)
    expected = f"the database needs outbox code from revision {needs}; this is {head_revision()}"
    with database.connect() as conn:
        status = schema_status(conn)
        assert (status.current, status.floor, status.problem) == (contract, needs, expected)
        with pytest.raises(NotMigrated) as info:
            check_schema(conn)
    assert "\n" not in str(info.value) and expected in str(info.value)
    with pytest.raises(NotMigrated, match=re.escape(expected)):
        check_database(url_of(database), wait_seconds=0)
    # Downgraded past the contract, the requirement goes with it.
    from alembic import command

    from outbox.migrate import alembic_config

    with database.connect() as conn:
        command.downgrade(alembic_config(conn, scripts), needs)
        conn.commit()
        assert check_schema(conn) is None
        left = conn.execute(text(f"SELECT migration FROM {FLOOR_TABLE}")).scalars().all()
        assert sorted(left) == ["0022", "feature:payload_versions"]  # the head's own stay


def test_a_requirement_this_code_meets_is_no_refusal(database, tmp_path) -> None:
    scripts = scripts_with(tmp_path, CONTRACT.replace("{needs}", head_revision()))
    upgrade(database, script_location=scripts)
    with database.connect() as conn:
        status = schema_status(conn)
    assert status.ok and status.floor == head_revision(), status


# -- (a) the previous release on the new head ----------------------------------------------------


def test_the_previous_release_is_the_newest_listed_and_tagged() -> None:
    """docs/releases.md's newest entry is PREVIOUS_RELEASE; its tag, where the clone has tags,
    names that commit."""
    listed = re.findall(
        r"^\| (v\d+\.\d+) \| ([0-9a-f]{7,40}) \|", (ROOT / "docs" / "releases.md").read_text(), re.M
    )
    assert listed, "docs/releases.md lists no release"
    assert listed[0] == (PREVIOUS_RELEASE_TAG, PREVIOUS_RELEASE), listed[0]
    git = shutil.which("git")
    if git is None:
        return
    tagged = subprocess.run(
        [git, "-C", str(ROOT), "rev-parse", "--verify", "-q", f"refs/tags/{PREVIOUS_RELEASE_TAG}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if tagged.returncode == 0:  # a clone without tags has the commit only
        assert tagged.stdout.strip().startswith(PREVIOUS_RELEASE), tagged.stdout


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory) -> Path:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: cannot extract the previous release")
    probe = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"no git history with commit {PREVIOUS_RELEASE} (not a clone of the repository?)")
    tree = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(
        [git, "-C", str(ROOT), "archive", "--format=tar", PREVIOUS_RELEASE], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    # Installed, the migrations are the package outbox.migrations; from a source tree they sit
    # in migrations/. Without this copy the import would fall through to this tree's (editable
    # install) and the old code would see this code's head.
    if not (tree / "outbox" / "migrations").exists():  # releases before v0.31 (no link)
        shutil.copytree(tree / "migrations", tree / "outbox" / "migrations")
    return tree


def run_previous(tree: Path, args: list[str], env: dict[str, str], **kw) -> subprocess.Popen[str]:
    # cwd: `python -m`/`-c` put the working directory first on sys.path; it must not be this tree.
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def previous_env(tree: Path, engine: Engine, services, namespace: str, **extra: str) -> dict[str, str]:
    env = services.env(
        OUTBOX_DATABASE_URL=url_of(engine), OUTBOX_NAMESPACE=namespace, PYTHONPATH=str(tree), **extra
    )
    return env


PREVIOUS_WRITE = textwrap.dedent(
    """
    import os, sys
    from importlib import resources
    from sqlalchemy.orm import Session
    import outbox
    from outbox.db import make_engine
    from outbox.migrate import check_database, head_revision

    tree = sys.argv[1]
    assert outbox.__file__.startswith(tree), outbox.__file__
    assert str(resources.files("outbox.migrations")).startswith(tree)
    url = os.environ["OUTBOX_DATABASE_URL"]
    check_database(url)
    engine = make_engine(url)
    with Session(engine) as s, s.begin():
        w = outbox.write(s, key="order:old", step="charge", destination="payments.charge",
                         payload={"amount_cents": 100, "currency": "EUR"})
    print("written", w.id, "head", head_revision())
    """
)


def test_previous_release_writes_relays_and_delivers_on_the_new_head(
    previous_release, database, services, namespace, provider
) -> None:
    upgrade(database)  # by this code: the new head
    env = previous_env(previous_release, database, services, namespace, SHOP_PROVIDER_URL=provider.url)
    proc = run_previous(previous_release, ["-c", PREVIOUS_WRITE, str(previous_release)], env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    row = int(out.split("written ", 1)[1].split()[0])
    proc = run_previous(previous_release, ["-m", "outbox", "relay", "--once"], env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "relay published 1 rows" in out, out
    worker = run_previous(
        previous_release, ["-m", "outbox", "worker", "examples.shop.handlers", "--threads", "1"], env
    )
    try:
        wait_for(lambda: worker.poll() is not None or state_of(database, row) == "sent", 60, "the delivery")
        assert state_of(database, row) == "sent", worker.stdout.read() if worker.stdout else ""
    finally:
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert provider.stats()["charges"] == 1


def test_previous_release_on_a_revision_newer_than_it_knows(
    previous_release, database, services, namespace, tmp_path
):
    """A release that declares SCHEMA_OLDEST tolerates an additive revision newer than it; the
    release before this rule (9dcb8e0) demands its exact head, which is why no revision may
    ship until the previous release is one that tolerates it."""
    upgrade(database, script_location=scripts_with(tmp_path, ADDITIVE))
    env = previous_env(previous_release, database, services, namespace)
    check = "import os; from outbox.migrate import check_database as c; c(os.environ['OUTBOX_DATABASE_URL'])"
    proc = run_previous(previous_release, ["-c", check], env)
    out, _ = proc.communicate(timeout=60)
    tolerant = "SCHEMA_OLDEST" in (previous_release / "outbox" / "migrate.py").read_text()
    if tolerant:
        assert proc.returncode == 0, out
    else:
        assert proc.returncode != 0 and "NotMigrated" in out and "this version needs" in out, out


# -- outbox doctor -------------------------------------------------------------------------------


def doctor_schema(engine: Engine, services, namespace: str, capsys) -> tuple[str, str]:
    import json

    from outbox.cli import main

    flags = ["--database-url", url_of(engine), "--redis-url", services.redis_url, "--namespace", namespace]
    main(["doctor", *flags, "--json"])
    checks = {c["name"]: (c["status"], c["detail"]) for c in json.loads(capsys.readouterr().out)["checks"]}
    return checks["schema"]


def test_doctor_reports_the_schema_range(database, services, namespace, capsys, tmp_path) -> None:
    head = head_revision()
    newer, contract = _number(int(head) + 1), _number(int(head) + 2)
    upgrade(database, SCHEMA_OLDEST)
    assert doctor_schema(database, services, namespace, capsys) == (
        "ok",
        f"at revision {SCHEMA_OLDEST} (this code works with {SCHEMA_OLDEST} to {head})",
    )
    upgrade(database, script_location=scripts_with(tmp_path / "a", ADDITIVE))
    status, detail = doctor_schema(database, services, namespace, capsys)
    assert status == "ok" and detail.startswith(f"at revision {newer}, newer than this code"), detail
    upgrade(
        database, script_location=scripts_with(tmp_path / "b", ADDITIVE, CONTRACT.replace("{needs}", newer))
    )
    status, detail = doctor_schema(database, services, namespace, capsys)
    assert status == "FAIL", detail
    assert f"the database needs outbox code from revision {newer}; this is {head}" in detail
    with database.connect() as conn:
        assert current_revision(conn) == contract


def test_migrate_of_an_older_release_on_a_newer_schema_is_a_no_op(database, services, tmp_path) -> None:
    """A pod of the previous release restarting mid-deploy runs its own migrate step first."""
    upgrade(database, script_location=scripts_with(tmp_path, ADDITIVE))
    newer = _number(int(head_revision()) + 1)
    assert upgrade(database) == (newer, newer)
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--database-url", url_of(database)],
        env=services.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"already at revision {newer}; nothing to do" in proc.stdout
    with database.connect() as conn:
        assert current_revision(conn) == newer


def test_every_schema_the_code_accepts_refuses_a_colon_step_from_plain_sql(services) -> None:
    """(attack on issue 10) The guarantee's "a key is one header" rests on the step CHECK of
    revision 0007: a schema the code accepts must have it, or a plain-SQL writer could insert
    ("order:1", "refund:2") beside ("order:1:refund", "2"), both sending "order:1:refund:2"."""
    insert = (
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES (%s, %s, 'payments.refund', '{}') RETURNING id"
    )
    with fresh_database(services.database_url, "outbox_oldest_check") as url:
        engine = make_engine(url)
        try:
            upgrade(engine, SCHEMA_OLDEST)
            with engine.connect() as conn:
                check_schema(conn)
                assert schema_status(conn).ok
        finally:
            engine.dispose()
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute(insert, ("order:1:refund", "2"))
            with pytest.raises(psycopg.errors.CheckViolation):
                c.execute(insert, ("order:1", "refund:2"))
