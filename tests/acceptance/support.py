"""Real processes for the acceptance tier: `outbox worker`, `outbox relay`, `outbox reconcile`
started as subprocesses against the test services, killed with real signals."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
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


#: What a worker process logs once its consumer reads from Redis.
WORKER_STARTED = "outbox worker started"


class Processes:
    """Starts processes, and on exit SIGKILLs whatever is still running (no stray workers)."""

    def __init__(
        self, services: Any, provider_url: str, log_dir: Path, timings: dict[str, str] | None = None
    ) -> None:
        self.services = services
        self.provider_url = provider_url
        self.log_dir = log_dir
        #: Replaces entries of FAST for every process started.
        self.timings = {**FAST, **(timings or {})}
        self.running: list[subprocess.Popen[bytes]] = []
        #: Each process's log file, by pid.
        self.log_files: dict[int, Path] = {}
        self._count = 0

    def env(self, **extra: str) -> dict[str, str]:
        return self.services.env(SHOP_PROVIDER_URL=self.provider_url, **{**self.timings, **extra})

    def start(self, *args: str, **extra_env: str) -> subprocess.Popen[bytes]:
        self._count += 1
        path = self.log_dir / f"{self._count:03d}-{args[0]}.log"
        log = open(path, "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "--log-level", "INFO", *args],
            env=self.env(**extra_env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.running.append(proc)
        self.log_files[proc.pid] = path
        return proc

    def worker(self, threads: int = 2, **extra_env: str) -> subprocess.Popen[bytes]:
        return self.start("worker", HANDLERS, "--concurrency", str(threads), **extra_env)

    def relay(self) -> subprocess.Popen[bytes]:
        return self.start("relay")

    def reconciler(self) -> subprocess.Popen[bytes]:
        return self.start("reconcile", HANDLERS, "--interval", self.timings["OUTBOX_RECONCILE_INTERVAL"])

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

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return self.log_files[proc.pid].read_text(errors="replace")

    def wait_started(self, workers: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
        """Until every one of ``workers`` has logged its start (its consumer is reading)."""
        deadline = time.monotonic() + timeout
        while not all(WORKER_STARTED in self.log_of(w) for w in workers):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers did not start within {timeout} s:\n{self.logs()}")
            time.sleep(0.1)

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


class OwnedPostgres:
    """A PostgreSQL server this test alone uses, from the ``pgserver`` wheel, in its own temporary
    directory and listening only on a Unix socket there: it can be stopped, crashed and started
    again without touching the machine's shared server or the session's.

    ``stop("fast")`` disconnects every client and checkpoints; ``stop("immediate")`` is a crash
    (no checkpoint; WAL replay at the next start, asynchronously committed transactions may be
    lost). ``start()`` brings it back on the same socket, so the URL stays valid.
    """

    def __init__(self) -> None:
        # Not under pytest's basetemp (see tests/conftest.py): the server runs as another user
        # when the tests run as root.
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-owned-pg-"))
        with warnings.catch_warnings():
            # platformdirs (imported by pgserver) warns when XDG_RUNTIME_DIR is unset, and
            # pytest makes warnings errors.
            warnings.simplefilter("ignore")
            import pgserver

            self._server = pgserver.get_server(self.directory / "pg", cleanup_mode="stop")
        self.url: str = self._server.get_uri()
        self._socket_dir = self._server.get_postmaster_info().socket_dir
        self.running = True

    def _pg_ctl(self, *args: str, timeout: float) -> None:
        from pgserver import _commands

        server = self._server
        _commands.pg_ctl(list(args), pgdata=server.pgdata, user=server.system_user, timeout=timeout)

    def stop(self, mode: str) -> None:
        self._pg_ctl("-w", "-m", mode, "stop", timeout=60)
        self.running = False

    def start(self) -> None:
        # The options pgserver started it with: no TCP listener, the socket in its directory.
        options = ["-o", '-h ""', "-o", f"-k {self._socket_dir}"]
        self._pg_ctl("-w", *options, "-l", str(self._server.log), "start", timeout=60)
        self.running = True

    def close(self) -> None:
        # Stopped here: once restarted, the server is no longer the process pgserver's own
        # cleanup knows, which would leave it running.
        if self.running:
            with contextlib.suppress(Exception):
                self.stop("fast")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._server.cleanup()
        shutil.rmtree(self.directory, ignore_errors=True)
