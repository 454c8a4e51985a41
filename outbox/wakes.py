"""Waking the deliveries a destination's in-flight limit holds, when a call of it ends.

A claim that the in-flight limit refuses is held in its worker (outbox.limits), and tries again
after a pause. Without a wake, the pause is a guess: too short and every held delivery asks the
database again and again, too long and a free place waits. So when a worker records a call of a
destination with an in-flight limit, it publishes the destination's name on one Redis channel
per namespace (``<namespace>:outbox.freed``), and every worker process subscribes to it: its held
deliveries of that destination try their claim at once. Redis Pub/Sub, not LISTEN/NOTIFY, so
that it works where the workers reach PostgreSQL through a pooler in transaction mode.

A wake is a hint, never the guarantee: the claim trigger decides, and a missed wake (Redis down,
a subscriber reconnecting, a wake that came between a held claim and its wait) costs only the
held delivery's own pause (doubling to 1 s). Who sends one: a worker, after the record of a
destination that has an in-flight limit as its heartbeat last read it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import redis

from . import transport
from .logs import first_line

logger = logging.getLogger(__name__)

#: One line per this many seconds about a failing publish or subscription, however many fail.
ERROR_LOG_SECONDS = 60.0
_RECONNECT_SECONDS = (0.5, 10.0)
_POLL_SECONDS = 0.5


def channel(namespace: str) -> str:
    return f"{namespace}:outbox.freed"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Wakes:
    """One per worker process: publishes the end of its limited calls, and wakes its held
    deliveries when any process's call of their destination ends."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.channel = channel(namespace)
        self._client = transport.connect(redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self._futures: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="outbox-wakes", daemon=True)
        self._logged_at = float("-inf")
        #: Wakes received (for the tests and the log).
        self.received = 0

    def start(self) -> Wakes:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    # -- sending -----------------------------------------------------------------------------

    def freed(self, destination: str) -> None:
        """A call of ``destination`` ended (its record committed): wake its held deliveries, in
        every process. Never raises: a wake lost is a pause waited out."""
        try:
            self._client.publish(self.channel, destination)
        except redis.RedisError as exc:
            self._report("cannot publish the end of a limited call", exc)

    # -- waiting -----------------------------------------------------------------------------

    def wait(self, destination: str, seconds: float) -> bool:
        """Sleep up to ``seconds``, less if a call of ``destination`` ends meanwhile; whether
        woken."""
        with self._lock:
            event = self._events.setdefault(destination, threading.Event())
        return event.wait(seconds)

    async def wait_async(self, destination: str, seconds: float) -> bool:
        """:meth:`wait` on the event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            self._futures.setdefault(destination, []).append(entry)
        try:
            await asyncio.wait_for(future, seconds)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                waiting = self._futures.get(destination)
                if waiting is not None and entry in waiting:
                    waiting.remove(entry)

    def wake(self, destination: str) -> None:
        """Wake every delivery of ``destination`` waiting now (the subscriber calls it)."""
        with self._lock:
            event = self._events.pop(destination, None)
            futures = self._futures.pop(destination, [])
        if event is not None:
            event.set()
        for loop, future in futures:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # its loop closed: nobody waits there any more
                pass

    # -- the subscriber ------------------------------------------------------------------------

    def _listen(self) -> None:
        delay = _RECONNECT_SECONDS[0]
        while not self._stop.is_set():
            pubsub: Any = None
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                delay = _RECONNECT_SECONDS[0]
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=_POLL_SECONDS)
                    if message is not None and message.get("type") == "message":
                        self.received += 1
                        data = message["data"]
                        self.wake(data.decode() if isinstance(data, bytes) else str(data))
            except (redis.RedisError, OSError) as exc:
                self._report("cannot receive the ends of limited calls", exc)
                self._stop.wait(delay)
                delay = min(delay * 2, _RECONNECT_SECONDS[1])
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except (redis.RedisError, OSError):
                        pass

    def _report(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._logged_at < ERROR_LOG_SECONDS:
            return
        self._logged_at = now
        logger.warning(
            "%s (%s: %s): held deliveries try again after their own pause",
            what,
            type(exc).__name__,
            first_line(exc),
            extra={"error": type(exc).__name__},
        )
