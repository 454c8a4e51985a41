"""`outbox demo` as a user runs it: a real process on embedded servers that ends in a clean
audit, and that leaves nothing behind — no process, no directory — when interrupted with Ctrl-C.
Then the same against servers of one's own, where it keeps to its own names and refuses to
run over data that is not its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
import redis

from outbox.settings import libpq_url

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
    assert re.search(r"outbox repair demo-invoice:\S+ --module outbox.demo.invoicing --yes", output), output
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


def test_every_package_of_outbox_is_in_the_distribution():
    """A package missing from pyproject's list works in a checkout and is absent from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "outbox").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert {"outbox.demo", "outbox.testing"} <= found
    assert found - listed == set()


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
def own_servers(clean):
    """The test services stand in for a user's; the demo's table and keys are removed after."""

    def drop() -> None:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS outbox_demo_orders")
        client = redis.Redis.from_url(clean.redis_url)
        try:
            keys = list(client.scan_iter(match="outbox-demo:*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()

    drop()
    yield clean
    drop()


def url_args(services) -> list[str]:
    return ["--database-url", services.database_url, "--redis-url", services.redis_url]


@pytest.mark.timeout(300)
def test_on_servers_of_ones_own_the_demo_keeps_to_its_own_names(own_servers, engine):
    from sqlalchemy.orm import Session

    import outbox

    services = own_servers
    # An earlier demo run, interrupted, left a row its (long gone) provider never saw.
    with Session(engine) as s, s.begin():
        outbox.write(
            s, key="demo-order:left-over", step="charge", destination="demo.payments.charge", payload={"n": 1}
        )
    client = redis.Redis.from_url(services.redis_url)
    sentinel = f"{services.namespace}:not-the-demos"
    client.set(sentinel, "untouched")
    try:
        demo = start_demo("--orders", "60", "--rate", "30", *url_args(services))
        output, _ = demo.communicate(timeout=240)
        assert demo.returncode == 0, output
        assert_clean_audit(output, 60)
        assert "PostgreSQL yours" in output and "Redis yours" in output
        assert "closed 1 demo rows left unfinished by an earlier run (1 cancelled, 0 failed)" in output
        # Its "flush" deleted its own namespace only.
        assert re.search(r"deleted the \d+ keys of namespace 'outbox-demo'", output), output
        assert client.get(sentinel) == b"untouched"
    finally:
        client.delete(sentinel)
        client.close()
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        keys = conn.execute("SELECT DISTINCT destination FROM outbox_message ORDER BY 1").fetchall()
        assert keys == [("demo.invoicing.issue",), ("demo.invoicing.notify",), ("demo.payments.charge",)]
        left_over = conn.execute("SELECT state FROM outbox_message WHERE key = 'demo-order:left-over'")
        assert left_over.fetchall() == [("cancelled",)]
        assert conn.execute("SELECT count(*) FROM outbox_demo_orders").fetchone() == (60,)


@pytest.mark.timeout(180)
def test_the_demo_refuses_an_orders_table_that_is_not_its_own(own_servers):
    with psycopg.connect(libpq_url(own_servers.database_url), autocommit=True) as conn:
        conn.execute("CREATE TABLE outbox_demo_orders (id bigint PRIMARY KEY, sku text)")
    demo = start_demo("--orders", "10", *url_args(own_servers))
    output, _ = demo.communicate(timeout=150)
    assert demo.returncode == 2, output
    assert "already exists with columns" in output
    with psycopg.connect(libpq_url(own_servers.database_url)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_message").fetchone() == (0,)


@pytest.mark.timeout(180)
def test_the_demo_refuses_a_database_with_unfinished_rows_of_others(own_servers, engine):
    from sqlalchemy.orm import Session

    import outbox

    with Session(engine) as s, s.begin():
        outbox.write(
            s, key="order:1", step="charge", destination="payments.charge", payload={"amount_cents": 1}
        )
    demo = start_demo("--orders", "10", *url_args(own_servers))
    output, _ = demo.communicate(timeout=150)
    assert demo.returncode == 2, output
    assert "unfinished outbox rows that are not the demo's (payments.charge: 1)" in output
    with psycopg.connect(libpq_url(own_servers.database_url)) as conn:
        assert conn.execute("SELECT state FROM outbox_message").fetchall() == [("pending",)]


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
