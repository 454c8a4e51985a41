"""``outbox worker``: one process fetching Dramatiq messages (outbox.runner) and running each
as a delivery (outbox.consumer.Deliverer); or a supervisor of several such processes.

One queue per destination, so a slow provider does not block the others. Dramatiq's retries are
off: retries live in the row (`pending` + `available_at`). The ack happens after the outcome was
recorded.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from dramatiq.brokers.redis import RedisBroker

from . import middleware
from .consumer import Deliverer
from .exceptions import ConfigError
from .failover import FailoverGuard
from .handlers import Handler, close_http_clients
from .heartbeat import Heartbeat
from .probes import Liveness
from .runner import Runner
from .settings import DEFAULT_HEARTBEAT_INTERVAL_SECONDS
from .transport import Broker, connect
from .wakes import Wakes

logger = logging.getLogger(__name__)


def build_broker(redis_url: str, namespace: str, handlers: Mapping[str, Handler]) -> RedisBroker:
    # No Dramatiq TimeLimit: the deliverer gives each call a total deadline of its own
    # time_limit, and an exception raised into a worker thread at an arbitrary point could land
    # inside a claim or a release, leaving a claim nobody knows about.
    # A client of ours, not Dramatiq's from the URL: through Sentinel it follows a failover.
    broker = Broker(client=connect(redis_url), namespace=namespace, middleware=[])
    for extra in middleware.added():  # the user's (outbox.worker_middleware)
        broker.add_middleware(extra)
    return broker


def run_worker(
    *,
    database_url: str,
    redis_url: str,
    namespace: str,
    handlers: Mapping[str, Handler],
    queues: Sequence[str] | None,
    concurrency: int,
    stop: threading.Event,
    slots_per_destination: int | None = None,
    heartbeat_interval_seconds: float = DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
    liveness: Liveness | None = None,
    direct_database_url: str | None = None,
    pooled: bool = False,
) -> int:
    """Run one worker process until ``stop`` is set; finishes the messages in hand. While it
    runs, its heartbeat (queues served, clock) is recorded in the database, and ``liveness`` is
    beaten while its fetch and delivery threads (and event loop) are all alive.

    ``database_url`` serves the claims, the records and the heartbeat (a pooler in transaction
    mode when ``pooled``); the failover guard holds one backend of ``direct_database_url``."""
    destinations = list(queues or sorted(handlers))
    unknown = [q for q in destinations if q not in handlers]
    if unknown:
        raise ConfigError(f"--queues names destinations with no handler: {', '.join(unknown)}")
    broker = build_broker(redis_url, namespace, handlers)
    guard = FailoverGuard(direct_database_url or database_url, process="worker").start()
    deliverer = Deliverer(
        database_url, handlers, failover_guard=guard, concurrency=concurrency, pooled=pooled
    )
    # What Dramatiq's own CLI does once per process.
    broker.emit_after("process_boot")
    runner = Runner(
        broker,
        deliverer,
        handlers,
        destinations,
        concurrency=concurrency,
        slots_per_destination=slots_per_destination,
    )
    # Before the first fetch: its first beat writes the limits the handlers declare.
    declared = {
        d: h.max_in_flight for d, h in handlers.items() if h.max_in_flight is not None and d in destinations
    }
    rates = {
        d: h.max_calls_per_second
        for d, h in handlers.items()
        if h.max_calls_per_second is not None and d in destinations
    }
    heartbeat = start_heartbeat(
        database_url,
        destinations,
        heartbeat_interval_seconds,
        pooled=pooled,
        declared_in_flight=declared,
        declared_per_second=rates,
    )
    if declared or rates:
        deliverer.declarations_fresh = heartbeat.declarations_fresh
    # The ends of limited calls, published and received over Redis (outbox.wakes).
    wakes = Wakes(redis_url, namespace).start()
    deliverer.wakes = wakes
    deliverer.in_flight_limited = lambda: heartbeat.in_flight_limited
    try:
        runner.start()
    except BaseException:
        heartbeat.stop()
        wakes.stop()
        raise
    asynchronous = [d for d in destinations if handlers[d].is_async]
    logger.info(
        "outbox worker started: queues=%s concurrency=%s slots_per_destination=%s async=%s pid=%s",
        ",".join(destinations),
        concurrency,
        runner.slots.cap,
        ",".join(asynchronous) or "none",
        os.getpid(),
        extra={
            "queues": destinations,
            "concurrency": concurrency,
            "slots_per_destination": runner.slots.cap,
            "async_queues": asynchronous,
        },
    )
    try:
        while not stop.wait(0.5):
            if liveness is not None and runner.alive():
                liveness.beat()
    finally:
        logger.info("outbox worker stopping: finishing messages in hand")
        runner.stop(max(h.lease_seconds for h in handlers.values()))
        heartbeat.stop()
        wakes.stop()
        broker.close()
        # Dramatiq's RedisBroker.close() leaves its pool's sockets for the garbage collector.
        broker.client.connection_pool.disconnect()
        deliverer.close()
        guard.stop()
        close_http_clients()
    return 0


def start_heartbeat(
    database_url: str,
    queues: Sequence[str],
    interval_seconds: float,
    *,
    pooled: bool = False,
    declared_in_flight: Mapping[str, int] | None = None,
    declared_per_second: Mapping[str, float] | None = None,
) -> Heartbeat:
    """The worker's heartbeat thread: "no consumer" alerts and the clock-skew check read it, and
    it writes the limits the worker's handlers declare (outbox.limits)."""
    return Heartbeat(
        database_url,
        kind="worker",
        queues=queues,
        interval_seconds=interval_seconds,
        pooled=pooled,
        declared_in_flight=declared_in_flight,
        declared_per_second=declared_per_second,
    ).start()


