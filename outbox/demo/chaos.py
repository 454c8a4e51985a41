"""The faults ``outbox demo`` injects: workers SIGKILLed, the relay SIGKILLed once, Redis flushed
once, the provider down for a while.

Each is what production sees: an OOM kill or a lost node (no cleanup runs), a Redis restarted
without persistence (every queued message gone, the database still holding the rows), a payment
provider answering 503 to everything (its status page says "degraded").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from .base import FAIL_BEFORE_RATE, WORKER_KILL_EVERY_SECONDS
from .display import Display
from .processes import Supervisor, start_relay, start_worker
from .servers import Servers, delete_namespace, flushdb


@dataclass
class ChaosPlan:
    """When, counted from the first order, each fault is injected."""

    worker_kills: list[float]
    relay_kill: float | None
    redis_flush: float | None
    #: The provider answers 503 to every charge from outage_at to outage_end.
    outage_at: float | None = None
    outage_end: float | None = None

    @classmethod
    def for_run(cls, orders: int, rate: float, chaos: bool, outage_seconds: float = 0.0) -> ChaosPlan:
        if not chaos:
            return cls([], None, None)
        writing = orders / rate
        window = max(writing + 4.0, 8.0)
        kills: list[float] = []
        at = 1.5
        while at <= window:
            kills.append(at)
            at += WORKER_KILL_EVERY_SECONDS
        # While orders are still written: the breaker holds back a flow, not a last straggler.
        outage_at = max(1.5, 0.45 * writing) if outage_seconds > 0 else None
        outage_end = outage_at + outage_seconds if outage_at is not None else None
        return cls(kills, max(1.0, 0.3 * writing), max(2.0, 0.6 * writing), outage_at, outage_end)

    @property
    def one_shots_done(self) -> bool:
        return self.relay_kill is None and self.redis_flush is None and self.outage_end is None


@dataclass
class Counters:
    worker_kills: int = 0
    worker_restarts: int = 0
    relay_kills: int = 0
    redis_flushes: int = 0
    outages: int = 0
    outage_seconds: float = 0.0
    #: Charges the provider answered 503 while it was down: what reached it during the outage.
    outage_calls: int = 0
    _refused_before: int = 0
    _outage_started: float = 0.0


@dataclass
class Chaos:
    """Injects the faults of a plan when their time comes, and counts them."""

    sup: Supervisor
    servers: Servers
    namespace: str
    display: Display
    elapsed: Callable[[], float]
    counters: Counters
    provider_url: str = ""

    def step(self, plan: ChaosPlan, since_first_order: float) -> None:
        if plan.outage_at is not None and since_first_order >= plan.outage_at:
            plan.outage_at = None
            self.provider_down()
        if plan.outage_at is None and plan.outage_end is not None and since_first_order >= plan.outage_end:
            plan.outage_end = None
            self.provider_back()
        if plan.worker_kills and since_first_order >= plan.worker_kills[0]:
            plan.worker_kills.pop(0)
            self.kill_worker()
        if plan.relay_kill is not None and since_first_order >= plan.relay_kill:
            plan.relay_kill = None
            self.kill_relay()
        if plan.redis_flush is not None and since_first_order >= plan.redis_flush:
            plan.redis_flush = None
            self.flush_redis()

    def kill_worker(self) -> None:
        sup = self.sup
        running = sup.running("worker")
        if not running:
            return
        victim = running[self.counters.worker_kills % len(running)]
        sup.kill(victim)
        self.counters.worker_kills += 1
        number = len([c for c in sup.children if c.role == "worker"]) + 1
        fresh = start_worker(sup, number)
        self.counters.worker_restarts += 1
        self.display.event(
            f"{self.elapsed():5.1f} s  SIGKILL {victim.name} (pid {victim.pid}); started {fresh.name} "
            f"(pid {fresh.pid}). Rows it had claimed wait out their 3 s lease, then the reconciler "
            "asks the provider"
        )

    def kill_relay(self) -> None:
        for victim in self.sup.running("relay"):
            self.sup.kill(victim)
        self.counters.relay_kills += 1
        fresh = start_relay(self.sup, name=f"relay-{self.counters.relay_kills + 1}")
        self.display.event(
            f"{self.elapsed():5.1f} s  SIGKILL the relay; started {fresh.name} (pid {fresh.pid}). "
            "A batch published but not committed stays pending and is published again: the claim "
            "makes the duplicate harmless"
        )

    def _provider(self, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
        with httpx.Client(base_url=self.provider_url, timeout=5.0) as client:
            r = client.post(path, json=body) if body is not None else client.get(path)
            r.raise_for_status()
            answer: dict[str, object] = r.json()
            return answer

    def _refused(self) -> int:
        with contextlib.suppress(httpx.HTTPError, KeyError, TypeError, ValueError):
            faults = self._provider("/_stats")["faults"]
            assert isinstance(faults, dict)
            return int(faults["fail_before"])
        return 0

    def provider_down(self) -> None:
        c = self.counters
        c._refused_before = self._refused()
        c._outage_started = self.elapsed()
        self._provider("/_config", {"fail_before_rate": 1.0})
        c.outages += 1
        self.display.event(
            f"{self.elapsed():5.1f} s  the provider is DOWN: every charge answered 503. After 3 of "
            "them the breaker trips: the rows wait, attempts untouched, one probe at a time"
        )

    def provider_back(self) -> None:
        c = self.counters
        self._provider("/_config", {"fail_before_rate": FAIL_BEFORE_RATE})
        c.outage_seconds = self.elapsed() - c._outage_started
        c.outage_calls = self._refused() - c._refused_before
        self.display.event(
            f"{self.elapsed():5.1f} s  the provider is BACK after {c.outage_seconds:.1f} s; "
            f"{c.outage_calls} call(s) reached it while it was down. The next probe closes the "
            "breaker and the waiting rows go out"
        )

    def flush_redis(self) -> None:
        redis_url = self.servers.redis_url
        if self.servers.redis_owned:
            flushdb(redis_url)
            what = "FLUSHDB"
        else:
            # Not our server: only the demo's namespace goes.
            deleted = delete_namespace(redis_url, self.namespace)
            what = f"deleted the {deleted} keys of namespace {self.namespace!r}"
        self.counters.redis_flushes += 1
        self.display.event(
            f"{self.elapsed():5.1f} s  Redis {what}: every queued message is gone. The database "
            "still has the rows; the reconciler re-queues the dispatched ones"
        )
