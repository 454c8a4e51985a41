"""One wrapper per component step the interleaving scheduler drives.

Everything the harness knows about the product's API is in this module, so that a change of
signature is adapted here and nowhere else. Each wrapper calls the real code path (the relay's
``run_once``, the worker's Dramatiq actor and ``Deliverer``, the reconciler's ``run_job``, the
operator commands of ``outbox.ops`` as the CLI calls them, ``outbox.write``/``outbox.cancel``).

The harness only adds observation points around them:

- ``checkpoint(name)``: the product's ``failpoint`` names (after_claim, after_call,
  after_record), the test handler's own points (before_post, after_post), and the harness's
  (fetched, before_ack, relay_after_publish). At a checkpoint a run may park (the scheduler runs
  other steps meanwhile) or crash (a :class:`Crash` unwinds the run, its connections are dropped,
  its broker message is never acked).
- a per-thread clock offset on the product modules that read the local clock;
- a wrapper on the worker's raw connections that measures how long a claim took (lock waits) and
  can lose the reply of a committed claim (issue 9, class 8), or cut its process off from
  PostgreSQL as that reply is on its way (``pg_unreachable``).

What the worker's loop (``outbox.runner.Runner``) does with a delivery's result is mirrored on
:class:`WorkerProcess` (the Runner's methods need its fetch, delivery and ack threads): no fetch
while ``Deliverer.database_down`` is set, a message fetched and not claimed then, or whose delivery
answered ``DeliveryResult.UNREACHABLE``, handed back through the process's Dramatiq consumer
(``requeue``) instead of acked, and ``Deliverer.database_answers`` as the probe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import httpx
import psycopg
import pydantic
import pytest
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message
from dramatiq.middleware import CurrentMessage
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import outbox
from outbox import aio, limits, ops, outcomes, pauses, runner, store
from outbox import transport as outbox_transport
from outbox.consumer import Deliverer, DeliveryResult
from outbox.exceptions import ConfigError
from outbox.handlers import Handler
from outbox.reconciler import Reconciler
from outbox.relay import Relay
from outbox.settings import libpq_url

OPERATOR = "oxil-operator"


class Crash(BaseException):
    """A simulated process death at a step boundary (a BaseException, so that no ``except
    Exception`` in the product can mistake it for an outcome)."""


# -- per-thread context: which run a thread belongs to, and its process's clock ------------------

_local = threading.local()
#: The run too, as a context variable: an async delivery's coroutine runs on the event loop's
#: thread, in a copy of the context of the run's thread that submitted it. Read only to attribute
#: deliveries to runs (``delivery_for``): a checkpoint on the loop's thread would park the loop.
_context_run: contextvars.ContextVar[Any] = contextvars.ContextVar("oxil_run", default=None)


def bind_thread(*, run: Any = None, clock_offset: float = 0.0) -> None:
    _local.run = run
    _local.clock_offset = clock_offset
    _context_run.set(run)


def current_run() -> Any:
    return getattr(_local, "run", None)


def calling_run() -> Any:
    """The run a delivery belongs to: the thread's, or the coroutine's (an async delivery)."""
    return current_run() or _context_run.get()


def checkpoint(name: str) -> None:
    run = current_run()
    if run is not None:
        run.checkpoint(name)


_REAL_DATETIME = datetime


class SkewedDatetime(datetime):
    """``datetime`` whose ``now()`` is the real clock plus the calling thread's process offset."""

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        real = _REAL_DATETIME.now(tz)
        offset = getattr(_local, "clock_offset", 0.0)
        return real + timedelta(seconds=offset) if offset else real


#: Modules whose ``datetime.now()`` is a process's local clock. The product is being changed to
#: compute every compared instant in SQL; a module that no longer reads the clock is unaffected.
CLOCK_MODULES = (
    "outbox.consumer",
    "outbox.policy",
    "outbox.settlement",
    "outbox.reconciler.jobs.redispatch",
    "outbox.store.delivery",
    "outbox.store.recovery",
    "outbox.store.operator",
)


