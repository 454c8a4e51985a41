"""A host cut off in the middle of calls, with real network separation on this machine.

Two "hosts", each a network namespace of its own joined to this one by a veth pair, run an `outbox
relay` and an `outbox worker` each (host B the reconciler too) against the test's PostgreSQL and
Redis, which they reach through this namespace: a forwarder here listens on this end of each veth
and passes the connections on to 127.0.0.1 (or to the embedded servers' Unix sockets), and to the
provider simulator. Host A is then cut off from PostgreSQL (in the second run, from Redis) while
its calls are under way: every packet it sends there vanishes (a permanent neighbour entry to a
hardware address nobody has: the frames are dropped on arrival, no reset, no error), for longer
than its leases; then the link comes back.

What must hold: no key is charged twice (the provider does not deduplicate); every row ends
`sent` with the provider's reference; a late record settles nothing a newer claim owns; and host
B finishes everything host A held while A is still cut off, within :data:`BOUND_SECONDS`, the sum
of the waits its slowest row goes through (written out below). Host A's worker says it stopped
fetching and, once back, that it resumed; every process stops cleanly.

The forwarder gives the sockets it accepts the keepalives and the TCP user timeout that
docs/production.md recommends for the server's side, so that a cut-off client's session (a
relay's open transaction, a reconciler's advisory lock) ends as it would on a server so
configured.

Skipped, with the reason, where this process cannot make namespaces (not root, no ``ip``, or a
kernel that refuses them); CI runs as root and can."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest
from helpers import sql

from outbox.consumer import LOST_CLAIM_UNREACHABLE_SECONDS

from .support import Processes, states
from .test_chaos_postgres import write_orders

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's"),
]

#: Few enough that the other host alone finishes what is left at the cut well inside the bound.
ROWS = 60
#: Calls take this long at the provider, so that each worker has calls under way at the cut.
LATENCY_MS = 300
CONCURRENCY = 4

# -- the test's timings (every process gets them) -------------------------------------------------
TIME_LIMIT = 2.0
LEASE = 4.0
RECONCILE_INTERVAL = 0.5
REDISPATCH_AFTER = 8.0
POLL_INTERVAL = 0.2
#: OUTBOX_TCP_USER_TIMEOUT: how long a statement, a command or a connect sent into the void waits.
TCP_USER_TIMEOUT = 2.0
TIMINGS = {
    "SHOP_TIME_LIMIT": f"{TIME_LIMIT:g}",
    "SHOP_LEASE_SECONDS": f"{LEASE:g}",
    "SHOP_BACKOFF": "0.5,1,2",
    "SHOP_BREAKER": "off",
    "OUTBOX_POLL_INTERVAL": f"{POLL_INTERVAL:g}",
    "OUTBOX_REDISPATCH_AFTER": f"{REDISPATCH_AFTER:g}",
    "OUTBOX_RECONCILE_INTERVAL": f"{RECONCILE_INTERVAL:g}",
    "OUTBOX_TCP_USER_TIMEOUT": f"{TCP_USER_TIMEOUT:g}s",
    "OUTBOX_TCP_KEEPALIVE_IDLE": "1",
    "OUTBOX_TCP_KEEPALIVE_INTERVAL": "1",
    "OUTBOX_TCP_KEEPALIVE_COUNT": "2",
}

#: From the cut to every row the cut-off host held being settled by the other host: the slowest
#: row's waits, one after the other. Its claim committed and the reply never came back: the row
#: waits out its lease, then the reconciler's next cycle moves it to `unknown`, the landing wait
#: (one time limit) passes and the next cycle asks the lookup (at most one time limit); if the
#: call never reached the provider, the row is `pending` again and its re-dispatch after
#: OUTBOX_REDISPATCH_AFTER (with a cycle) is the bound for a message held where no one takes it;
#: then one call on the other host (one time limit). The cut-off host's other ways out are
#: shorter: a message it fetched and could not claim is handed back after the claim's TCP user
#: timeout, LOST_CLAIM_UNREACHABLE_SECONDS of fence tries, the last pause between them (2 s at
#: most) and one last connect (a TCP user timeout): 16 s, then its call.
BOUND_TERMS = {
    "lease": LEASE,
    "expiry cycle": RECONCILE_INTERVAL,
    "landing wait": TIME_LIMIT,
    "lookup cycle": RECONCILE_INTERVAL,
    "lookup": TIME_LIMIT,
    "redispatch": REDISPATCH_AFTER + RECONCILE_INTERVAL,
    "call": TIME_LIMIT,
}
#: What a loaded two-core machine adds (process scheduling, Python's own pauses): stated apart.
SLACK_SECONDS = 8.0
BOUND_SECONDS = sum(BOUND_TERMS.values()) + SLACK_SECONDS
#: Past the bound, and past the leases: the other host has finished before the link comes back.
CUT_SECONDS = BOUND_SECONDS + 2.0

HAND_BACK_SECONDS = 2 * TCP_USER_TIMEOUT + LOST_CLAIM_UNREACHABLE_SECONDS + 2.0
assert HAND_BACK_SECONDS + TIME_LIMIT <= sum(BOUND_TERMS.values())


def _ip(command: str) -> None:
    """``ip COMMAND`` (its words split on spaces), failing the test with ip's own message."""
    done = subprocess.run(["ip", *command.split()], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"ip {command}: {done.stderr.strip()}"


# -- the network ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Host:
    name: str
    netns: str
    outer: str  # this namespace's end of the veth
    inner: str  # the host's end
    subnet: str  # "10.X.Y"

    def addr(self, last: int) -> str:
        return f"{self.subnet}.{last}"

    #: This namespace's addresses on the host's link, one per service, so that one alone can be cut.
    @property
    def database_addr(self) -> str:
        return self.addr(1)

    @property
    def redis_addr(self) -> str:
        return self.addr(2)

    @property
    def provider_addr(self) -> str:
        return self.addr(3)


class Network:
    """Two namespaces, each joined to this one by a veth pair on a /29 of its own; removed on exit
    (deleting a namespace deletes its end of the pair, and so the pair)."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.tag = tag
        used = subprocess.run(
            ["ip", "-4", "route", "show"], capture_output=True, text=True, check=True
        ).stdout
        octet = next(
            (n for n in range(200, 250) if f"10.{n}." not in used and f"10.{n}.0.0" not in used), None
        )
        if octet is None:
            pytest.skip("no free 10.200-249 range for the test's links")
        self.hosts = [
            Host(name, f"outbox-{tag}-{name}", f"ox{tag}{name}o", f"ox{tag}{name}i", f"10.{octet}.{i}")
            for i, name in ((1, "a"), (2, "b"))
        ]
        self._made: list[Host] = []

    def __enter__(self) -> Network:
        try:
            for host in self.hosts:
                _ip(f"netns add {host.netns}")
                self._made.append(host)
                _ip(f"link add {host.outer} type veth peer name {host.inner} netns {host.netns}")
                for last in (1, 2, 3):
                    _ip(f"addr add {host.addr(last)}/29 dev {host.outer}")
                _ip(f"link set {host.outer} up")
                _ip(f"-n {host.netns} addr add {host.addr(6)}/29 dev {host.inner}")
                _ip(f"-n {host.netns} link set {host.inner} up")
                _ip(f"-n {host.netns} link set lo up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for host in self._made:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
            # Gone with the namespace; deleted here only if it somehow was not.
            subprocess.run(["ip", "link", "del", host.outer], capture_output=True, timeout=30)
        self._made = []

    def cut(self, host: Host, addr: str) -> None:
        """Every frame the host sends to ``addr`` goes to a hardware address no one has: dropped."""
        _ip(f"-n {host.netns} neigh replace {addr} lladdr 02:00:00:00:00:01 dev {host.inner} nud permanent")

    def restore(self, host: Host, addr: str) -> None:
        _ip(f"-n {host.netns} neigh del {addr} dev {host.inner}")


def namespaces_refused() -> str | None:
    """Why this process cannot make namespaces here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the acceptance tier as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"outbox-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"the kernel refuses network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


# -- the forwarder --------------------------------------------------------------------------------

Target = tuple[str, int] | str  # (host, port) or a Unix socket's path


class Forwarder:
    """TCP listeners on this namespace's ends of the links, each passing its connections on to a
    target: an asyncio loop on a thread of the test. The sockets it accepts get the keepalives
    and TCP user timeout a server configured as docs/production.md recommends has, so a client
    that vanished is noticed and its upstream connection closed (its session ends)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="forwarder", daemon=True)
        self.thread.start()
        self.servers: list[asyncio.base_events.Server] = []
        self.writers: set[asyncio.StreamWriter] = set()
        #: Connections accepted, by the address they came in on.
        self.accepted: collections.Counter[str] = collections.Counter()

    def listen(self, addr: str, target: Target) -> int:
        """Listen on ``addr`` (a port of the system's choosing: a server listening on every
        address may hold the usual one) for ``target``; the port."""

        async def start() -> asyncio.base_events.Server:
            return await asyncio.start_server(lambda r, w: self._serve(r, w, addr, target), addr, 0)

        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, addr: str, target: Target
    ) -> None:
        self.accepted[addr] += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(TCP_USER_TIMEOUT * 1000))
        try:
            if isinstance(target, str):
                up_reader, up_writer = await asyncio.open_unix_connection(target)
            else:
                up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                for w in (dst, writer, up_writer):
                    with contextlib.suppress(Exception):
                        w.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in self.writers:
                w.close()
            for server in self.servers:
                await server.wait_closed()
            await asyncio.sleep(0.1)  # the transports' own close callbacks

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


def database_target(url: str) -> tuple[Target, Any]:
    """Where the test's PostgreSQL is, and a function making its URL for another address."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    socket_dir = query.pop("host", "")
    port = parts.port or int(query.pop("port", "5432"))
    target: Target = f"{socket_dir}/.s.PGSQL.{port}" if socket_dir.startswith("/") else (
        parts.hostname or "127.0.0.1", port)  # fmt: skip
    userinfo = parts.netloc.rpartition("@")[0]

    def at(addr: str, port: int) -> str:
        netloc = f"{userinfo}@{addr}:{port}" if userinfo else f"{addr}:{port}"
        return urlunsplit(("postgresql", netloc, parts.path, urlencode(query), ""))

    return target, at


def redis_target(url: str) -> tuple[Target, Any]:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme == "unix":
        target: Target = parts.path
        db = query.pop("db", "0")
    else:
        target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        db = parts.path.strip("/") or "0"
    password = f":{parts.password}@" if parts.password else ""

    def at(addr: str, port: int) -> str:
        return f"redis://{password}{addr}:{port}/{db}"

    return target, at


# -- processes on a host --------------------------------------------------------------------------


class HostProcesses(Processes):
    """`outbox` processes started inside a host's namespace, with its addresses for the services."""

    def __init__(self, services: Any, provider_url: str, log_dir: Path, netns: str) -> None:
        super().__init__(services, provider_url, log_dir, TIMINGS)
        self.netns = netns

    def start(self, *args: str, **extra_env: str) -> subprocess.Popen[bytes]:
        self._count += 1
        path = self.log_dir / f"{self.netns[-1]}-{self._count:03d}-{args[0]}.log"
        with open(path, "wb") as log:
            # `ip netns exec` execs the command: the pid is the process's own, signals reach it.
            proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.netns,
                    sys.executable,
                    "-m",
                    "outbox",
                    "--log-level",
                    "INFO",
                    *args,
                ],
                env=self.env(**extra_env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.running.append(proc)
        self.log_files[proc.pid] = path
        return proc


#: Attempts recorded after a newer claim of their row was made, other than as superseded: a late
#: record that settled a row a newer claim owned. (A record of the row's own claim while the row
#: is `unknown` comes before any newer claim: allowed, and not counted here.)
LATE_SETTLEMENTS = """
SELECT a.message_id, a.attempt, a.outcome
FROM outbox_attempt a
JOIN outbox_attempt newer ON newer.message_id = a.message_id AND newer.id > a.id
WHERE a.finished_at > newer.started_at AND a.outcome NOT LIKE 'superseded:%'
"""


@pytest.fixture
def network() -> Iterator[Network]:
    reason = namespaces_refused()
    if reason:
        pytest.skip(reason)
    with Network() as net:
        yield net


@pytest.mark.parametrize("cut_from", ["postgres", "redis"])
def test_a_host_cut_off_mid_calls_charges_each_key_once_and_the_other_host_takes_over(
    clean, provider, network, tmp_path, cut_from
):
    forwarder = Forwarder()
    pg, pg_at = database_target(clean.database_url)
    rd, rd_at = redis_target(clean.redis_url)
    provider_port = urlsplit(provider.url).port
    assert provider_port is not None
    procs: dict[str, HostProcesses] = {}
    t0 = time.monotonic()
    timeline: list[str] = []

    def note(event: str) -> None:
        timeline.append(f"{time.monotonic() - t0:.1f}s {event}")
        print(timeline[-1], flush=True)

    try:
        for host in network.hosts:
            services = dataclasses.replace(
                clean,
                database_url=pg_at(host.database_addr, forwarder.listen(host.database_addr, pg)),
                redis_url=rd_at(host.redis_addr, forwarder.listen(host.redis_addr, rd)),
            )
            port = forwarder.listen(host.provider_addr, ("127.0.0.1", provider_port))
            procs[host.name] = HostProcesses(
                services, f"http://{host.provider_addr}:{port}", tmp_path, host.netns
            )
        a = network.hosts[0]
        provider.configure(latency_ms=LATENCY_MS)

        relay_a = procs["a"].relay()
        worker_a = procs["a"].worker(threads=CONCURRENCY)
        relay_b = procs["b"].relay()
        worker_b = procs["b"].worker(threads=CONCURRENCY)
        reconciler_b = procs["b"].reconciler()
        procs["a"].wait_started([worker_a], timeout=90)
        procs["b"].wait_started([worker_b], timeout=90)
        note("started")
        keys = write_orders(clean.database_url, ROWS)

        # Calls under way on both hosts: some rows sent, and host A calling the provider.
        deadline = time.monotonic() + 60
        while states(clean).get("sent", 0) < ROWS // 5 or not forwarder.accepted[a.provider_addr]:
            assert time.monotonic() < deadline, f"no progress\n{procs['a'].logs()}"
            time.sleep(0.05)
        addr = a.database_addr if cut_from == "postgres" else a.redis_addr
        network.cut(a, addr)
        cut_at = time.monotonic()
        at_cut = states(clean)
        note(f"host a cut off from {cut_from}: {at_cut}")

        # Host B finishes every row while A is still cut off, within the bound.
        finished_after: float | None = None
        while time.monotonic() - cut_at < CUT_SECONDS:
            if finished_after is None and states(clean) == {"sent": ROWS}:
                finished_after = time.monotonic() - cut_at
                note(f"every row sent, {finished_after:.1f} s after the cut")
            time.sleep(0.2)
        network.restore(a, addr)
        note("host a back")
        bound = " + ".join(f"{name} {s:g}" for name, s in BOUND_TERMS.items())
        assert finished_after is not None, (
            f"rows left after {CUT_SECONDS:g} s cut off: {states(clean)}\n{timeline}\n{procs['a'].logs()}"
        )
        assert finished_after <= BOUND_SECONDS, (
            f"{finished_after:.1f} s > {bound} + slack {SLACK_SECONDS:g} = {BOUND_SECONDS:g} s"
        )

        # Host A comes back: its worker resumes, and nothing more is called.
        if cut_from == "postgres":
            deadline = time.monotonic() + 30
            while "reaches PostgreSQL again: fetching resumed" not in procs["a"].log_of(worker_a):
                assert time.monotonic() < deadline, procs["a"].log_of(worker_a)[-3000:]
                time.sleep(0.2)
            log_a = procs["a"].log_of(worker_a)
            assert log_a.count("cannot reach PostgreSQL: stopped fetching") >= 1, log_a[-3000:]
        time.sleep(2 * RECONCILE_INTERVAL + 1)
        note("settled after the return")

        final = states(clean)
        stats = provider.stats()
        outcomes = dict(sql(clean, "SELECT outcome, count(*) FROM outbox_attempt GROUP BY outcome"))
        summary = f"timeline={timeline} final={final} attempts={outcomes}"
        print(summary, flush=True)
        assert final == {"sent": ROWS}, f"{summary}\n{procs['a'].logs()}"
        assert stats["double_charged"] == [], summary
        assert sorted(stats["effects"]) == sorted(keys), summary
        assert stats["charges"] == ROWS, summary
        assert sql(clean, LATE_SETTLEMENTS) == [], summary
        provider.configure(latency_ms=0)
        refs = dict(sql(clean, "SELECT key || ':' || step, provider_ref FROM outbox_message"))
        with httpx.Client(base_url=provider.url, timeout=5) as client:
            for key in keys:
                charge = client.get("/charges", params={"idempotency_key": key})
                assert charge.status_code == 200 and refs[key] == charge.json()["id"], key

        audit = subprocess.run(
            [sys.executable, "-m", "outbox", "audit"],
            env=clean.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert audit.returncode == 0, f"{audit.stdout}\n{audit.stderr}"

        survivors = [relay_a, worker_a, relay_b, worker_b, reconciler_b]
        assert [p.poll() for p in survivors] == [None] * len(survivors), procs["a"].logs()
        for p in survivors:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in survivors]
        assert codes == [0] * len(survivors), f"exit codes {codes}\n{procs['a'].logs()}"
    finally:
        for host_procs in procs.values():
            host_procs.stop_all()
        forwarder.close()
