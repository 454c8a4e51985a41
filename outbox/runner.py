"""The worker's loop over Dramatiq's consumers: messages are fetched only for free slots, and
each runs as a thread's delivery (a sync handler) or as a task of the event loop (an async one).

Dramatiq stays the transport: its message format, its Redis layout, its fetch and ack scripts,
its consumer's ack and its heartbeat. What is not Dramatiq's is the loop: Dramatiq's ``Worker`` gives every
message a thread until its actor returns, also for an ``async def`` actor, so calls in flight
cost threads. Here:

- A **slot** is one delivery in hand, from fetch to ack. A process has ``concurrency`` of them;
  a destination may hold at most ``destination_slots`` (:func:`destination_slots`), so a slow
  provider cannot take every slot from the others.
- Each queue has one **fetch thread**. It takes the slots free for its queue, fetches as many
  messages in one round trip, gives back the slots no message came for, and hands each message
  to its delivery: no message waits in this process for a slot, and no slot waits out an empty
  queue's backoff.
- A **sync** handler's delivery runs on one of ``concurrency`` delivery threads, as under
  Dramatiq (outbox.consumer.Deliverer.deliver).
- An **async** handler's delivery is a task (Deliverer.deliver_async): its claim and its record
  run on one of :data:`DATABASE_THREADS` threads, its call on the loop, holding no thread.
- The **ack** comes last, after the record, on the thread that ran the record; then the slot is
  free. A message whose delivery raised is acked too (its row stays where the database has it,
  for the lease and the reconciler), as Dramatiq's ``Worker`` does without its ``Retries``.
- While **PostgreSQL does not answer** (a connection could not be opened, or broke under a
  statement: Deliverer.database_down), no queue is fetched, and a message fetched and not
  claimed is **handed back** to its queue (requeued, not acked) for a worker that reaches the
  database: acked, it would have waited out ``OUTBOX_REDISPATCH_AFTER``. A message handed back
  never causes a second call: its row's claim is the guard, whoever takes it next. One thread
  asks the database every :data:`DATABASE_PROBE_SECONDS` and fetching resumes once it answers.

Dramatiq middleware (``outbox.worker_middleware``) hears ``process_boot`` (from the worker),
``worker_thread_boot`` (each delivery thread), ``before/after_process_message`` (on the thread
that claims, and the one that records) and ``before/after_ack``; no ``consumer_thread_*``,
``worker_boot`` or ``*_worker_shutdown`` hooks, which name Dramatiq's ``Worker`` and its threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from dramatiq.broker import Broker as DramatiqBroker
from dramatiq.broker import MessageProxy
from dramatiq.common import compute_backoff
from dramatiq.errors import BrokerConnectionError
from dramatiq.message import Message

from . import aio
from .consumer import Deliverer, DeliveryResult, Taken
from .handlers import Handler
from .transport import ACTOR_NAME, queue_key

logger = logging.getLogger(__name__)

#: Threads that run the claims and records of async handlers' deliveries (and their acks): a few
#: more than the worker's pooled connections (outbox.consumer), so a statement waiting for one
#: holds no other; a row lock's wait is an awaited pause, on no thread.
DATABASE_THREADS = 12
#: How long a fetch thread waits for a free slot before it looks again whether the worker is
#: stopping, and its longest backoff after a fetch found its queue empty (seconds).
FETCH_WAIT_SECONDS = 0.5
#: A busy worker (some slots taken) that has fewer than a quarter of its slots free waits this
#: long (seconds) for that many before it fetches: one fetch for several messages, not one per
#: slot freed, which costs a backlog's deliveries more of the worker's CPU and of Redis's
#: (docs/decisions/hot-path-costs.md). An idle worker fetches at once.
FETCH_GATHER_SECONDS = 0.005
#: A fetch that found its queue empty sleeps its backoff (Dramatiq's: 5 ms doubling, jittered, up
#: to FETCH_WAIT_SECONDS). From this long on (milliseconds: the queue has been empty for a few
#: fetches) it waits instead for the queue to have a message (Runner._wait_for_message), so a
#: message for an idle worker is fetched at once, not after up to half a second. Shorter
#: backoffs stay plain sleeps: between a busy queue's batches one more round trip would cost
#: more than it saves.
WAKE_FROM_BACKOFF_MS = 20
#: Each such wait holds a Redis connection: at most this many at once in a process (the other
#: empty queues sleep their backoff), so a worker of forty destinations does not hold forty of
#: Redis's ``maxclients`` while idle.
WAKE_WAITS_PER_PROCESS = 4
#: With a ``socket_timeout`` on the Redis client, a wait blocks in turns of at most this share of
#: it: a blocking read past it is a timeout error and a dropped connection, and Redis ends a
#: blocking command up to a tick of its ``hz`` (100 ms by default) after the command's timeout.
WAKE_SOCKET_SHARE = 0.5
#: Pause between tries of an ack Redis refused (a connection error), as Dramatiq's worker does.
ACK_RETRY_SECONDS = 1.0
#: While PostgreSQL does not answer, the pause between two of the worker's questions to it.
DATABASE_PROBE_SECONDS = 1.0


def destination_slots(concurrency: int, queues: int) -> int:
    """The default cap on one destination's slots: all of them for a worker of one queue;
    three quarters of them (at least one) when it serves several, so a quarter stays for the
    others however slow one provider is."""
    return concurrency if queues <= 1 else max(1, concurrency * 3 // 4)


def row_id_of(message: Any, name: str) -> int | None:
    """The outbox row a message names; None (logged) for a message outbox did not write."""
    args = message.args
    if (
        message.actor_name != ACTOR_NAME
        or len(args) != 1
        or not isinstance(args[0], int)
        or isinstance(args[0], bool)
    ):
        # A message we did not write (older/newer deploy, hand-made): drop it, keep working.
        logger.error(
            "dropping malformed outbox message on queue %r: actor=%r args=%r",
            name,
            message.actor_name,
            args[:3],
            extra={"queue": name, "actor": message.actor_name, "_shown": ("queue",)},
        )
        return None
    row_id: int = args[0]
    return row_id


def _wake_limit_seconds(broker: Any) -> float:
    """The longest turn of an idle wait the broker's Redis client allows: a share of its
    ``socket_timeout`` (a URL's ``?socket_timeout=``), none under 0.1 s; unbounded without one."""
    pool = getattr(getattr(broker, "client", None), "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    socket_timeout = kwargs.get("socket_timeout")
    if socket_timeout is None:
        return float("inf")
    turn = float(socket_timeout) * WAKE_SOCKET_SHARE
    return turn if turn >= 0.1 else 0.0


class _Fetched:
    """One message fetched, on its way to its delivery: the row it names (None: not ours, logged),
    what the fetch's group claim decided for it (None: its delivery claims it alone), whether
    the middleware heard ``before_process_message`` already, and the error that ends it first."""

    __slots__ = ("emitted", "error", "message", "name", "row_id", "taken")

    def __init__(self, message: Any, name: str) -> None:
        self.message = message
        self.name = name
        self.row_id = row_id_of(message, name)
        self.taken: Taken | None = None
        self.emitted = False
        self.error: BaseException | None = None


class _Slots:
    """``total`` deliveries in hand at most, ``cap`` of one queue."""

    def __init__(self, total: int, cap: int) -> None:
        self.total = total
        self.cap = cap
        self._free = total
        self._held: dict[str, int] = {}
        self._cond = threading.Condition()

    def _open(self, name: str) -> int:
        return min(self._free, self.cap - self._held.get(name, 0))

    def free(self, name: str, timeout_seconds: float, at_least: int = 1) -> int:
        """How many slots queue ``name`` could take now, waiting up to ``timeout_seconds`` for
        ``at_least`` of them (0: none came free). Takes none."""
        with self._cond:
            self._cond.wait_for(lambda: self._open(name) >= at_least, timeout_seconds)
            return max(0, self._open(name))

    def take_open(self, name: str) -> int:
        """Take every slot open to queue ``name`` now (for one fetch of as many messages)."""
        with self._cond:
            n = max(0, self._open(name))
            self._free -= n
            self._held[name] = self._held.get(name, 0) + n
            return n

    def give(self, name: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._cond:
            self._free += n
            self._held[name] -= n
            self._cond.notify_all()

    def in_hand(self) -> int:
        with self._cond:
            return self.total - self._free


class Runner:
    """Fetches and runs the deliveries of one worker process (see the module's text)."""

    def __init__(
        self,
        broker: DramatiqBroker,
        deliverer: Deliverer,
        handlers: Mapping[str, Handler],
        queues: Sequence[str],
        *,
        concurrency: int,
        slots_per_destination: int | None = None,
    ) -> None:
        self.broker = broker
        self.deliverer = deliverer
        self.handlers = handlers
        self.queues = list(queues)
        self.concurrency = concurrency
        cap = slots_per_destination or destination_slots(concurrency, len(self.queues))
        self.slots = _Slots(concurrency, min(cap, concurrency))
        self._gather = max(1, self.slots.cap // 4)
        self._running = threading.Event()
        self._fetchers: list[threading.Thread] = []
        self._consumers: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._work: queue.SimpleQueue[_Fetched | None] = queue.SimpleQueue()
        self._misses: dict[str, int] = {}
        self._blmove = True
        self._wake_waits = threading.BoundedSemaphore(WAKE_WAITS_PER_PROCESS)
        self._wake_limit_seconds = _wake_limit_seconds(broker)
        #: Acks (False) and hand-backs (True) Redis refused, tried again by the ack thread.
        self._acks: queue.Queue[tuple[Any, str, bool] | None] = queue.Queue()
        self._probe: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        self._database_back = threading.Event()
        self._acker = threading.Thread(target=self._retry_acks, name="outbox-acks", daemon=True)
        self._database: concurrent.futures.ThreadPoolExecutor | None = None
        self.any_sync = any(not handlers[q].is_async for q in self.queues)
        self.any_async = any(handlers[q].is_async for q in self.queues)

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._running.set()
        self._acker.start()
        for name in self.queues:
            self.broker.declare_queue(name)
        if self.any_sync:
            for i in range(self.concurrency):
                thread = threading.Thread(target=self._deliveries, name=f"outbox-delivery-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        if self.any_async:
            self._database = concurrent.futures.ThreadPoolExecutor(
                DATABASE_THREADS, thread_name_prefix="outbox-database"
            )
            aio.loop()
        for name in self.queues:
            self._consumers[name] = self.broker.consume(
                queue_name=name, prefetch=1, timeout=int(FETCH_WAIT_SECONDS * 1000)
            )
            fetcher = threading.Thread(
                target=self._fetch, args=(name,), name=f"outbox-fetch-{name}", daemon=True
            )
            fetcher.start()
            self._fetchers.append(fetcher)

    def alive(self) -> bool:
        """Every fetch and delivery thread running (and the event loop, for async handlers)."""
        threads = [*self._fetchers, *self._threads, self._acker]
        loop_alive = not self.any_async or aio.alive()
        return bool(threads) and all(t.is_alive() for t in threads) and loop_alive

    def stop(self, timeout_seconds: float) -> None:
        """Stop fetching and wait up to ``timeout_seconds`` for the deliveries in hand (every
        message fetched has one): their calls finish and are recorded and acked. A delivery still
        running then is left to its lease; its message, unacked, to Dramatiq's requeue once this
        process's Redis heartbeat stops."""
        self._running.clear()
        self.deliverer.stopping.set()
        for fetcher in self._fetchers:
            fetcher.join()
        deadline = time.monotonic() + timeout_seconds
        while self.slots.in_hand() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.slots.in_hand()
        if left:
            logger.warning(
                "outbox worker stopped waiting with %s deliveries still in hand: left to their leases",
                left,
                extra={"in_hand": left, "_shown": ("in_hand",)},
            )
        self._acks.put(None)
        self._acker.join(ACK_RETRY_SECONDS + 1.0)
        for _ in self._threads:
            self._work.put(None)
        # One deadline for them all: a thread still in a delivery is left to its lease (daemon).
        join_by = max(deadline, time.monotonic()) + 1.0
        for thread in self._threads:
            thread.join(max(0.0, join_by - time.monotonic()))
        if self._database is not None:
            self._database.shutdown(wait=not left, cancel_futures=True)
        for consumer in self._consumers.values():
            try:
                consumer.close()
            except BrokerConnectionError:
                pass

    # -- fetching ------------------------------------------------------------------------------

    def _fetch(self, name: str) -> None:
        consumer = self._consumers[name]
        while self._running.is_set():
            if self.deliverer.database_down.is_set():
                self._await_database()
                continue
            try:
                self.fetch_once(name, consumer)
            except BrokerConnectionError as exc:
                logger.error(
                    "fetching from queue %s failed (%s); trying again in 1 s",
                    name,
                    exc,
                    extra={"queue": name},
                )
                time.sleep(1.0)
            except Exception:
                logger.exception(
                    "fetching from queue %s failed; trying again in 1 s", name, extra={"queue": name}
                )
                time.sleep(1.0)

    def fetch_once(self, name: str, consumer: Any) -> bool:
        """Take the slots free for queue ``name``, fetch as many messages in one round trip, give
        back the slots no message came for, and start a delivery for each message; False when
        no slot came free or no message within :data:`FETCH_WAIT_SECONDS`.

        The slots are taken before the fetch, so two queues never fetch on the same free slots,
        and given back before an empty queue's backoff, so that backoff never keeps a slot from
        the other queues. Dramatiq's consumer is not asked for the messages (its ``next`` sleeps
        out its backoff with them promised); it acks and requeues them."""
        if not self.slots.free(name, FETCH_WAIT_SECONDS):
            return False
        if self.slots.free(name, 0) < self._gather and self.slots.in_hand():
            self.slots.free(name, FETCH_GATHER_SECONDS, at_least=self._gather)
        taken = self.slots.take_open(name)
        if not taken:
            return False
        messages: list[Any] = []
        try:
            for data in self.broker.do_fetch(name, taken):  # type: ignore[attr-defined]
                if data is None:
                    continue  # its body is gone (a flush between the two keys): Dramatiq skips it too
                try:
                    messages.append(MessageProxy(Message.decode(data)))
                except Exception:
                    logger.error(
                        "an undecodable message on queue %s was skipped (left unacked)",
                        name,
                        extra={"queue": name},
                    )
        except redis.ConnectionError as exc:
            raise BrokerConnectionError(str(exc)) from exc
        finally:
            self.slots.give(name, taken - len(messages))
        if not messages:
            self.deliverer.runs.tick()
            self._misses[name], backoff_ms = compute_backoff(
                self._misses.get(name, 0), max_backoff=int(FETCH_WAIT_SECONDS * 1000)
            )
            if backoff_ms >= WAKE_FROM_BACKOFF_MS:
                self._wait_for_message(name, backoff_ms / 1000)
            else:
                time.sleep(backoff_ms / 1000)
            return False
        self._misses[name] = 0
        asynchronous = self.handlers[name].is_async
        for fetched in self._claim_together(name, messages):
            if asynchronous:
                aio.submit(self._run_task(fetched))
            else:
                self._work.put(fetched)
        return True

    def _await_database(self) -> None:
        """A fetch thread's turn while PostgreSQL does not answer: no fetch; the probe thread
        (started by the first fetch thread here) asks the database, and this waits for it a
        while, so the worker keeps hearing whether it is stopping."""
        with self._probe_lock:
            if self._probe is None or not self._probe.is_alive():
                self._database_back.clear()
                self._probe = threading.Thread(
                    target=self._probe_database, name="outbox-database-probe", daemon=True
                )
                self._probe.start()
        self._database_back.wait(FETCH_WAIT_SECONDS)
        self.deliverer.runs.tick()

    def _probe_database(self) -> None:
        """Until PostgreSQL answers (or the worker stops): one WARNING as fetching stops, one INFO
        as it resumes. On a thread of its own: a connect to a server the network lost waits up to
        ``OUTBOX_TCP_USER_TIMEOUT``, which neither a fetch thread nor the worker's stop must."""
        since = time.monotonic()
        logger.warning(
            "worker cannot reach PostgreSQL: stopped fetching; messages fetched and not claimed are "
            "handed back to their queues; fetching resumes when PostgreSQL answers",
            extra={"database": "unreachable"},
        )
        try:
            while self._running.is_set():
                if self.deliverer.database_answers():
                    logger.info(
                        "worker reaches PostgreSQL again: fetching resumed after %.0f s",
                        time.monotonic() - since,
                        extra={"database": "reachable", "seconds": round(time.monotonic() - since, 1)},
                    )
                    return
                self._running_wait(DATABASE_PROBE_SECONDS)
        except Exception:
            # Never a worker that stopped fetching for good: the next fetch turn starts another.
            logger.exception("asking PostgreSQL whether it answers failed")
        finally:
            self._database_back.set()

    def _running_wait(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while self._running.is_set() and (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))

    def _wait_for_message(self, name: str, timeout_seconds: float) -> None:
        """Until queue ``name`` holds a message or ``timeout_seconds`` pass, without taking one:
        ``BLMOVE`` from the queue's list to its own tail, which moves its last element to where
        it was, in one atomic command (Dramatiq's fetch takes from the head). Redis wakes every
        waiting worker when the relay (of any release) pushes; a message pushed since the empty
        fetch ends the wait at once. A plain sleep instead, as Dramatiq does: when
        :data:`WAKE_WAITS_PER_PROCESS` waits are under way, when the client's socket timeout
        leaves too short a wait, and on a Redis before 6.2 (no ``BLMOVE``). Redis failing here
        is the next fetch's to report."""
        broker: Any = self.broker  # a RedisBroker (outbox.transport.Broker)
        until = time.monotonic() + timeout_seconds
        shortest = WAKE_FROM_BACKOFF_MS / 1000
        if self._blmove and self._wake_limit_seconds >= shortest and self._wake_waits.acquire(blocking=False):
            key = queue_key(broker.namespace, name)
            try:
                # In turns no longer than the socket timeout allows, until the wait is over.
                while (left := until - time.monotonic()) >= shortest:
                    turn = min(left, self._wake_limit_seconds)
                    if broker.client.blmove(key, key, turn, src="RIGHT", dest="RIGHT") is not None:
                        return
            except redis.ResponseError as exc:
                if "unknown command" in str(exc).lower():
                    self._blmove = False
                    logger.info("this Redis has no BLMOVE (6.2): an idle worker polls its queues")
            except redis.RedisError:
                pass
            finally:
                self._wake_waits.release()
        time.sleep(max(0.0, until - time.monotonic()))

    def _claim_together(self, name: str, messages: list[Any]) -> list[_Fetched]:
        """The messages of one fetch, their rows claimed in one group (Deliverer.claim_group):
        one statement and one commit where each would have had its own. The middleware hears
        ``before_process_message`` first, here, on the thread that claims."""
        fetched = [_Fetched(message, name) for message in messages]
        ours = [f for f in fetched if f.row_id is not None]
        if len(ours) < 2:
            return fetched
        if self.broker.middleware:
            for f in ours:
                f.emitted = True
                try:
                    self.broker.emit_before("process_message", f.message)
                except Exception as exc:
                    f.error = exc
            ours = [f for f in ours if f.error is None]
        try:
            taken = self.deliverer.claim_group([f.row_id for f in ours if f.row_id is not None], name)
        except Exception:
            # Never a message without its delivery: each claims its row alone.
            logger.exception(
                "a group claim on queue %s failed; each row is claimed alone", name, extra={"queue": name}
            )
            taken = {}
        for f in ours:
            # A row named twice in one fetch (a re-dispatch beside its first message) is the group's
            # once; the other delivery's own claim finds it taken.
            f.taken = taken.pop(f.row_id, None) if f.row_id is not None else None
        return fetched

    # -- running -------------------------------------------------------------------------------

    def _deliveries(self) -> None:
        self.broker.emit_after("worker_thread_boot", self)
        self.deliverer.warm_thread()
        try:
            while (item := self._work.get()) is not None:
                error = item.error
                hand_back = False
                try:
                    if error is not None:
                        raise error
                    if item.row_id is not None:
                        if self._unclaimed_while_down(item):
                            if item.emitted:  # by the fetch's group claim: the middleware hears the end
                                self._finish(item.message, item.name, None, threading.Lock(), hand_back=True)
                            else:
                                self._hand_back(item.message, item.name)
                            continue
                        if not item.emitted:
                            self.broker.emit_before("process_message", item.message)
                        result = self.deliverer.deliver(item.row_id, item.name, item.taken)
                        hand_back = result is DeliveryResult.UNREACHABLE
                except Exception as exc:
                    error = exc
                    logger.exception(
                        "outbox delivery of message %s failed",
                        item.message.message_id,
                        extra={"message_id": item.message.message_id, "queue": item.name},
                    )
                self._finish(item.message, item.name, error, threading.Lock(), hand_back=hand_back)
        finally:
            self.deliverer.close_thread()

    def _unclaimed_while_down(self, fetched: _Fetched) -> bool:
        """A message fetched, not claimed by its fetch's group, PostgreSQL not answering: handed
        back at once rather than waiting out a connect that cannot succeed."""
        return fetched.taken is None and self.deliverer.database_down.is_set()

    async def _run_task(self, fetched: _Fetched) -> None:
        message, name = fetched.message, fetched.name
        running = asyncio.get_running_loop()

        def in_thread(fn: Any, *args: Any) -> Any:
            return running.run_in_executor(self._database, fn, *args)

        # Finished once: by the record's thread, or here if the run ended any other way.
        once = threading.Lock()
        error: BaseException | None = None
        try:
            if fetched.error is not None:
                raise fetched.error
            if fetched.row_id is not None:
                if self._unclaimed_while_down(fetched):
                    if fetched.emitted:
                        await in_thread(lambda: self._finish(message, name, None, once, hand_back=True))
                    else:
                        once.acquire()
                        await in_thread(self._hand_back, message, name)
                    return
                if self.broker.middleware and not fetched.emitted:
                    await in_thread(self.broker.emit_before, "process_message", message)
                await self.deliverer.deliver_async(
                    fetched.row_id,
                    name,
                    in_thread,
                    lambda result: self._finish(
                        message, name, None, once, hand_back=result is DeliveryResult.UNREACHABLE
                    ),
                    fetched.taken,
                )
        except Exception as exc:
            error = exc
            logger.exception(
                "outbox delivery of message %s failed",
                message.message_id,
                extra={"message_id": message.message_id, "queue": name},
            )
        finally:
            if not once.locked():
                await in_thread(self._finish, message, name, error, once)

    def _finish(
        self,
        message: Any,
        name: str,
        error: BaseException | None,
        once: threading.Lock,
        *,
        hand_back: bool = False,
    ) -> None:
        """After the record: the middleware's after_process_message, then the ack, then the slot
        is free; ``hand_back``: the message goes back to its queue instead of its ack (its row not
        claimed: PostgreSQL did not answer). Never raises: a delivery thread, or a database
        thread, goes on to the next."""
        if not once.acquire(blocking=False):
            return
        try:
            if self.broker.middleware:
                if error is None:
                    self.broker.emit_after("process_message", message, result=None)
                else:
                    self.broker.emit_after("process_message", message, exception=error)
        except Exception:
            logger.exception(
                "after_process_message of message %s raised",
                message.message_id,
                extra={"message_id": message.message_id, "queue": name},
            )
        if hand_back:
            self._hand_back(message, name)
        elif self._ack(message, name):
            self.slots.give(name)

    def _hand_back(self, message: Any, name: str) -> None:
        """Put a message whose row was not claimed back at the tail of its queue (Dramatiq's
        requeue: out of this worker's fetched set, into the queue), then free its slot; the ack
        thread tries again while Redis refuses. Never raises."""
        if self._requeue(message, name):
            self.slots.give(name)

    def _requeue(self, message: Any, name: str) -> bool:
        """False when Redis refused it and the ack thread tries again (it frees the slot then)."""
        try:
            self._consumers[name].requeue([message])
        except (BrokerConnectionError, redis.ConnectionError, redis.TimeoutError) as exc:
            if not self._running.is_set():
                logger.warning(
                    "message %s not handed back while stopping (%s): Redis delivers it again once this "
                    "worker's heartbeat there stops",
                    message.message_id,
                    exc,
                    extra={"message_id": message.message_id, "queue": name},
                )
                return True
            self._acks.put((message, name, True))
            return False
        except Exception:
            logger.exception(
                "handing message %s back failed: Redis delivers it again once this worker stops",
                message.message_id,
                extra={"message_id": message.message_id, "queue": name},
            )
        return True

    def _ack(self, message: Any, name: str) -> bool:
        """Ack once; False when Redis refused it and the ack thread tries again (it frees the
        slot then). Its row is settled whatever happens here: a message left unacked is only
        delivered again, to an empty claim."""
        try:
            self.broker.emit_before("ack", message)
        except Exception:
            # A middleware cannot keep a settled row's message from its ack.
            logger.exception(
                "before_ack of message %s raised; acking it anyway",
                message.message_id,
                extra={"message_id": message.message_id, "queue": name},
            )
        try:
            self._consumers[name].ack(message)
        except BrokerConnectionError as exc:
            if not self._running.is_set():
                logger.warning(
                    "ack of message %s not sent while stopping (%s): Redis delivers it again later, "
                    "to an empty claim",
                    message.message_id,
                    exc,
                    extra={"message_id": message.message_id, "queue": name},
                )
                return True
            logger.warning(
                "ack of message %s refused (%s); trying again every %.0f s",
                message.message_id,
                exc,
                ACK_RETRY_SECONDS,
                extra={"message_id": message.message_id, "queue": name},
            )
            self._acks.put((message, name, False))
            return False
        except Exception as exc:
            # Not a lost connection (an out-of-memory Redis; a demoted primary's READONLY is one,
            # outbox.transport): trying again would not help. The message stays fetched until
            # this worker stops.
            logger.error(
                "ack of message %s failed (%s: %s); its row is settled, the message is delivered "
                "again after this worker stops, to an empty claim",
                message.message_id,
                type(exc).__name__,
                exc,
                extra={"message_id": message.message_id, "queue": name},
            )
            return True
        try:
            self.broker.emit_after("ack", message)
        except Exception:
            logger.exception(
                "after_ack of message %s raised",
                message.message_id,
                extra={"message_id": message.message_id, "queue": name},
            )
        return True

    def _retry_acks(self) -> None:
        """Acks Redis refused, tried again off the delivery and database threads, so that an
        outage holds slots (no new fetch) but never the records of calls that finished."""
        while True:
            try:
                item = self._acks.get(timeout=FETCH_WAIT_SECONDS)
            except queue.Empty:
                if not self._running.is_set():
                    return
                continue
            if item is None:
                return
            message, name, requeue = item
            while True:
                try:
                    if requeue:
                        self._consumers[name].requeue([message])
                    else:
                        self._consumers[name].ack(message)
                    break
                except (BrokerConnectionError, redis.ConnectionError, redis.TimeoutError):
                    if not self._running.is_set():
                        break
                    time.sleep(ACK_RETRY_SECONDS)
                except Exception:
                    logger.exception(
                        "ack of message %s failed",
                        message.message_id,
                        extra={"message_id": message.message_id, "queue": name},
                    )
                    break
            self.slots.give(name)
