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
from .signals import Stop
from .transport import Broker, connect
from .wakes import Wakes

logger = logging.getLogger(__name__)

#: Set by a supervisor (``--processes N``) in its children's environment: its pid. A child's
#: second SIGTERM is then no order to exit at once: the supervisor passes SIGTERM on to children
#: that may have had one already (a whole process group or a systemd unit's cgroup signalled).
SUPERVISOR_ENV = "OUTBOX_WORKER_SUPERVISOR_PID"


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
            "pid": os.getpid(),
            "_shown": ("async_queues",),
        },
    )
    # The messages in hand get their longest lease to finish: past it their rows are the
    # reconciler's anyway.
    grace_seconds = max(h.lease_seconds for h in handlers.values())
    # A supervised child exits at once on a second Ctrl-C only (see SUPERVISOR_ENV); its
    # supervisor kills it when told twice.
    supervised = os.environ.get(SUPERVISOR_ENV) == str(os.getppid())
    if isinstance(stop, Stop):
        stop.announces = True
        stop.force = _force(runner.slots.in_hand, only_sigint=supervised)
    try:
        while not stop.wait(0.5):
            if liveness is not None and runner.alive():
                liveness.beat()
            # The sum of the runs, off the deliveries' path (outbox.consumer.RUN_LOG_SECONDS).
            deliverer.runs.tick()
    finally:
        _stopping(stop, runner.slots.in_hand(), grace_seconds, supervised=supervised)
        runner.stop(grace_seconds)
        heartbeat.stop()
        wakes.stop()
        broker.close()
        # Dramatiq's RedisBroker.close() leaves its pool's sockets for the garbage collector.
        broker.client.connection_pool.disconnect()
        deliverer.close()
        guard.stop()
        close_http_clients()
    logger.info("outbox worker stopped", extra={"pid": os.getpid()})
    return 0


def _again(signal_name: str) -> str:
    return "Ctrl-C again" if signal_name == "SIGINT" else f"a second {signal_name}"


def _stopping(stop: threading.Event, in_hand: int, grace_seconds: float, *, supervised: bool) -> None:
    """The worker's first line on its way out: what it finishes, how long it waits, and (after a
    signal) whether the same signal again exits at once."""
    name = stop.signal_name if isinstance(stop, Stop) else None
    forcible = isinstance(stop, Stop) and stop.force is not None and not (supervised and name != "SIGINT")
    logger.info(
        "%soutbox worker stopping: finishing %s message%s in hand, waiting up to %.0f s for them%s",
        f"received {name}: " if name else "",
        in_hand,
        "" if in_hand == 1 else "s",
        grace_seconds,
        f"; {_again(name)} exits at once (their rows stay claimed until their leases expire)"
        if name and forcible
        else "",
        extra={
            "signal": name,
            "in_hand": in_hand,
            "grace_seconds": grace_seconds,
            "_shown": ("signal", "in_hand", "grace_seconds"),
        },
    )


def force_before_start(stop: Stop) -> None:
    """Until the worker runs, nothing is in hand: the same signal a second time exits at once
    (a start-up check waiting on a database or Redis that never answers cannot hold a stop),
    with the supervised child's rule (only a second SIGINT) as when it runs."""
    supervised = os.environ.get(SUPERVISOR_ENV) == str(os.getppid())
    stop.force = _force(lambda: 0, only_sigint=supervised)


def _force(in_hand: Callable[[], int], *, only_sigint: bool) -> Callable[[str], None]:
    def force(signal_name: str) -> None:
        if only_sigint and signal_name != "SIGINT":
            logger.info(
                "received %s again, still stopping after the work in hand",
                signal_name,
                extra={"signal": signal_name},
            )
            return
        _exit_now(signal_name, in_hand)

    return force


def _exit_now(signal_name: str, in_hand: Callable[[], int], processes: int = 0) -> None:
    """The same signal a second time: exit at once, without waiting for the calls in hand. As
    safe as a crash, which it is: a row claimed stays `in_flight` until its lease expires and
    the reconciler settles it (looked up, or `unknown`); its message, unacked, is delivered
    again to an empty claim. ``processes``: a supervisor's children, killed."""
    extra: dict[str, object] = {"signal": signal_name, "_shown": ("signal", "processes", "in_hand")}
    if processes:
        left = f"{processes} worker process{'' if processes == 1 else 'es'} killed"
        extra["processes"] = processes
    else:
        n = extra["in_hand"] = in_hand()
        left = f"{n} message{'' if n == 1 else 's'} left in hand"
    logger.warning(
        "received %s again: outbox worker exiting now, %s (their rows stay claimed until their "
        "leases expire; the reconciler settles them)",
        signal_name,
        left,
        extra=extra,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(128 + signal.Signals[signal_name].value)


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
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        # -P: `-m` would put the working directory first on sys.path, where an application's
        # `redis.py` or `outbox/` would replace the modules outbox imports; MODULE is still found
        # there, last (outbox.usermodules), as in the supervisor.
        child = subprocess.Popen([sys.executable, "-P", "-m", "outbox", *argv], env=env)
        if on_start is not None:
            on_start(child.pid)
        return child

    children: list[subprocess.Popen[bytes] | None] = [spawn() for _ in range(processes)]

    def kill_children(name: str) -> None:
        # Each child's rows are then where a crash leaves them: their leases and the
        # reconciler settle them.
        for child in children:
            if child is not None and child.poll() is None:
                child.kill()
        _exit_now(name, lambda: 0, processes=sum(c is not None for c in children))

    if isinstance(stop, Stop):
        stop.announces = True
        stop.force = kill_children
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
        name = stop.signal_name if isinstance(stop, Stop) else None
        logger.info(
            "%soutbox worker stopping: %s worker process%s finishing the messages in hand%s",
            f"received {name}: " if name else "",
            len(running),
            "" if len(running) == 1 else "es",
            f"; {_again(name)} stops them at once (their rows stay claimed until their leases expire)"
            if name
            else "",
            extra={"signal": name, "processes": len(running), "_shown": ("signal", "processes")},
        )
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
    logger.info("outbox worker stopped", extra={"pid": os.getpid()})
    return 1 if failed or gave_up else 0
