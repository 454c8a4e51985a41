"""`outbox demo` as a user runs it: a real process on embedded servers that ends in a clean
audit, and that leaves nothing behind — no process, no directory — when interrupted with Ctrl-C.
Then beside an application's servers: their URLs in the environment are not the demo's, and
servers given on its command line are left exactly as they were."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from outbox.settings import libpq_url
from outbox.transport import delete_namespace

ROOT = Path(__file__).resolve().parents[2]


def demo_env(**extra: str) -> dict[str, str]:
    # No URL: the demo must start its own servers, as on a fresh machine.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "SHOP_"))}
    env.update(extra)
    return env


def start_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbox", "demo", *args],
        cwd=ROOT,
        env=env or demo_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Its own session, so that the SIGINT below reaches the demo alone, as the terminal's
        # Ctrl-C reaches only the foreground process group.
        start_new_session=True,
    )


def audit_value(output: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s+(\S+)", output, re.MULTILINE)
    assert match, f"no {label!r} line in the audit:\n{output}"
    return match.group(1)


def assert_clean_audit(output: str, orders: int) -> None:
    assert audit_value(output, "orders written") == str(orders), output
    assert audit_value(output, "provider charges") == str(orders), output
    assert audit_value(output, "keys charged twice") == "0", output
    assert audit_value(output, "rows not terminal") == "0", output
    assert audit_value(output, "orders not settled exactly once") == "0", output
    assert re.search(r"^\s*unknowns resolved by the reconciler\s+\d+", output, re.MULTILINE), output
    assert re.search(r"^\s*elapsed\s+[\d.]+ s", output, re.MULTILINE), output
    assert "\nPASS:" in output, output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_runs_with_chaos_and_ends_in_a_clean_audit():
    started = time.monotonic()
    demo = start_demo("--orders", "100", "--rate", "50")
    try:
        output, _ = demo.communicate(timeout=240)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 0, output
    assert time.monotonic() - started < 150, output
    assert_clean_audit(output, 100)
    # The chaos did happen: workers, the relay and Redis were all hit.
    assert re.search(
        r"chaos: workers SIGKILLed [1-9]\d*x \(restarted [1-9]\d*x\), relay SIGKILLed 1x, Redis flushed 1x",
        output,
    )
    # The provider outage (issue 13): the breaker tripped, a bounded number of calls reached the
    # provider while it was down, and no row failed for it.
    outage = re.search(
        r"provider outage: [\d.]+ s of 503s; (\d+) call\(s\) reached it meanwhile .*breaker tripped "
        r"([1-9]\d*)x, (\d+) probe\(s\); rows failed: 0",
        output,
    )
    assert outage, output
    assert int(outage.group(1)) <= 30, outage.group(0)
    assert "the provider is DOWN" in output and "the provider is BACK" in output
    assert "outbox audit:" in output and "OK: no violation" in output
    # The chain phase (issue 14): a worker killed between two steps, an unknown step repaired.
    assert "the worker was SIGKILLed right after committing `issue` sent" in output, output
    assert re.search(r"outbox repair outbox.demo.invoicing demo-invoice:\S+ --yes", output), output
    assert "the provider has it" in output and "sent, no second call" in output, output
    assert "the provider took each exactly once (6 calls for 6 steps)" in output, output
    workdir = re.search(r"working directory (\S+)", output).group(1)
    assert not Path(workdir).exists(), "the demo left its directory behind"


# -- from an install ---------------------------------------------------------------------------------


def outside_the_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` with no PYTHONPATH entry inside the checkout: the editable install then maps only
    the distribution's packages, as a wheel would install them, and ``examples`` is out of reach."""
    env = dict(env)
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and not _in_checkout(Path(p))]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def _in_checkout(path: Path) -> bool:
    resolved = path.resolve()
    return resolved == ROOT or ROOT in resolved.parents


@pytest.mark.timeout(180)
def test_the_demo_runs_from_an_install_in_any_directory(tmp_path):
    env = outside_the_checkout(demo_env())
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; "
            "print(u.find_spec('examples') is None, u.find_spec('outbox.demo.shop') is not None)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr
    demo = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--orders", "10", "--rate", "20", "--no-chaos", "--plain"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=150,
    )
    assert demo.returncode == 0, demo.stdout
    assert_clean_audit(demo.stdout, 10)


