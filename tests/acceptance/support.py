"""Real processes for the acceptance tier: `outbox worker`, `outbox relay`, `outbox reconcile`
started as subprocesses against the test services, killed with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers import sql

HANDLERS = "examples.shop.handlers"

#: Short timings so that a killed worker's row is taken over within seconds.
FAST = {
    "SHOP_TIME_LIMIT": "2",
    "SHOP_LEASE_SECONDS": "3",
    "SHOP_BACKOFF": "0.5,1,2",
    "OUTBOX_POLL_INTERVAL": "0.2",
    "OUTBOX_REDISPATCH_AFTER": "3",
    "OUTBOX_RECONCILE_INTERVAL": "0.5",
}


class Processes:
    """Starts processes, and on exit SIGKILLs whatever is still running (no stray workers)."""

    def __init__(self, services: Any, provider_url: str, log_dir: Path) -> None:
        self.services = services
        self.provider_url = provider_url
        self.log_dir = log_dir
        self.running: list[subprocess.Popen[bytes]] = []
        self._count = 0

    def env(self, **extra: str) -> dict[str, str]:
        return self.services.env(SHOP_PROVIDER_URL=self.provider_url, **FAST, **extra)

    def start(self, *args: str, **extra_env: str) -> subprocess.Popen[bytes]:
        self._count += 1
        log = open(self.log_dir / f"{self._count:03d}-{args[0]}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "--log-level", "INFO", *args],
            env=self.env(**extra_env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.running.append(proc)
        return proc

    def worker(self, threads: int = 2, **extra_env: str) -> subprocess.Popen[bytes]:
        return self.start("worker", HANDLERS, "--threads", str(threads), **extra_env)

    def relay(self) -> subprocess.Popen[bytes]:
        return self.start("relay")

    def reconciler(self) -> subprocess.Popen[bytes]:
        return self.start("reconcile", HANDLERS, "--interval", FAST["OUTBOX_RECONCILE_INTERVAL"])

    def stop_all(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.iterdir())
        )


def states(services: Any) -> dict[str, int]:
    return dict(sql(services, "SELECT state, count(*) FROM outbox_message GROUP BY state"))


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
