"""docs/quickstart.md as a new user runs it: the page's own commands and code, read from the page
(so that it cannot drift from what works), in an application directory of their own with nothing
of this repository on the import path, against the test's PostgreSQL and Redis.

The commands run as the console script `outbox` a user has on PATH, from the application's
directory; the handler module is found there, not through PYTHONPATH. The order the page's script
writes ends `sent`, charged exactly once by `outbox provider`, and `outbox status` prints what the
page shows."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import free_port, sql, wait_for

from outbox.settings import normalize_database_url

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
#: The commands that run until stopped; every other command of the page runs to its end.
SERVICES = frozenset({"provider", "relay", "worker", "reconcile"})

pytestmark = pytest.mark.timeout(180)


def section(page: str, number: int) -> str:
    """The text of the page's step ``number`` (from its heading to the next heading)."""
    match = re.search(rf"^## {number}\. .*?(?=^## )", page, re.MULTILINE | re.DOTALL)
    assert match, f"docs/quickstart.md has no step {number}"
    return match.group(0)


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def command_lines(block: str) -> list[list[str]]:
    return [tokens for line in block.splitlines() if (tokens := shlex.split(line, comments=True))]


class User:
    """A shell in the application's directory: the page's variables, its commands, its processes."""

    def __init__(self, app: Path, services: Any, logs: Path) -> None:
        self.app = app
        self.logs = logs
        outbox = shutil.which("outbox", path=str(Path(sys.executable).parent))
        assert outbox, f"no `outbox` console script beside {sys.executable}: install the project"
        self.programs = {"outbox": outbox, "python": sys.executable}
        self.env = services.env()
        # As in a user's shell: nothing of this repository on the import path.
        self.env.pop("PYTHONPATH", None)
        self.env["PATH"] = os.pathsep.join([str(Path(outbox).parent), self.env.get("PATH", "")])
        # The page's own variables are exported with the test's servers in them; SQLAlchemy (the
        # page's script) needs the driver named, which outbox accepts too.
        self.own = {
            "OUTBOX_DATABASE_URL": normalize_database_url(services.database_url),
            "OUTBOX_REDIS_URL": services.redis_url,
        }
        self.running: list[tuple[subprocess.Popen[bytes], Path]] = []

    def argv(self, tokens: list[str]) -> list[str]:
        assert tokens[0] in self.programs, f"the page runs {tokens[0]!r}: teach this test what it is"
        return [self.programs[tokens[0]], *tokens[1:]]

    def run(self, tokens: list[str]) -> str:
        done = subprocess.run(
            self.argv(tokens), cwd=self.app, env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, (
            f"`{shlex.join(tokens)}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
        return done.stdout

    def start(self, tokens: list[str]) -> Path:
        log = self.logs / f"{len(self.running):02d}-{tokens[1]}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.argv(tokens), cwd=self.app, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.running.append((proc, log))
        return log

    def step(self, block: str) -> dict[str, str]:
        """Run a sh block's lines in order: ``export`` sets a variable for what follows, ``pip
        install`` is the one thing done already (the project under test is installed). The
        outputs of the commands that ran to their end, by command line."""
        outputs: dict[str, str] = {}
        for tokens in command_lines(block):
            if tokens[0] == "export":
                for assignment in tokens[1:]:
                    name, _, value = assignment.partition("=")
                    self.env[name] = self.own.get(name, value)
            elif tokens[:4] == ["python", "-m", "pip", "install"]:
                continue
            elif tokens[0] == "outbox" and tokens[1] in SERVICES:
                log = self.start(tokens)
                if tokens[1] == "provider":
                    # A user starts the next command once it says it is listening.
                    wait_for(lambda path=log: "provider listening on" in path.read_text(), 20, "the provider")
            else:
                outputs[shlex.join(tokens)] = self.run(tokens)
        return outputs

    def until(self, predicate: Any, what: str) -> None:
        """Wait for ``predicate``; a process of the page that stopped fails it at once."""

        def check() -> Any:
            stopped = [log.name for proc, log in self.running if proc.poll() is not None]
            assert not stopped, f"{stopped} stopped while waiting for {what}\n{self.output()}"
            return predicate()

        wait_for(check, 60, f"{what}\n{self.output()}")

    def output(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.running
        )

    def stop(self) -> list[int]:
        for proc, _ in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc, _ in self.running:
            try:
                codes.append(proc.wait(20))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes


@pytest.fixture
def user(clean: Any, tmp_path: Path) -> Any:
    app = tmp_path / "app"
    app.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    u = User(app, clean, logs)
    yield u
    u.stop()


def test_the_quickstart_runs_as_written_and_charges_each_order_once(clean: Any, user: User) -> None:
    page = PAGE.read_text(encoding="utf-8")
    install, write, handlers, run, watch = (section(page, n) for n in range(1, 6))

    # Step 1: the variables (each one the page exports is set: the test's servers) and migrate.
    (step1,) = blocks(install, "sh")
    exported = {t[1].partition("=")[0] for t in command_lines(step1) if t[0] == "export"}
    assert exported == set(user.own), f"step 1 exports {sorted(exported)}"
    user.step(step1)

    # Step 2, in order, is the script pay.py; step 3's blocks are the files they name.
    (user.app / "pay.py").write_text("\n\n".join(blocks(write, "python")), encoding="utf-8")
    for code in blocks(handlers, "python"):
        name = re.fullmatch(r"# ([\w/]+\.py)", code.splitlines()[0])
        assert name, f"a block of step 3 does not name its file:\n{code}"
        (user.app / name.group(1)).parent.mkdir(parents=True, exist_ok=True)
        (user.app / name.group(1)).write_text(code, encoding="utf-8")

    # Step 4: the provider's port is one free here; the page's variables point at it as written.
    (step4,) = blocks(run, "sh")
    port = re.search(r"outbox provider .*--port (\d+)", step4)
    assert port, "step 4 starts no `outbox provider --port N`"
    step4 = re.sub(rf"\b{port.group(1)}\b", str(free_port()), step4)
    printed = user.step(step4)["python pay.py"]
    expected_written = re.search(r"print\(written\)\s+#\s+(.+)", write)
    expected_invalid = re.search(r"print\(exc\)\s+#\s+(.+?)\s*\(…\)", write)
    assert expected_written and expected_invalid
    lines = printed.splitlines()
    assert len(lines) == 2 and lines[0] == expected_written.group(1), printed
    assert lines[1].startswith(expected_invalid.group(1)), printed

    def rows() -> list[tuple[Any, ...]]:
        return sql(clean, "SELECT key, step, state FROM outbox_message ORDER BY id")

    user.until(lambda: rows() == [("order:1", "charge", "sent")], "order:1 sent")

    # Step 5: `outbox status` prints the page's table; `outbox show` finds the row.
    (console,) = blocks(watch, "console")
    for command, shown in re.findall(r"^\$ (.+)\n((?:(?!\$ ).*\n)*)", console, re.MULTILINE):
        printed = user.run(shlex.split(command))
        if shown.strip():
            assert printed.rstrip() == shown.rstrip(), f"`{command}` prints:\n{printed}"
        else:
            assert "order:1" in printed, printed

    # Another order, written while the processes run, as an application would.
    assert user.step("python pay.py\n")["python pay.py"].startswith("Written(id=2, created=True)")
    user.until(
        lambda: rows() == [("order:1", "charge", "sent"), ("order:2", "charge", "sent")], "order:2 sent"
    )

    api = user.env["PAYMENTS_API"]
    stats = httpx.get(f"{api}/_stats", timeout=10).json()
    assert stats["effects"] == {"order:1:charge": 1, "order:2:charge": 1}, stats
    assert stats["requests"] == 2 and stats["double_charged"] == [], stats
    refs = sql(clean, "SELECT provider_ref FROM outbox_message ORDER BY id")
    assert all(ref.startswith("ch_") for (ref,) in refs), refs

    assert user.stop() == [0, 0, 0, 0], user.output()
    log = user.output()
    assert "Traceback" not in log, log