def install_hooks(monkeypatch: pytest.MonkeyPatch, world: Any) -> None:
    import importlib

    for name in CLOCK_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "datetime"):
                monkeypatch.setattr(module, "datetime", SkewedDatetime, raising=False)
    import outbox.consumer as consumer_module

    # The product's crash-injection points become the harness's checkpoints.
    monkeypatch.setattr(consumer_module, "failpoint", checkpoint, raising=False)
    real_connect = consumer_module.connect_raw

    def connect(url: str, **options: Any) -> Any:
        return WatchedConnection(real_connect(url, **options), world)

    monkeypatch.setattr(consumer_module, "connect_raw", connect, raising=False)
    real_delivery_for = consumer_module.delivery_for

    def delivery_for(claimed: Any, *args: Any, **kwargs: Any) -> Any:
        # Built on the run's thread (or its coroutine) before the call; the call itself runs on a
        # thread of the Deliverer's, which belongs to no run: the handler finds its run by it.
        delivery = real_delivery_for(claimed, *args, **kwargs)
        world.tracker.on_delivery(calling_run(), delivery)
        return delivery

    monkeypatch.setattr(consumer_module, "delivery_for", delivery_for)
    # A claim whose reply was lost is settled (fenced, released) by its worker unless the
    # database stays silent this long; then its message is handed back (DeliveryResult.UNREACHABLE).
    # 10 s in the product, for a server restart; scaled down as the leases are, so that a cut of a
    # few seconds reaches that hand-back within a schedule.
    monkeypatch.setattr(consumer_module, "LOST_CLAIM_UNREACHABLE_SECONDS", LOST_CLAIM_UNREACHABLE_SECONDS)
    # The hot statements (the claim among them) run on a cursor of their own, not through
    # Connection.execute: watched there too, or the claim's faults would never fire.
    from outbox import db as outbox_db

    real_statement = outbox_db.Statement.execute

    def statement_execute(self: Any, conn: Any, params: Any) -> Any:
        if isinstance(conn, WatchedConnection):
            return conn.run_statement(self, params, real_statement)
        return real_statement(self, conn, params)

    monkeypatch.setattr(outbox_db.Statement, "execute", statement_execute)
    real_publish = outbox_transport.publish_group

    def publish(*args: Any, **kwargs: Any) -> Any:
        published = real_publish(*args, **kwargs)
        # The relay between its Redis push and its COMMIT: the rows are locked, the messages out.
        checkpoint("relay_after_publish")
        return published

    # The relay's own call (publish_rows is not on its path): wrapping the wrong one left this
    # checkpoint unreached.
    monkeypatch.setattr(outbox_transport, "publish_group", publish)


# -- the worker's connections --------------------------------------------------------------------


#: The harness's LOST_CLAIM_UNREACHABLE_SECONDS (outbox.consumer's, scaled down).
LOST_CLAIM_UNREACHABLE_SECONDS = 1.0


def is_claim(query: Any) -> bool:
    text = query if isinstance(query, str) else repr(query)
    return "in_flight" in text and "attempts + 1" in text


def is_record(query: Any) -> bool:
    """The record of a claim's outcome (outbox.store.delivery.record): it marks a late one."""
    text = query if isinstance(query, str) else repr(query)
    return "'superseded:' ||" in text


