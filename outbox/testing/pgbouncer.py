"""PgBouncer (Debian's ``pgbouncer`` package) in transaction mode in front of the test database,
started by the tests on 127.0.0.1: the pooler deployments put between the workers and
PostgreSQL. ``.ci/run`` installs it; without the binary the tests that need it say so and skip.

PgBouncer refuses to run as root: as root it is started with ``-u nobody``. Where that user
cannot reach a server's Unix socket (a directory only its owner may enter), a small TCP
forwarder on 127.0.0.1 stands in front of that socket; pgserver's socket directory is open to
every user, so the embedded server is reached directly."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
)
MISSING = "pgbouncer is not installed (Debian: apt-get install pgbouncer; .ci/run installs it as root)"


class _Forwarder:
    """127.0.0.1:port -> a Unix socket, byte for byte, one pair of threads per connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="pg-forwarder")
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(self.path)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for s in [self.sock, *self._socks]:
                with contextlib.suppress(OSError):
                    s.close()


def _open_to_others(path: str) -> bool:
    """Whether a user other than the owner may reach the socket ``path`` (every directory on the
    way searchable by others, the socket writable by them)."""
    directory = os.path.dirname(path)
    while True:
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return False
        if directory == os.path.dirname(directory):
            break
        directory = os.path.dirname(directory)
    return bool(os.stat(path).st_mode & stat.S_IWOTH)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


@contextlib.contextmanager
def pgbouncer(database_url: str, *, pool_size: int = 4) -> Iterator[str]:
    """PgBouncer in transaction mode in front of ``database_url``'s database, at most
    ``pool_size`` server connections for it; yields the pooled URL (same form as given)."""
    if PGBOUNCER is None:
        raise RuntimeError(MISSING)
    parts = urlsplit(database_url)
    params = dict(parse_qsl(parts.query))
    socket_dir = params.pop("host", "")
    user = parts.username or "postgres"
    dbname = parts.path.lstrip("/") or user
    with contextlib.ExitStack() as stack:
        if socket_dir.startswith("/"):
            (path,) = (p for p in glob.glob(f"{socket_dir}/.s.PGSQL.*") if not p.endswith(".lock"))
            if os.geteuid() != 0 or _open_to_others(path):
                host, port = socket_dir, int(path.rsplit(".", 1)[1])
            else:
                forwarder = _Forwarder(path)
                stack.callback(forwarder.close)
                host, port = "127.0.0.1", forwarder.port
        else:
            host, port = parts.hostname or "127.0.0.1", parts.port or 5432
        directory = tempfile.mkdtemp(prefix="outbox-pgbouncer-")
        stack.callback(shutil.rmtree, directory, True)
        os.chmod(directory, 0o755)
        password = f" password={parts.password}" if parts.password else ""
        listen = _free_port()
        config = os.path.join(directory, "pgbouncer.ini")
        with open(config, "w") as f:
            f.write(
                "[databases]\n"
                f"{dbname} = host={host} port={port} dbname={dbname} user={user}{password}\n"
                "[pgbouncer]\n"
                f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
                "auth_type = any\npool_mode = transaction\n"
                f"default_pool_size = {pool_size}\nmax_db_connections = {pool_size}\n"
                "max_client_conn = 2000\n"
                # psycopg sends none of these; other clients (SQLAlchemy's) may.
                "ignore_startup_parameters = extra_float_digits\n"
                "server_check_delay = 0\n"
            )
        os.chmod(config, 0o644)
        argv = [PGBOUNCER, *(["-u", "nobody"] if os.geteuid() == 0 else []), config]
        log = stack.enter_context(open(os.path.join(directory, "pgbouncer.log"), "wb"))
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

        def stop() -> None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

        stack.callback(stop)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", listen), 0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    said = Path(directory, "pgbouncer.log").read_text(errors="replace")
                    raise RuntimeError(f"pgbouncer did not start: {said}") from None
                time.sleep(0.05)
        query = urlencode({k: v for k, v in params.items() if k != "host"})
        netloc = f"{user}@127.0.0.1:{listen}"
        yield urlunsplit((parts.scheme, netloc, f"/{dbname}", query, ""))