def _packages_in_checkout() -> set[str]:
    # os.walk follows the links outbox/relay, outbox/reconciler and outbox/migrations (rglob
    # before Python 3.13 does not).
    found = set()
    for directory, dirs, files in os.walk(ROOT / "outbox", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.add(".".join(Path(directory).relative_to(ROOT).parts))
    return found


def test_every_package_of_outbox_is_in_the_distribution():
    """A package missing from pyproject's list works in a checkout and is absent from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = _packages_in_checkout()
    assert {"outbox.demo", "outbox.testing", "outbox.relay", "outbox.reconciler.jobs"} <= found
    assert found - listed == set()


@pytest.mark.timeout(240)
def test_the_wheel_installs_one_import_package(tmp_path):
    """Everything is inside ``outbox`` (the folders relay/, reconciler/ and migrations/ are
    installed as outbox.relay, outbox.reconciler and outbox.migrations): top-level ``relay`` and
    ``reconciler`` are other projects' names on the package index."""
    import zipfile

    # Built from a copy: setuptools leaves a build/ folder in the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".demo", ".artifacts"
        ),
    )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    # setuptools' warnings (a license table, data folders outside the packages) are pip's to relay.
    assert "BuildBackendWarning" not in built.stderr, built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"outbox"}
    modules = {n[: -len(".py")].replace("/", ".") for n in names if n.endswith(".py")}
    assert {"outbox.relay.relay", "outbox.reconciler.jobs.purge", "outbox.migrations.env"} <= modules
    packaged = {m.rsplit(".", 1)[0] for m in modules if m.endswith(".__init__")}
    assert packaged == _packages_in_checkout()


# -- Ctrl-C ------------------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    try:
        import psutil
    except ImportError:
        return _descendants_from_proc(pid)
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _descendants_from_proc(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may hold spaces and parentheses: the fields follow the last ')'.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _mentioning(marker: str) -> set[int]:
    """Processes whose command line mentions ``marker`` (postgres is not the demo's descendant:
    pg_ctl detaches it, but its data directory is inside the demo's)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class OutputReader:
    """Collects the demo's output on a thread, so the test can wait for a line without blocking."""

    def __init__(self, demo: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(demo,), daemon=True)
        self._thread.start()

    def _read(self, demo: subprocess.Popen[str]) -> None:
        assert demo.stdout is not None
        with demo.stdout:
            for line in demo.stdout:
                self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_seconds: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text)
            if match:
                return match
            if not self._thread.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"the demo never printed {pattern!r}:\n{self.text}")

    def finish(self, timeout_seconds: float) -> str:
        self._thread.join(timeout_seconds)
        return self.text


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_process_and_removes_the_directory():
    demo = start_demo("--orders", "2000", "--rate", "50")
    output = OutputReader(demo)
    try:
        workdir = output.wait_for(r"working directory (\S+)", 60).group(1)
        output.wait_for(r"started: .*reconciler", 150)
        time.sleep(3)  # orders flowing, chaos under way
        running = _descendants(demo.pid) | _mentioning(workdir)
        assert len(running) >= 6, f"expected the demo's processes to be running: {running}"
        interrupted_at = time.monotonic()
        os.kill(demo.pid, signal.SIGINT)
        demo.wait(60)
        took = time.monotonic() - interrupted_at
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    text = output.finish(10)
    assert demo.returncode == 130, text
    assert took < 30, f"the demo took {took:.1f} s to stop\n{text}"
    assert "interrupted" in text
    # Orphans are reparented and reaped by init; give that a moment.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in running):
        time.sleep(0.1)
    survivors = {p for p in running if _alive(p)}
    assert not survivors, f"processes of the demo survived Ctrl-C: {survivors}\n{text}"
    assert not _mentioning(workdir), text
    assert not Path(workdir).exists(), f"{workdir} is still there\n{text}"


# -- on servers of one's own -------------------------------------------------------------------------


@pytest.fixture
def users_servers(services, empty_database_url) -> Iterator[SimpleNamespace]:
    """A user's application database (a table of theirs, rows in it) and Redis database (keys of
    their application), as the quickstart leaves them."""
    with psycopg.connect(libpq_url(empty_database_url), autocommit=True) as conn:
        conn.execute("CREATE TABLE shop_orders (id bigint PRIMARY KEY, sku text NOT NULL)")
        conn.execute("INSERT INTO shop_orders SELECT n, 'sku-' || n FROM generate_series(1, 51) n")
    client = redis.Redis.from_url(services.redis_url)
    # The demo's namespace is the demo's: what an earlier run left there is not the user's.
    delete_namespace(client, "outbox-demo")
    mine = {"outbox:dramatiq:default": "queued", "shop:session:42": "a user's session"}
    for key, value in mine.items():
        client.set(key, value)
    try:
        yield SimpleNamespace(database_url=empty_database_url, redis_url=services.redis_url)
    finally:
        client.delete(*mine)
        client.close()


# Schemas of the user's, not the server's catalogs nor a session's temporary ones.
_USERS = "n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp)'"