class WatchedConnection:
    """A worker's psycopg connection: times each claim, and loses the reply of a committed claim
    when its process is armed to (the connection breaks after the server committed; with
    ``cut_at_next_claim`` its process is cut off from PostgreSQL at that moment), or loses
    a claim before it ran (``late_claim``: as if queued in a pooler, it runs later, when the
    harness says, on a connection of its own). A claim whose connection broke under it (a cut, a
    terminated backend) is reported too: it may have committed."""

    def __init__(self, conn: psycopg.Connection[Any], world: Any) -> None:
        self._conn = conn
        self._world = world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def run_statement(self, statement: Any, params: Any, real: Any) -> Any:
        if is_record(statement.sql):
            return self._record(statement, params, real)
        if not is_claim(statement.sql):
            return real(statement, self._conn, params)
        run = current_run()
        token = params.get("token")
        row_id = params.get("id")
        # A group claim (outbox.store.delivery.claim_group): its rows and their tokens.
        group = list(zip(params["ids"], params["tokens"], strict=True)) if "tokens" in params else None
        if group is not None:
            row_id = [i for i, _ in group]
        if run is not None and run.proc.late_next_claim:
            run.proc.late_next_claim = False
            self._world.on_late_claim(run, row_id, token, lambda conn: real(statement, conn, params))
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated pooler)")
        started = time.monotonic()
        rows = group if group is not None else [(row_id, token)]
        try:
            cursor = real(statement, self._conn, params)
        except psycopg.OperationalError:
            if self._conn.broken or self._conn.closed:
                for one_id, one_token in rows:
                    self._world.on_claim(
                        run, one_id, one_token, time.monotonic() - started, lost=True, broke=True
                    )
            raise
        waited = time.monotonic() - started
        cut = run is not None and run.proc.cut_at_next_claim
        lose = run is not None and (run.proc.lose_next_claim_reply or cut)
        for one_id, one_token in rows:
            self._world.on_claim(run, one_id, one_token, waited, lost=lose)
        if lose:
            run.proc.lose_next_claim_reply = run.proc.cut_at_next_claim = False
            if cut:
                self._world.on_cut_at_claim(run.proc)
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated)")
        return cursor

    def _record(self, statement: Any, params: Any, real: Any) -> Any:
        """A record; with ``cut_at_next_record`` armed, its process is cut off from PostgreSQL as
        the reply is on its way (the record committed): the worker tries it again."""
        cursor = real(statement, self._conn, params)
        run = current_run()
        if run is not None and run.proc.cut_at_next_record:
            run.proc.cut_at_next_record = False
            self._world.on_cut_at_record(run.proc, params.get("id"))
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated)")
        return cursor

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if not is_claim(query):
            return self._conn.execute(query, params, **kwargs)
        run = current_run()
        started = time.monotonic()
        cursor = self._conn.execute(query, params, **kwargs)
        waited = time.monotonic() - started
        tokens = (
            [v for v in (params or {}).values() if isinstance(v, uuid.UUID)]
            if isinstance(params, Mapping)
            else []
        )
        row_id = params.get("id") if isinstance(params, Mapping) else None
        lose = run is not None and run.proc.lose_next_claim_reply
        self._world.on_claim(run, row_id, tokens[0] if tokens else None, waited, lost=lose)
        if lose:
            run.proc.lose_next_claim_reply = False
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (simulated)")
        return cursor


# -- handlers -------------------------------------------------------------------------------------


class IxCharge(pydantic.BaseModel):
    """issue 15: the payload ix.charge accepts; the application sometimes writes one it does not."""

    amount_cents: int
    currency: str


@dataclasses.dataclass(frozen=True)
class Destination:
    name: str
    max_attempts: int
    lookup: bool
    #: issue 13: a 503's Retry-After pauses the whole destination (outbox.pauses.hold)
    retry_after_scope: str = "row"
    #: issue 13 part 3: the destination's circuit breaker (outbox.breaker); None: none
    breaker: outbox.Breaker | None = None
    #: issue 14: a `then` and an `on_failure` step (outbox.chains)
    chained: bool = False
    #: issue 15: the payload's model (outbox.payloads): an invalid payload fails without a call
    model: Any = None
    #: issue 32: an ``async def`` handler and lookup, run as tasks on the process's event loop
    asynchronous: bool = False