#: A child that dies is started again after a backoff that doubles from the first of these to the
#: last; more than CRASHES_BEFORE_GIVING_UP deaths within CRASH_WINDOW_SECONDS and the worker
#: gives up (exit 1): the orchestrator then sees a failing process, not one that restarts its
#: children for ever with nothing delivered.
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
CRASH_WINDOW_SECONDS = 60.0
CRASHES_BEFORE_GIVING_UP = 5


def supervise(
    argv: Sequence[str],
    processes: int,
    stop: threading.Event,
    liveness: Liveness | None = None,
    on_exit: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> int:
    """Run ``processes`` single-process workers as children; restart one that dies, after a
    backoff, and give up after repeated deaths (see :data:`CRASHES_BEFORE_GIVING_UP`).

    SIGTERM/SIGINT are forwarded; the exit status is 0 when every child stopped cleanly, 1 when
    one did not or the worker gave up. ``liveness`` is beaten by the supervising loop;
    ``on_start(pid)`` and ``on_exit(pid)`` hear of each child started and ended.
    """

    def spawn() -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-m", "outbox", *argv])
        if on_start is not None:
            on_start(child.pid)
        return child

    children: list[subprocess.Popen[bytes] | None] = [spawn() for _ in range(processes)]
    restart_at: dict[int, float] = {}
    deaths: deque[float] = deque()
    gave_up = False
    try:
        while not gave_up and not stop.wait(0.5):
            if liveness is not None:
                liveness.beat()
            now = time.monotonic()
            for i, child in enumerate(children):
                if child is None:
                    if now >= restart_at[i]:
                        children[i] = spawn()
                        del restart_at[i]
                    continue
                code = child.poll()
                if code is None:
                    continue
                if on_exit is not None:
                    on_exit(child.pid)
                children[i] = None
                deaths.append(now)
                while deaths and deaths[0] < now - CRASH_WINDOW_SECONDS:
                    deaths.popleft()
                if len(deaths) > CRASHES_BEFORE_GIVING_UP:
                    logger.error(
                        "worker process %s exited with %s: %s deaths within %.0f s, giving up",
                        child.pid,
                        code,
                        len(deaths),
                        CRASH_WINDOW_SECONDS,
                        extra={"pid": child.pid, "exit_code": code, "deaths": len(deaths)},
                    )
                    gave_up = True
                    break
                delay = RESTART_BACKOFF_SECONDS[min(len(deaths), len(RESTART_BACKOFF_SECONDS)) - 1]
                restart_at[i] = now + delay
                logger.error(
                    "worker process %s exited with %s; restarting it in %.0f s",
                    child.pid,
                    code,
                    delay,
                    extra={"pid": child.pid, "exit_code": code, "restart_in_seconds": delay},
                )
    finally:
        running = [c for c in children if c is not None]
        for child in running:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        codes = [child.wait() for child in running]
    # -SIGTERM: the forwarded signal reached a child before Python had installed its handler,
    # that is while it was still booting and held no message, so it stopped cleanly too.
    failed = [
        (c.pid, code) for c, code in zip(running, codes, strict=True) if code not in (0, -signal.SIGTERM)
    ]
    for pid, code in failed:
        logger.error("worker process %s stopped with %s", pid, code, extra={"pid": pid, "exit_code": code})
    return 1 if failed or gave_up else 0