def database_snapshot(url: str) -> dict[str, object]:
    """Everything a run could leave in a database: schemas, relations, functions, the rows."""
    with psycopg.connect(libpq_url(url)) as conn:
        return {
            "schemas": conn.execute(
                f"SELECT n.nspname FROM pg_namespace n WHERE {_USERS} ORDER BY 1"
            ).fetchall(),
            "relations": conn.execute(
                "SELECT n.nspname, c.relname, c.relkind FROM pg_class c "
                f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {_USERS} ORDER BY 1, 2"
            ).fetchall(),
            "functions": conn.execute(
                "SELECT n.nspname, p.proname FROM pg_proc p "
                f"JOIN pg_namespace n ON n.oid = p.pronamespace WHERE {_USERS} ORDER BY 1, 2"
            ).fetchall(),
            "rows": conn.execute("SELECT * FROM shop_orders ORDER BY id").fetchall(),
        }


def demo_databases(url: str) -> list[str]:
    """The databases named like the demo's own on the server of ``url``."""
    with psycopg.connect(libpq_url(url)) as conn:
        found = conn.execute("SELECT datname FROM pg_database WHERE starts_with(datname, 'outbox_demo_')")
        return sorted(r[0] for r in found)


def redis_snapshot(url: str) -> dict[bytes, bytes | None]:
    client = redis.Redis.from_url(url)
    try:
        return {key: client.dump(key) for key in client.scan_iter()}
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_the_environment_of_an_application_does_not_configure_the_demo(users_servers):
    """The quickstart exported OUTBOX_DATABASE_URL and OUTBOX_REDIS_URL: the demo still starts
    servers of its own, and the application's database and Redis are exactly as they were."""
    before = database_snapshot(users_servers.database_url), redis_snapshot(users_servers.redis_url)
    env = demo_env(OUTBOX_DATABASE_URL=users_servers.database_url, OUTBOX_REDIS_URL=users_servers.redis_url)
    demo = start_demo("--orders", "5", "--rate", "50", "--no-chaos", "--no-chain", "--plain", env=env)
    output, _ = demo.communicate(timeout=200)
    assert demo.returncode == 0, output
    assert_clean_audit(output, 5)
    assert "PostgreSQL embedded" in output and "Redis embedded" in output, output
    assert (database_snapshot(users_servers.database_url), redis_snapshot(users_servers.redis_url)) == before


def url_args(servers) -> list[str]:
    return ["--database-url", servers.database_url, "--redis-url", servers.redis_url]


@pytest.mark.timeout(300)
def test_on_servers_of_ones_own_the_demo_leaves_nothing_behind(users_servers):
    """Given on its command line, a PostgreSQL of one's own holds a database the demo creates and
    drops (the one the URL names is never written), and a Redis of one's own only the demo's
    namespace, deleted before, at the chaos's "flush" and after."""
    database_before = database_snapshot(users_servers.database_url)
    redis_before = redis_snapshot(users_servers.redis_url)
    assert redis_before, "the user's keys are there"
    demo_databases_before = demo_databases(users_servers.database_url)
    demo = start_demo("--orders", "60", "--rate", "30", *url_args(users_servers))
    output, _ = demo.communicate(timeout=240)
    assert demo.returncode == 0, output
    assert_clean_audit(output, 60)
    assert "PostgreSQL yours" in output and "a database of its own, dropped at the end" in output, output
    assert "Redis yours" in output, output
    # Its "flush" deleted its own namespace only.
    assert re.search(r"deleted the \d+ keys of namespace 'outbox-demo'", output), output
    assert database_snapshot(users_servers.database_url) == database_before
    assert redis_snapshot(users_servers.redis_url) == redis_before
    assert demo_databases(users_servers.database_url) == demo_databases_before


@pytest.mark.timeout(120)
def test_a_role_that_may_not_create_the_demos_database_is_refused(users_servers):
    role = f"demo_no_createdb_{os.getpid()}"
    url = make_url(users_servers.database_url)
    with psycopg.connect(libpq_url(users_servers.database_url), autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN NOCREATEDB')
    try:
        before = database_snapshot(users_servers.database_url)
        as_role = url.set(username=role, password=None).render_as_string(hide_password=False)
        demo = start_demo("--orders", "5", "--plain", "--database-url", as_role)
        output, _ = demo.communicate(timeout=100)
        assert demo.returncode == 2, output
        assert "a database of its own" in output and "CREATEDB" in output, output
        assert database_snapshot(users_servers.database_url) == before
    finally:
        with psycopg.connect(libpq_url(users_servers.database_url), autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


# -- the display -------------------------------------------------------------------------------------


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_progress_is_a_live_panel_on_a_terminal_and_plain_lines_without_rich(monkeypatch):
    from types import SimpleNamespace

    from outbox.demo import display as demo_display

    monkeypatch.setattr(demo_display, "sys", SimpleNamespace(stdout=_Terminal()))
    assert isinstance(demo_display.make_display(), demo_display.RichDisplay)
    assert isinstance(demo_display.make_display(plain=True), demo_display.PlainDisplay)
    monkeypatch.setitem(sys.modules, "rich", None)  # as if rich were not installed
    assert isinstance(demo_display.make_display(), demo_display.PlainDisplay)