DESTINATIONS = (
    # Breakers that trip within a few 503s and half-open within a second, so that schedules
    # reach the probe, its race and its outcomes.
    Destination(
        "ix.charge",
        max_attempts=3,
        lookup=True,
        retry_after_scope="destination",
        breaker=outbox.Breaker(failures=2, window_seconds=10, open_seconds=0.5, max_open_seconds=2),
        chained=True,
        model=IxCharge,
    ),
    Destination(
        "ix.once",
        max_attempts=1,
        lookup=True,
        breaker=outbox.Breaker(failures=3, window_seconds=10, open_seconds=1, max_open_seconds=2),
    ),
    Destination("ix.manual", max_attempts=2, lookup=False),
    Destination(
        "ix.async",
        max_attempts=2,
        lookup=True,
        breaker=outbox.Breaker(failures=2, window_seconds=10, open_seconds=0.5, max_open_seconds=2),
        asynchronous=True,
    ),
)


def declare_handlers(
    provider_url: str, tracker: Any, *, time_limit: float
) -> tuple[dict[str, Handler], float]:
    """Register the three test destinations on a provider that does not deduplicate; returns the
    handlers and the lease they got (the shortest the product accepts from a short list)."""
    outbox.handlers.clear_registry()
    lease = None
    last_error: Exception | None = None
    for candidate in (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0):
        try:
            _declare(Destination("ix.probe", 1, False), provider_url, tracker, time_limit, candidate)
        except ConfigError as exc:
            last_error = exc
            continue
        lease = candidate
        break
    if lease is None:
        raise AssertionError(f"no short lease accepted: {last_error}")
    outbox.handlers.clear_registry()
    for dest in DESTINATIONS:
        _declare(dest, provider_url, tracker, time_limit, lease)
    return outbox.handlers.registry(), lease


def _declare(dest: Destination, provider_url: str, tracker: Any, time_limit: float, lease: float) -> None:
    options: dict[str, Any] = dict(
        time_limit=time_limit,
        max_attempts=dest.max_attempts,
        backoff=(0.5, 1.0),
        idempotent=False,
        lease_seconds=lease,
        retry_after_scope=dest.retry_after_scope,
        breaker=dest.breaker,
        payload_model=dest.model,
        # issue 15: a certainly failed row lets the rest of its ordering key go (a blocked key
        # would wait for an operator's skip, which the schedules do not always make).
        on_failed_head="skip",
    )
    if dest.asynchronous:
        _declare_async(dest, provider_url, tracker, options)
        return

    @outbox.handler(dest.name, **options)
    def charge(d: outbox.Delivery) -> Any:
        checkpoint("before_post")
        processing = tracker.processing_seconds
        if processing:
            r = _post_still_processing(d, provider_url, tracker, processing)
        else:
            tracker.post_started(d)
            try:
                r = d.http.post(
                    f"{provider_url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
                )
            finally:
                tracker.post_ended(d)
        checkpoint("after_post")
        return _charged(r)

    if dest.chained:
        # issue 14: a confirmed charge writes its next step, a certainly failed one its
        # compensation, both on ix.once, in the statement that settles it.
        charge.then(lambda d, c: [outbox.Next(f"{d.step}-next", "ix.once", {"of": c.ref})])
        charge.on_failure(lambda d, error: [outbox.Next(f"{d.step}-undo", "ix.once", {"failed": True})])

    if dest.lookup:

        @charge.lookup
        def find(d: outbox.Delivery) -> outbox.Confirmed | None:
            return _found(
                d.http.get(f"{provider_url}/charges", params={"idempotency_key": d.idempotency_key})
            )


