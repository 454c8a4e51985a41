"""The HTTP endpoints of a long-running process: ``/metrics``, ``/healthz`` and ``/readyz``.

``outbox relay``, ``worker`` and ``reconcile`` serve them on ``--metrics-port`` /
``OUTBOX_METRICS_PORT`` (none by default), from a daemon thread:

``/healthz``
    200 while the process loop is alive: it called :meth:`Liveness.beat` within
    ``stale_after_seconds``. 503 otherwise: the orchestrator should restart the process. A
    process waiting out a PostgreSQL or Redis outage is alive (it retries on its own).
``/readyz``
    200 when PostgreSQL and Redis answer (one ``SELECT 1`` on a connection kept for the probes,
    one ``PING``); 503 naming what does not. The schema was checked when the process started.
``/metrics``
    The Prometheus text format of :mod:`outbox.metrics`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

#: A probe waits this long for PostgreSQL or Redis before it calls them unreachable.
PROBE_TIMEOUT_SECONDS = 2.0
#: A loop not heard from for this long (or three of its own intervals, if longer) is stale.
LIVENESS_FLOOR_SECONDS = 30.0


class Liveness:
    """The process loop's heartbeat, in memory: ``beat()`` from the loop, ``age_seconds()``
    from the probe."""

    def __init__(self, stale_after_seconds: float) -> None:
        self.stale_after_seconds = stale_after_seconds
        self._last = time.monotonic()

    def beat(self) -> None:
        self._last = time.monotonic()

    def age_seconds(self) -> float:
        return time.monotonic() - self._last

    def alive(self) -> bool:
        return self.age_seconds() <= self.stale_after_seconds


#: The variable by which ``outbox worker --processes N`` tells its children where to beat.
CHILD_BEATS_ENV = "OUTBOX_WORKER_BEATS_DIR"


class FileBeat(Liveness):
    """A child's liveness, in a file the parent reads (``beat-<pid>``, touched at most once a
    second): the parent of ``outbox worker --processes N`` answers ``/healthz`` for all."""

    def __init__(self, directory: str, stale_after_seconds: float) -> None:
        super().__init__(stale_after_seconds)
        self.path = os.path.join(directory, f"beat-{os.getpid()}")
        self._touched = 0.0

    def beat(self) -> None:
        super().beat()
        now = time.monotonic()
        if now - self._touched >= 1.0:
            self._touched = now
            with contextlib.suppress(OSError):  # a beat lost is a beat late, not a crash
                with open(self.path, "a"):
                    pass
                os.utime(self.path)


class ChildrenLiveness(Liveness):
    """The parent's loop and each running child's :class:`FileBeat`: the oldest of them is the
    age ``/healthz`` reports, so a frozen child makes the worker stale even while its parent
    supervises. A child that just started is given ``stale_after_seconds`` to beat first."""

    def __init__(self, directory: str, stale_after_seconds: float) -> None:
        super().__init__(stale_after_seconds)
        self.directory = directory
        self._started: dict[int, float] = {}

    def child_started(self, pid: int) -> None:
        self._started[pid] = time.monotonic()

    def child_ended(self, pid: int) -> None:
        self._started.pop(pid, None)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, f"beat-{pid}"))

    def age_seconds(self) -> float:
        ages = [super().age_seconds()]
        for pid, started in list(self._started.items()):
            try:
                ages.append(time.time() - os.stat(os.path.join(self.directory, f"beat-{pid}")).st_mtime)
            except OSError:
                ages.append(time.monotonic() - started)  # not beaten yet: booting
        return max(ages)


class Readiness:
    """Whether PostgreSQL and Redis answer; one connection each, kept between probes and made
    again after a failure: an orchestrator probing often costs one ``SELECT 1`` and one
    ``PING`` per probe, never a connection storm. Each check is bounded in time."""

    def __init__(self, database_url: str, redis_url: str | None) -> None:
        self.database_url = database_url
        self.redis_url = redis_url
        self._conn: Any = None
        self._redis: Any = None
        # Concurrent probes share one connection each, rather than each making its own.
        self._connecting = threading.Lock()

    def problems(self) -> list[str]:
        return [
            p
            for p in (self._bounded("PostgreSQL", self._database), self._bounded("Redis", self._broker))
            if p
        ]

    def _bounded(self, what: str, check: Callable[[], str | None]) -> str | None:
        """The check's problem, or "no answer" past the timeout: a server that accepted the
        connection and then stopped answering (SIGSTOP, a network partition) must not hang the
        probe, nor the probes queued behind it. A check left running finishes on its own."""
        answer: list[str | None] = []
        thread = threading.Thread(
            target=lambda: answer.append(check()), name=f"outbox-probe-{what}", daemon=True
        )
        thread.start()
        thread.join(PROBE_TIMEOUT_SECONDS + 0.5)
        if thread.is_alive():
            if what == "PostgreSQL":
                self._conn = None  # abandoned to its thread; the next probe connects afresh
            else:
                self._redis = None
            return f"{what}: no answer within {PROBE_TIMEOUT_SECONDS:g} s"
        return answer[0] if answer else f"{what}: the check failed"

    def _database(self) -> str | None:
        from .db import connect_raw

        conn = None
        try:
            with self._connecting:
                conn = self._conn
                if conn is None or conn.closed:
                    conn = self._conn = connect_raw(
                        self.database_url,
                        autocommit=True,
                        connect_timeout=max(1, int(PROBE_TIMEOUT_SECONDS)),
                        application_name="outbox-probe",
                        options=f"-c statement_timeout={int(PROBE_TIMEOUT_SECONDS * 1000)}",
                    )
            conn.execute("SELECT 1")
            return None
        except Exception as exc:
            if conn is not None and self._conn is conn:
                self._conn = None
            with contextlib.suppress(Exception):
                if conn is not None:
                    conn.close()
            return f"PostgreSQL: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            if conn is not None and self._conn is not conn:
                # Abandoned by a probe that gave up on it (see _bounded): closed by its thread.
                with contextlib.suppress(Exception):
                    conn.close()

    def _broker(self) -> str | None:
        if self.redis_url is None:
            return None
        from . import transport

        try:
            with self._connecting:
                client = self._redis
                if client is None:
                    client = self._redis = transport.connect(
                        self.redis_url,
                        socket_timeout=PROBE_TIMEOUT_SECONDS,
                        socket_connect_timeout=PROBE_TIMEOUT_SECONDS,
                    )
            client.ping()
            return None
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._redis.close()
            self._redis = None
            return f"Redis: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _close_database(self) -> None:
        with contextlib.suppress(Exception):
            if self._conn is not None:
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._close_database()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                self._redis.close()
            self._redis = None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # a probe every few seconds would drown the process's own log

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._healthz()
        elif path == "/readyz":
            self._readyz()
        elif path == "/metrics":
            self._metrics()
        else:
            self._send(404, "application/json", json.dumps({"error": "not found"}).encode())

    def _healthz(self) -> None:
        liveness = self.server.liveness
        alive = liveness.alive()
        body = {
            "status": "ok" if alive else "stale",
            "process": self.server.process,
            "loop_age_seconds": round(liveness.age_seconds(), 3),
            "stale_after_seconds": liveness.stale_after_seconds,
        }
        self._send(200 if alive else 503, "application/json", json.dumps(body).encode())

    def _readyz(self) -> None:
        problems = self.server.readiness.problems()
        body = {"status": "ready" if not problems else "not ready", "problems": problems}
        self._send(200 if not problems else 503, "application/json", json.dumps(body).encode())

    def _metrics(self) -> None:
        content_type, payload = self.server.render_metrics()
        self._send(200, content_type, payload)

    def _send(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    liveness: Liveness
    readiness: Readiness
    process: str
    render_metrics: Callable[[], tuple[str, bytes]]


class ProbeServer:
    """Serves the three endpoints on ``host:port`` from a daemon thread until ``stop()``."""

    def __init__(
        self,
        port: int,
        *,
        process: str,
        liveness: Liveness,
        readiness: Readiness,
        render_metrics: Callable[[], tuple[str, bytes]] | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        if render_metrics is None:
            from .metrics import render

            render_metrics = render
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            from .exceptions import ConfigError

            raise ConfigError(
                f"cannot serve the metrics and probes on {host}:{port} (--metrics-port / "
                f"OUTBOX_METRICS_PORT): {exc.strerror or exc}"
            ) from exc
        self._server.liveness = liveness
        self._server.readiness = readiness
        self._server.process = process
        self._server.render_metrics = render_metrics
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.25},
            name="outbox-probes",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> ProbeServer:
        self._thread.start()
        logger.info(
            "serving /metrics, /healthz and /readyz on port %s",
            self.port,
            extra={"metrics_port": self.port},
        )
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server.readiness.close()


def serve(
    port: int | None,
    *,
    process: str,
    liveness: Liveness,
    database_url: str,
    redis_url: str | None,
) -> ProbeServer | None:
    """Start the endpoints when a port is configured; None when not."""
    if port is None:
        return None
    return ProbeServer(
        port, process=process, liveness=liveness, readiness=Readiness(database_url, redis_url)
    ).start()


def check_metrics_environment() -> None:
    """:func:`outbox.metrics.check_environment`, imported only when a service starts."""
    from .metrics import check_environment

    check_environment()
