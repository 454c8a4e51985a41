"""The processes of ``outbox demo``: started with their output in log files, killed for real,
and never left behind; what each one runs, and the waits for each to be ready.

Each child gets a session of its own, so a Ctrl-C in the terminal reaches only the demo, which
then stops its children in order instead of having them all die mid-sentence at once. On
Linux each child also asks the kernel for SIGKILL when the demo dies, so even a SIGKILLed demo
leaves no worker charging cards on its own. That request is tied to the thread that spawned the
child, which is why every spawn happens on the demo's main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..exceptions import ConfigError
from ..testing.embedded import die_with_parent
from .base import (
    DROP_AFTER_RATE,
    FAIL_BEFORE_RATE,
    FAST_ENV,
    HANDLERS,
    SHOP,
    WORKER_THREADS,
    DemoFailed,
)


@dataclass
class Child:
    role: str
    name: str
    log_path: Path
    proc: subprocess.Popen[bytes]
    #: Set when the demo killed it on purpose, so its exit is not reported as a crash.
    killed_on_purpose: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_contains(self, marker: str) -> bool:
        try:
            return marker in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts, kills and stops the demo's children; every child it started, it stops."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.children: list[Child] = []
        self._count = 0

    def start(
        self, role: str, argv: list[str], *, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> Child:
        """Start ``python argv`` with the demo's environment (and ``env`` over it)."""
        self._count += 1
        name = name or role
        log_path = self.log_dir / f"{self._count:02d}-{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Safe here: the demo spawns from its main thread only (see the module docstring).
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        child = Child(role, name, log_path, proc)
        self.children.append(child)
        return child

    def running(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.alive() and not c.killed_on_purpose]

    def kill(self, child: Child) -> None:
        """SIGKILL, the way an OOM kill or a lost node ends a process: no cleanup runs."""
        child.killed_on_purpose = True
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(5)

    def crashed(self) -> list[Child]:
        """Children that exited without the demo asking (a zero exit of a finite one is fine)."""
        return [
            c
            for c in self.children
            if not c.killed_on_purpose and c.proc.poll() is not None and c.proc.returncode != 0
        ]

    def stop(self, children: Iterable[Child], grace_seconds: float) -> None:
        """SIGTERM, then SIGKILL whatever has not exited within the grace period."""
        targets = [c for c in children if c.alive()]
        for c in targets:
            c.killed_on_purpose = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for c in targets:
            try:
                c.proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGKILL)
                c.proc.wait()

    def stop_all(self, grace_seconds: float = 5.0) -> None:
        self.stop(self.children, grace_seconds)
        # Reap everything, including children killed earlier, so none is left a zombie.
        for c in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(1)


def kill_leftovers(marker: str) -> list[int]:
    """Last resort after a cleanup: SIGKILL our own descendants, and any process whose command
    line mentions ``marker`` (the demo's directory). Returns the pids killed."""
    killed: list[int] = []
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with pgserver
        return killed
    me = psutil.Process()
    candidates = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != me.pid and any(marker in part for part in (p.info["cmdline"] or ())):
                candidates.setdefault(p.pid, p)
    for pid, p in candidates.items():
        with contextlib.suppress(psutil.Error):
            p.kill()
            killed.append(pid)
    if candidates:
        psutil.wait_procs(list(candidates.values()), timeout=3)
    return killed


# -- the demo's processes --------------------------------------------------------------------------


def start_provider(sup: Supervisor, url: str, seed: int, ready_file: Path) -> Child:
    return sup.start(
        "provider",
        [
            "-m",
            "outbox.testing.provider",
            "--port",
            url.rsplit(":", 1)[1],
            "--seed",
            str(seed),
            "--drop-after-rate",
            str(DROP_AFTER_RATE),
            "--fail-before-rate",
            str(FAIL_BEFORE_RATE),
            "--ready-file",
            str(ready_file),
        ],
    )


def start_shop_setup(sup: Supervisor) -> Child:
    return sup.start("shop", ["-m", SHOP, "--setup-only"], name="shop-setup")


def start_shop(sup: Supervisor, orders: int, rate: float, seed: int) -> Child:
    return sup.start(
        "shop",
        ["-m", SHOP, "--rate", f"{rate:g}", "--orders", str(orders), "--seed", str(seed)],
    )


def start_relay(sup: Supervisor, *, name: str | None = None) -> Child:
    return sup.start("relay", ["-m", "outbox", "relay"], name=name)


def start_worker(sup: Supervisor, number: int) -> Child:
    return sup.start(
        "worker",
        ["-m", "outbox", "worker", HANDLERS, "--threads", str(WORKER_THREADS)],
        name=f"worker-{number}",
    )


def start_reconciler(sup: Supervisor) -> Child:
    return sup.start(
        "reconciler",
        ["-m", "outbox", "reconcile", HANDLERS, "--interval", FAST_ENV["OUTBOX_RECONCILE_INTERVAL"]],
    )


def wait_for_provider(provider: Child, url: str, ready_file: Path) -> None:
    deadline = time.monotonic() + 30
    while not ready_file.exists():
        if not provider.alive() or time.monotonic() > deadline:
            raise DemoFailed(f"the provider simulator did not start on {url}:\n{provider.log_tail()}")
        time.sleep(0.05)


def wait_for_setup(setup: Child) -> None:
    try:
        code = setup.proc.wait(60)
    except subprocess.TimeoutExpired as exc:
        raise DemoFailed(f"the shop's table setup did not finish:\n{setup.log_tail()}") from exc
    if code == 2:
        # The shop refuses an orders table that is not its own; so does the demo.
        raise ConfigError(setup.log_tail(3).splitlines()[-1].removeprefix("shop: "))
    if code != 0:
        raise DemoFailed(f"the shop's table setup failed (exit {code}):\n{setup.log_tail()}")


def wait_until_started(markers: list[tuple[Child, str]], timeout_seconds: float = 30) -> None:
    """Until each child's log holds its marker; DemoFailed if one exits or the time runs out."""
    deadline = time.monotonic() + timeout_seconds
    waiting = list(markers)
    while waiting:
        for child, marker in list(waiting):
            if not child.alive():
                raise DemoFailed(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            if child.log_contains(marker):
                waiting.remove((child, marker))
        if waiting and time.monotonic() > deadline:
            names = ", ".join(c.name for c, _ in waiting)
            raise DemoFailed(f"{names} did not start within {timeout_seconds:g} s")
        time.sleep(0.1)