def _declare_async(dest: Destination, provider_url: str, tracker: Any, options: dict[str, Any]) -> None:
    """The async twin: its call and lookup run on the event loop's thread, where no run is bound,
    so the harness's own checkpoints fire around it (claim, call, record) on the worker's thread,
    not inside it; the provider's tracker still sees each request start and end."""

    @outbox.handler(dest.name, **options)
    async def charge(d: outbox.Delivery) -> outbox.Confirmed:
        tracker.post_started(d)
        try:
            r = await d.http.post(
                f"{provider_url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
            )
        finally:
            tracker.post_ended(d)
        return _charged(r)

    if dest.lookup:

        @charge.lookup
        async def find(d: outbox.Delivery) -> outbox.Confirmed | None:
            return _found(
                await d.http.get(f"{provider_url}/charges", params={"idempotency_key": d.idempotency_key})
            )


def _charged(r: Any) -> outbox.Confirmed:
    """The provider's answer to a charge, as every test handler reads it."""
    if r.status_code == 402:
        raise outbox.PermanentError("card declined")
    return _confirmed(r)


def _found(r: Any) -> outbox.Confirmed | None:
    """The provider's answer to a lookup: 404, no charge with that key."""
    return None if r.status_code == 404 else _confirmed(r)


def _confirmed(r: Any) -> outbox.Confirmed:
    r.raise_for_status()
    body = r.json()
    return outbox.Confirmed(ref=body["id"], response={"id": body["id"], "status": body.get("status")})


def _post_still_processing(d: outbox.Delivery, provider_url: str, tracker: Any, seconds: float) -> Any:
    """A provider that is still executing the request when the client stops waiting: the effect
    lands ``seconds`` after the call started (less than the call's time limit), and a lookup before
    then finds nothing. The simulator's own latency delays lookups as much as charges, so it can
    never show this; the request is made from a thread that outlives the handler's wait."""
    answer: dict[str, Any] = {}
    tracker.post_started(d)

    def send() -> None:
        try:
            time.sleep(seconds)
            with httpx.Client(timeout=5.0) as client:
                answer["response"] = client.post(
                    f"{provider_url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
                )
            tracker.log(
                f"provider: the charge of row {d.id} (attempt {d.attempt}) landed, "
                f"HTTP {answer['response'].status_code}, after the client stopped waiting",
                d.id,
            )
        except Exception as exc:
            answer["error"] = exc
        finally:
            tracker.post_ended(d)

    thread = threading.Thread(target=send, name=f"oxil-provider-processing-{d.id}", daemon=True)
    thread.start()
    # The read timeout of d.http (Handler.timeouts), which the handler's Delivery carries.
    waited = d.http.timeout.read
    thread.join(waited)
    if "response" in answer:
        return answer["response"]
    if "error" in answer:
        raise answer["error"]
    request = httpx.Request("POST", f"{provider_url}/charges")
    raise httpx.ReadTimeout(
        "no answer within the read timeout (the provider is still processing)", request=request
    )


def idempotency_key(key: str, step: str) -> str:
    return outbox.handlers.idempotency_key(key, step)


# -- worker process -------------------------------------------------------------------------------


class WorkerProcess:
    """One ``outbox worker`` process with one thread: its own Dramatiq broker identity (heartbeat,
    un-acked set), its own database connections (``database_url``: through its own forwarder
    when the harness may cut it off) and its own clock offset."""

    def __init__(
        self,
        world: Any,
        number: int,
        *,
        database_url: str,
        redis_url: str,
        namespace: str,
        handlers: Mapping[str, Handler],
        clock_offset: float,
        heartbeat_timeout_ms: int,
    ) -> None:
        self.number = number
        self.name = f"w{number}"
        self.clock_offset = clock_offset
        self.alive = True
        self.lose_next_claim_reply = False
        self.late_next_claim = False
        self.cut_at_next_claim = False
        self.cut_at_next_record = False
        self.broker = RedisBroker(
            url=redis_url,
            namespace=namespace,
            middleware=[CurrentMessage()],
            heartbeat_timeout=heartbeat_timeout_ms,
            # Every command runs Dramatiq's maintenance: a dead worker's un-acked messages go back
            # to their queue as soon as its heartbeat is older than heartbeat_timeout.
            maintenance_chance=1_000_000,
        )
        self.consumer = Deliverer(_with_app_name(database_url, f"oxil-{self.name}"), handlers)
        self.handlers = handlers
        self.queues = sorted(handlers)
        for queue in self.queues:
            self.broker.declare_queue(queue)
        # Dramatiq's consumers, as the Runner holds them: it fetches past them, and hands
        # messages back through them.
        self.consumers = {queue: self.broker.consume(queue_name=queue, prefetch=1) for queue in self.queues}

    @property
    def fetching(self) -> bool:
        """Runner._fetch: no fetch while PostgreSQL does not answer (until the probe says it does)."""
        return not self.consumer.database_down.is_set()

    def unclaimed_while_down(self, taken: Any) -> bool:
        """Runner._unclaimed_while_down: a message its fetch's group did not claim, PostgreSQL not
        answering: handed back without a delivery."""
        return taken is None and self.consumer.database_down.is_set()

    @staticmethod
    def hands_back(result: Any) -> bool:
        """Runner._finish's ``hand_back``: the delivery's answer that its row was not claimed."""
        return result is DeliveryResult.UNREACHABLE

    def hand_back(self, message: Message[Any]) -> None:
        """Runner._requeue: back at the tail of its queue, out of this process's un-acked set."""
        self.consumers[message.queue_name].requeue([message])

    def probe(self) -> bool:
        """Runner._probe_database's question: True (and fetching again) once PostgreSQL answers."""
        return self.consumer.database_answers()

    def heartbeat(self) -> None:
        for queue in self.queues:
            self.broker.do_fetch(queue, 0)

    def fetch(self, queue: str, n: int = 1) -> list[Message[Any]]:
        data = self.broker.do_fetch(queue, n)
        # None: the id was queued but its body is gone (a flush between the two keys); Dramatiq
        # skips it the same way.
        return [Message.decode(d) for d in data or () if d is not None]

    def claim_group(self, messages: list[Message[Any]]) -> dict[int, Any]:
        """What the worker's loop does with a fetch of several messages before their deliveries
        (outbox.runner): their rows claimed as one group."""
        ids = [row_id for m in messages if (row_id := runner.row_id_of(m, m.queue_name)) is not None]
        return self.consumer.claim_group(ids, messages[0].queue_name)

    def process(self, message: Message[Any], taken: Any = None) -> DeliveryResult | None:
        """What the worker's loop (outbox.runner) does with a message, the ack excepted (its
        result says whether the message is acked or handed back; None: not ours): a sync
        handler's delivery on this thread, an async handler's as a task on the event loop whose
        claim and record steps run where the loop is (the product runs them on a database
        thread; here they run in turn, as the model schedules them)."""
        self.broker.emit_before("process_message", message)
        try:
            queue = message.queue_name
            row_id = runner.row_id_of(message, queue)
            if row_id is None:
                return None
            handler = self.handlers.get(queue)
            if handler is not None and handler.is_async:
                return self._deliver_async(row_id, queue, taken)
            return self.consumer.deliver(row_id, queue, taken)
        finally:
            self.broker.emit_after("process_message", message)

    def _deliver_async(self, row_id: int, queue: str, taken: Any = None) -> DeliveryResult:
        """deliver_async as the runner drives it, its claim and record steps on a thread of their
        own (the product's database threads) bound to this run: its checkpoints park there, its
        crashes end the delivery, and it keeps this worker's clock."""
        run, offset = current_run(), getattr(_local, "clock_offset", 0.0)
        with concurrent.futures.ThreadPoolExecutor(
            1, initializer=lambda: bind_thread(run=run, clock_offset=offset)
        ) as steps:

            async def in_thread(fn: Any, *args: Any) -> Any:
                return await asyncio.get_running_loop().run_in_executor(steps, fn, *args)

            if isinstance(taken, tuple):
                # A row the group claimed runs its pre-flight on the loop, whose thread belongs to
                # no run: its after_claim point is taken here, where nothing has happened since.
                checkpoint("after_claim")
            return aio.run(self.consumer.deliver_async(row_id, queue, in_thread, taken=taken))

    def ack(self, message: Message[Any]) -> None:
        self.broker.do_ack(message.queue_name, message.options["redis_message_id"])

    def die(self) -> None:
        """SIGKILL: connections gone, no ack, no more heartbeats."""
        self.alive = False
        with contextlib.suppress(Exception):
            self.consumer.close()
        with contextlib.suppress(Exception):
            self.broker.client.connection_pool.disconnect()

    def stop(self) -> None:
        if self.alive:
            self.die()


def _with_app_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


# -- relay ---------------------------------------------------------------------------------------


def make_relay(database_url: str, redis_url: str, namespace: str, batch_size: int) -> Relay:
    return Relay(
        database_url=_with_app_name(database_url, "oxil-relay"),
        redis_url=redis_url,
        namespace=namespace,
        batch_size=batch_size,
        parallel=1,
    )


def relay_batch(relay: Relay) -> int:
    return relay.run_once().published


# -- reconciler ----------------------------------------------------------------------------------


def make_reconciler(
    database_url: str,
    redis_url: str,
    namespace: str,
    handlers: Mapping[str, Handler],
    *,
    redispatch_after: float,
    retention: float,
    unknown_alert_after: float,
) -> Reconciler:
    wanted: dict[str, Any] = dict(
        database_url=database_url,
        redis_url=redis_url,
        handlers=handlers,
        module="tests.interleaving",
        namespace=namespace,
        redispatch_after_seconds=redispatch_after,
        retention_seconds=retention,
        unknown_alert_after_seconds=unknown_alert_after,
        redispatch_grace_seconds=0.5,
        alert_hook=lambda _row: None,
        name="oxil-reconciler",
    )
    accepted = inspect.signature(Reconciler).parameters
    return Reconciler(**{k: v for k, v in wanted.items() if k in accepted})


def reconciler_jobs(reconciler: Reconciler) -> list[str]:
    return list(reconciler.jobs)


def run_job(reconciler: Reconciler, name: str) -> dict[str, int]:
    return reconciler.run_job(name)


# -- the application and the operator -------------------------------------------------------------


def write(
    engine: Engine,
    *,
    key: str,
    step: str,
    destination: str,
    payload: dict[str, Any],
    deadline: datetime | None = None,
    ordering_key: str | None = None,
    priority: str = "normal",
    fairness_key: str | None = None,
) -> Any:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s,
            key=key,
            step=step,
            destination=destination,
            payload=payload,
            deadline=deadline,
            ordering_key=ordering_key,
            priority=priority,
            fairness_key=fairness_key,
        )


def write_batch(
    engine: Engine, *, name: str, members: list[tuple[str, dict[str, Any]]], then: Any, catch: Any
) -> list[int]:
    """``outbox.batch`` and its members in one transaction (issue 14): ``members`` are
    ``(destination, payload)``, written as steps ``m0``, ``m1``, … of key ``name``."""
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name=name, then=then, catch=catch)
        return [
            outbox.write(s, key=name, step=f"m{n}", destination=d, payload=p, batch=b).id
            for n, (d, p) in enumerate(members)
        ]


def cancel(engine: Engine, *, key: str, step: str) -> bool:
    with Session(engine) as s, s.begin():
        return outbox.cancel(s, key=key, step=step)


def _call_accepting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call an ops function with the keyword arguments it knows (``yes=True`` where a bulk action
    asks for confirmation)."""
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def operator_resolve(engine: Engine, row_id: int, **how: Any) -> str:
    with engine.begin() as conn:
        return str(ops.resolve(conn, row_id, by=OPERATOR, **how).message)


def operator_replay(engine: Engine, row_id: int, reason: str) -> list[Any]:
    with engine.begin() as conn:
        return list(ops.replay(conn, [row_id], by=OPERATOR, reason=reason))


#: `outbox replay ID` as the floor release (ffe982d, before chains and ordering) sends it: its own
#: rules (no blocking attempt row, no operator's resolve --failed), none of the later ones. Migration
#: 0022's trigger must refuse what those later rules refuse (a compensated step, a row out of its
#: ordering key's line); the checker's ordering and chain promises catch it if it does not.
OLD_RELEASE_REPLAY = f"""
UPDATE outbox_message m
SET state = 'pending', attempts = 0, available_at = now(), dispatched_at = NULL, completed_at = NULL,
    alerted_at = NULL, unknown_since = NULL, lease_expires_at = NULL,
    history = history || jsonb_build_array(jsonb_build_object(
        'at', now(), 'by', '{OPERATOR}-old', 'action', 'replay', 'from', state, 'to', 'pending'))
WHERE m.id = %(id)s AND m.state = 'failed'
  AND NOT EXISTS ({store.operator.BLOCKING_ATTEMPT_SQL})
  AND NOT {outcomes.operator_failed_unknown_sql("m")}
RETURNING m.id
"""


def old_release_replay(database_url: str, row_id: int) -> bool:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        return conn.execute(OLD_RELEASE_REPLAY, {"id": row_id}).fetchone() is not None


def operator_replay_destination(engine: Engine, destination: str, reason: str) -> list[Any]:
    with engine.begin() as conn:
        return list(
            _call_accepting(ops.replay_destination, conn, destination, by=OPERATOR, reason=reason, yes=True)
        )


def operator_repair(
    engine: Engine, database_url: str, key: str, handlers: Any, *, force: bool = False
) -> list[str]:
    """``outbox repair M KEY --yes`` (issue 14), as the CLI calls it: the plan in one
    transaction, then each action in its own guarded statement. ``force``: ``--force --reason``,
    which overrules an operator's ``resolve --failed`` (the provider is asked first)."""
    from outbox.ops import repair

    reason = "support: the customer wants it after all" if force else "runbook: repair"
    with engine.begin() as conn:
        plan = repair.plan_repair(conn, [key], handlers=handlers, module="interleaving", force=force)
    done = repair.execute_repair(
        database_url, plan, handlers=handlers, module="interleaving", by=OPERATOR, reason=reason
    )
    return [r.message for r in done]


def operator_pause(engine: Engine, destination: str, *, for_seconds: float | None) -> str:
    """``outbox pause D --reason … [--until Ns]`` (issue 13), as the CLI calls it."""
    with engine.begin() as conn:
        return pauses.pause(
            conn, destination, by=OPERATOR, reason="provider incident", for_seconds=for_seconds
        ).describe()


def operator_resume(engine: Engine, destination: str) -> bool:
    with engine.begin() as conn:
        return pauses.resume(conn, destination, by=OPERATOR).pause is not None


def operator_limit(
    engine: Engine, destination: str, in_flight: int | None, per_second: float | None = None
) -> str:
    """``outbox limit D --in-flight N --per-second R --reason …`` (issue 33), or ``--clear``
    (neither), as the CLI calls it."""
    with engine.begin() as conn:
        if in_flight is None and per_second is None:
            return f"cleared: {limits.clear_limit(conn, destination, by=OPERATOR)}"
        return limits.set_limit(
            conn,
            destination,
            in_flight=in_flight,
            per_second=per_second,
            by=OPERATOR,
            reason="provider allows few",
        ).describe()


# -- provider ------------------------------------------------------------------------------------


def provider_charge(provider: Any, key: str) -> dict[str, Any] | None:
    """What the provider's own records say for an idempotency key (the operator's dashboard):
    read from the simulator's state, not through its lookup endpoint, which may be failing."""
    return provider._state.lookup(key)


def provider_effects(provider: Any) -> dict[str, int]:
    return dict(provider.stats()["effects"])
