"""One delivery run (:class:`Deliverer`): claim → call → record. The broker ack comes after, in
the worker.

A call starts only with ``time_limit`` plus a margin of lease left, measured on this process's
monotonic clock from when the claim was sent; otherwise the claim is released (no call, not an
attempt). The call has a total deadline (``time_limit`` and a short grace, see
``Handler.call_deadline_seconds``), after which its outcome is recorded as ambiguous while the
lease still covers the record.

Every outcome is logged as one structured line naming the row, never its payload: failed,
unknown, released and superseded runs at WARNING (the audit trail), sent and pending runs at
DEBUG; every run is counted, and the counts are one INFO line every :data:`RUN_LOG_SECONDS`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import enum
import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import httpx
import psycopg

from . import aio, breaker, chains, limits, logs, metrics, pauses, payloads, policy, store, tracing
from .db import connect_raw, tolerate_unloadable
from .failover import FailoverGuard
from .failpoints import failpoint
from .handlers import (
    Confirmed,
    Deliveries,
    Delivery,
    Handler,
    idempotency_key,
    last_response_status,
    last_retry_after,
    requests_begun,
    set_send_bound,
)
from .policy import Decision, Move, Outcome, decide_exception, decide_result, next_state
from .settings import (
    DEFAULT_ASYNC_POOL_SIZE,
    DEFAULT_WORKER_CLAIM_CONNECTIONS,
    DEFAULT_WORKER_RECORD_CONNECTIONS,
)
from .validation import header_safe

if TYPE_CHECKING:
    # Only the worker makes one: importing redis-py (8) imports OpenTelemetry when installed,
    # and a process that only delivers must not (tests/integration/test_tracing.py).
    from .wakes import Wakes

logger = logging.getLogger(__name__)


#: A row released this many times (claims given back without a call) is reported at ERROR: a
#: lock held for longer than a lease, or commits stalled for that long, keep it from ever running.
RELEASE_ALERT_THRESHOLD = 3
#: How long a worker keeps trying to settle a claim whose reply was lost (reconnect, fence the
#: claim, release) before it gives up and leaves the row to the lease and the reconciler.
LOST_CLAIM_RECOVERY_SECONDS = 60.0
#: ... unless the database answers none of those tries for this long: then the worker stops trying
#: and hands the message back (DeliveryResult.UNREACHABLE), for a worker that reaches the database.
#: Long enough for a server restart, so that its lost claims are still released at once.
LOST_CLAIM_UNREACHABLE_SECONDS = 10.0
#: How long one delivery statement waits for a row lock (store.sql.LOCK_WAIT_MS).
LOCK_WAIT_MS = store.sql.LOCK_WAIT_MS
#: Pauses between those tries: doubling from the first to the last.
LOCK_RETRY_SECONDS = (0.05, 1.0)
#: A statement still refused a row lock after this long is logged (once per statement).
LOCK_WAIT_WARN_SECONDS = 10.0
#: A claim its destination's in-flight limit refused is tried again after these pauses (doubling
#: from the first to the last), its message not acked; after HOLD_MAX_SECONDS of that the message
#: is acked and the row waits `dispatched` for the reconciler's re-dispatch (outbox.limits).
HOLD_RETRY_SECONDS = (0.05, 1.0)
HOLD_MAX_SECONDS = 30.0
#: The runs of this long are summed into one INFO line (a sent or pending run is a DEBUG line of
#: its own): a line per run was about 5% of an async worker's CPU.
RUN_LOG_SECONDS = 10.0
#: How the sum line names each result (a pending run is a retry scheduled), in its order; the
#: first three always, the others when they happened.
_SUM_NAMES = {
    "sent": "sent",
    "pending": "retried",
    "failed": "failed",
    "unknown": "unknown",
    "released": "released",
    "superseded": "superseded",
    "unhandled": "unhandled",
    "empty": "empty",
    "held": "held",
    "paused": "paused",
    "halted": "halted",
    "unreachable": "unreachable",
}
_SUM_ALWAYS = ("sent", "retried", "failed")
#: What the per-run line's message shows already (``order:42:charge -> sent (attempt 1)``): not
#: repeated as fields on a text line (outbox.logs), kept as fields in JSON.
_RUN_SHOWN = frozenset({"key", "step", "attempt", "outbox_run"})


class DeliveryResult(enum.StrEnum):
    EMPTY = "empty"  # nothing to claim: a duplicate or stale message
    SENT = "sent"
    PENDING = "pending"  # retry scheduled
    FAILED = "failed"
    UNKNOWN = "unknown"
    SUPERSEDED = "superseded"  # a newer claim owns the row; our recording only went to its attempt row
    UNHANDLED = "unhandled"
    RELEASED = "released"  # claimed, then given back without a call
    HALTED = "halted"  # not claimed: the database is on another history (outbox.failover)
    PAUSED = "paused"  # not claimed: an operator paused the destination (outbox.pauses)
    HELD = "held"  # not claimed: its destination stayed at its in-flight limit (outbox.limits)
    UNREACHABLE = "unreachable"  # not claimed: PostgreSQL did not answer; the message is handed back


_STREAM = frozenset({DeliveryResult.SENT, DeliveryResult.PENDING})


class _Abandoned(BaseException):
    """Raised in a handler's thread once the worker stopped waiting for it. Best effort: pure
    Python stops at once, a thread blocked in a socket call only when that call returns; either
    way, a request it had not sent yet is not sent."""


class _NotStarted(Exception):
    """The call thread reached a call after its start bound (the process was paused): no call."""


class _NotCalled:
    """No call was made, or the one made sent nothing: no attempt, the claim is released with
    ``reason`` (decided by the pre-flight, or by the call's start bound and client pool)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Done:
    """``threading.Event``'s set, wait and is_set for one setter (the call thread) and one waiter
    (the worker thread), on a single lock: an Event is a Condition, a lock and a waiter lock per
    wait, which costs every delivery more CPU (docs/decisions/hot-path-costs.md)."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=max(0.0, timeout)) or self._flag


class _Call:
    __slots__ = (
        "arg",
        "done",
        "end_by",
        "error",
        "fn",
        "http_status",
        "requests",
        "result",
        "retry_after",
        "start_by",
    )

    def __init__(self, fn: Callable[[Any], Any], arg: Any, start_by: float, end_by: float) -> None:
        self.fn = fn
        self.arg = arg
        self.start_by = start_by
        self.end_by = end_by
        self.done = _Done()
        self.result: Any = None
        self.error: BaseException | None = None
        #: The last status the provider answered through ``d.http`` during the call.
        self.http_status: int | None = None
        #: That answer's Retry-After in seconds (a 429 or 503), if it said one.
        self.retry_after: float | None = None
        #: Requests ``d.http`` began during the call.
        self.requests = 0

    def note_state(self) -> None:
        """Keep what ``d.http`` noted of the call, read in the context (thread or task) that ran it."""
        self.http_status = last_response_status()
        self.retry_after = last_retry_after()
        self.requests = requests_begun()


class _CallThread:
    """Runs the handler calls of one worker thread, so that the worker can stop waiting for a
    call at its deadline: httpx's timeouts are per phase (and DNS has none), and Dramatiq's time
    limit cannot interrupt a blocking read. A thread whose call was abandoned ends after it."""

    def __init__(self) -> None:
        #: The deliveries (and HTTP clients) of this thread's calls: they end with the thread.
        self.deliveries = Deliveries()
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="outbox-call", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[Any], Any], arg: Any, *, start_by: float, end_by: float) -> _Call | None:
        """The finished call, or None when it ran past ``end_by`` (this thread is then done).

        Both bounds are instants of this process's monotonic clock: the call is not started
        after ``start_by``, and ``Delivery.http`` sends no request after ``end_by``."""
        call = _Call(fn, arg, start_by, end_by)
        self._calls.put(call)
        if call.done.wait(max(0.0, end_by - time.monotonic())):
            return call
        self._calls.put(None)
        if not call.done.is_set() and self._thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread.ident), ctypes.py_object(_Abandoned)
            )
        return None

    def stop(self) -> None:
        self._calls.put(None)

    def _main(self) -> None:
        try:
            while (call := self._calls.get()) is not None:
                if time.monotonic() > call.start_by:
                    call.error = _NotStarted()
                    call.done.set()
                    continue
                set_send_bound(call.end_by)
                try:
                    call.result = call.fn(call.arg)
                except BaseException as exc:
                    call.error = exc
                finally:
                    call.note_state()
                    set_send_bound(None)
                call.done.set()
        except _Abandoned:
            pass  # delivered between two calls: this thread was ending anyway
        try:
            self.deliveries.close()
        except _Abandoned:
            self.deliveries.close()


def _run_async(fn: Callable[[Any], Any], arg: Any, *, start_by: float, end_by: float) -> _Call | None:
    """An ``async def`` handler's call, as a task on the process's event loop (outbox.aio); the
    calling thread waits for it. The finished call, or None when it ran past ``end_by``: its task
    is then cancelled, which stops it at its next ``await`` (a request not sent is not sent)."""
    call = _Call(fn, arg, start_by, end_by)
    future = aio.submit(_task(call))
    try:
        future.result(max(0.0, end_by - time.monotonic()))
    except concurrent.futures.TimeoutError:
        if future.cancel() or not future.done():
            return None
    return call


async def _task(call: _Call) -> None:
    if time.monotonic() > call.start_by:
        call.error = _NotStarted()
        return
    # In this task's context: the send bound and the statuses are this call's alone.
    set_send_bound(call.end_by)
    try:
        call.result = await call.fn(call.arg)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        call.error = exc
    finally:
        call.note_state()


class _CallAsked:
    """What a delivery run asks of its driver before it goes on: this handler's call for this
    claimed row, bounded from ``sent_at`` (Deliverer._call or Deliverer._call_on_loop), started
    no earlier than ``not_before`` (this process's monotonic clock: the start its paced
    destination booked, outbox.limits)."""

    __slots__ = ("claimed", "handler", "not_before", "sent_at")

    def __init__(
        self, handler: Handler, claimed: store.delivery.Claimed, sent_at: float, not_before: float = 0.0
    ) -> None:
        self.handler = handler
        self.claimed = claimed
        self.sent_at = sent_at
        self.not_before = not_before


class _Pause:
    """What a delivery run asks of its driver when a row lock refused its claim: wait this many
    seconds, holding no connection, then send None to try again. A thread sleeps; a task awaits,
    so locked rows never hold the threads that other deliveries' claims and records need."""

    __slots__ = ("seconds", "wake_on")

    def __init__(self, seconds: float, wake_on: str | None = None) -> None:
        self.seconds = seconds
        #: A destination whose in-flight limit holds this run: a call of it that ends wakes the
        #: run before its pause is over (outbox.wakes).
        self.wake_on = wake_on


class _OffLoop:
    """What a delivery run yields before its first statement when it was handed a row already
    claimed (a group's): a driver that ran it so far on the event loop, to skip a hop to a
    thread for a pre-flight that needs no database, moves it to a thread; others send None."""

    __slots__ = ()


_OFF_LOOP = _OffLoop()


class LostClaim:
    """A group claim whose reply was lost, or could not be read back after its commit: the
    row's own claim (``token``) may have committed, or may still, so it is fenced first (as a
    single claim's lost reply is)."""

    __slots__ = ("token",)

    def __init__(self, token: uuid.UUID) -> None:
        self.token = token


#: What a group claim decided for one row (Deliverer.claim_group): claimed (the handler, the
#: row, when the group's claim was sent), finished without a call (aged to unknown), or its
#: reply lost.
Taken: TypeAlias = "tuple[Handler, store.delivery.Claimed, float] | DeliveryResult | LostClaim"

#: A delivery run (Deliverer._steps): yields the call it needs (or a pause), is sent the call's
#: decision and the provider's last HTTP status (or None after a pause), returns the run's result.
_Steps = Generator[
    "_CallAsked | _Pause | _OffLoop", "tuple[Decision | _NotCalled, int | None] | None", "DeliveryResult"
]
#: Runs a blocking function on a thread and awaits its result (the worker's claim and record
#: threads: outbox.runner).
InThread = Callable[..., Awaitable[Any]]


class _Pool:
    """A fixed number of connections of one kind, shared by every thread of a worker. A thread
    takes one for its statements and gives it back before it calls a provider: the calls in
    flight cost threads (or tasks), not connections."""

    def __init__(self, size: int) -> None:
        self.size = size
        #: Connections not taken, the most recently given back last (taken first: warm).
        self.idle: list[psycopg.Connection[Any]] = []
        self._open = 0
        self._cond = threading.Condition()

    def take(self, opener: Callable[[], psycopg.Connection[Any]]) -> psycopg.Connection[Any]:
        with self._cond:
            while True:
                while self.idle:
                    conn = self.idle.pop()
                    if not conn.closed:
                        return conn
                    self._open -= 1
                if self._open < self.size:
                    self._open += 1
                    break
                self._cond.wait()
        try:
            return opener()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def give(self, conn: psycopg.Connection[Any]) -> None:
        with self._cond:
            if conn.closed:
                self._open -= 1
            else:
                self.idle.append(conn)
            self._cond.notify()

    def discard(self, conn: psycopg.Connection[Any]) -> None:
        conn.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def close_idle(self) -> None:
        """Close the connections not taken: after the database did not answer, any of them may
        be dead without knowing it yet, and the first statement on it would be lost."""
        with self._cond:
            idle, self.idle = self.idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()


class _LockWait:
    """The pauses of one statement that a row lock keeps refusing; says so once it has waited
    :data:`LOCK_WAIT_WARN_SECONDS`."""

    __slots__ = ("delay", "row_id", "since", "warned")

    def __init__(self, row_id: int) -> None:
        self.row_id = row_id
        self.since = time.monotonic()
        self.delay = LOCK_RETRY_SECONDS[0]
        self.warned = False

    def next_pause(self, destination: str | None, what: str) -> float:
        """Seconds to wait before the next try (warning once, past the threshold)."""
        waited = time.monotonic() - self.since
        if not self.warned and waited >= LOCK_WAIT_WARN_SECONDS:
            self.warned = True
            logger.warning(
                "outbox row %s: its %s has waited %.0f s for a row lock held by another transaction "
                "(look for a long transaction on outbox_message in pg_stat_activity); still trying",
                self.row_id,
                what,
                waited,
                extra={"outbox_id": self.row_id, "destination": destination},
            )
        delay = self.delay
        self.delay = min(self.delay * 2, LOCK_RETRY_SECONDS[1])
        return delay


def _limits_text(in_flight: int | None, per_second: float | None) -> str:
    parts = [
        f"{in_flight} calls in flight" if in_flight is not None else "",
        f"{per_second:g} calls/s" if per_second else "",
    ]
    return " and ".join(p for p in parts if p) or "its limits"


class _Hold:
    """The pauses of one claim its destination's limits keep refusing: doubling, and never shorter
    than the wait until a paced destination's next start can be booked; given up after
    :data:`HOLD_MAX_SECONDS` (the message is then acked, the row left `dispatched`)."""

    __slots__ = ("delay", "destination", "limits", "row_id", "since")

    def __init__(self, row_id: int, destination: str, limits: str) -> None:
        self.row_id = row_id
        self.destination = destination
        self.limits = limits
        self.since = time.monotonic()
        self.delay = HOLD_RETRY_SECONDS[0]
        logger.debug(
            "outbox row %s held: destination %s is at its limit (%s)",
            row_id,
            destination,
            limits,
            extra={"outbox_id": row_id, "destination": destination, "outbox_run": "held"},
        )

    def next_pause(self, at_least: float = 0.0) -> float | None:
        """The pause before the next try, or None: give the message up. ``at_least``: seconds
        until the limit can let the claim through (a paced destination's booked starts)."""
        if time.monotonic() - self.since >= HOLD_MAX_SECONDS:
            logger.info(
                "outbox row %s not claimed: destination %s stayed at its limit (%s) for "
                "%.0f s; the row waits dispatched for its re-dispatch",
                self.row_id,
                self.destination,
                self.limits,
                HOLD_MAX_SECONDS,
                extra={"outbox_id": self.row_id, "destination": self.destination, "outbox_run": "held"},
            )
            return None
        # Jittered, so that the deliveries a limit holds do not all try again at one instant;
        # never past the end of the hold (a slow rate's next start may be minutes away).
        left = HOLD_MAX_SECONDS - (time.monotonic() - self.since)
        delay = min(max(self.delay, at_least) * random.uniform(0.8, 1.2), max(left, 0.01))
        self.delay = min(self.delay * 2, HOLD_RETRY_SECONDS[1])
        return delay


class _LeaveForNewer(_NotCalled):
    """Pre-flight: the payload is newer than this handler; left for a newer release's worker."""

    __slots__ = ()


class _Settle:
    """Pre-flight: no call; the row is settled by ``decision`` (and ``move``, where it goes other
    than by the handler's policy)."""

    __slots__ = ("decision", "move")

    def __init__(self, decision: Decision, move: Move | None = None) -> None:
        self.decision = decision
        self.move = move


class _Verdict:
    """Where the run's outcome moves the row (Deliverer._verdict)."""

    __slots__ = ("health", "move", "plan", "refund")

    def __init__(self, health: policy.Health, refund: bool, move: Move, plan: chains.Plan) -> None:
        self.health = health
        self.refund = refund
        self.move = move
        self.plan = plan


def preflight(
    handler: Handler, claimed: store.delivery.Claimed, *, held_seconds: float
) -> _NotCalled | _Settle | None:
    """What a claimed row gets before any call, from the row as claimed and the handler alone (no
    I/O): None, a call; a release (the claim took too much of its lease; a payload newer than
    this handler); or a settlement without a call (deadline passed, a key no header can carry,
    a payload the handler's model refuses), failed, or unknown where an earlier call may have
    taken effect (the claim says)."""
    left = handler.lease_seconds - held_seconds
    if left < handler.time_limit + handler.start_margin_seconds:
        return _NotCalled(
            f"released without a call: the claim took {held_seconds:.1f} s (a lock or commit wait), "
            f"leaving {left:.1f} s of its {handler.lease_seconds:g} s lease; a call needs "
            f"{handler.time_limit:g} s + {handler.start_margin_seconds:g} s"
        )
    if claimed.payload_version > handler.payload_version:
        # Also for a handler without a model: it was written for code this worker is not.
        return _LeaveForNewer(
            f"payload version {claimed.payload_version} of {claimed.destination} is newer than this "
            f"handler's ({handler.payload_version}): left for a worker running the newer release"
        )
    invalid: str | None = None
    if isinstance(claimed.payload, payloads.Unreadable):
        # Written by plain SQL; the same row would fail the same way at every claim: final.
        invalid = f"the payload cannot be read: {claimed.payload.reason}"
    elif handler.checks_payloads:
        try:
            handler.prepare(claimed.payload, claimed.payload_version)
        except payloads.PayloadInvalid as exc:
            invalid = str(exc)
    if claimed.deadline_passed:
        decision = Decision(Outcome.FAILED, error="deadline passed before the call")
        if claimed.earlier_call:
            # Not failed: an earlier call (an idempotent destination's ambiguous one, retried)
            # may have charged. No call now; the lookup, or a human, decides.
            why = "deadline passed before the call; an earlier call may have taken effect: the lookup decides"
            return _Settle(decision, Move("unknown", 0.0, why))
        return _Settle(decision)
    if not header_safe(idempotency_key(claimed.key, claimed.step)):
        # Only rows written before `write` refused such keys get here. Failing before the call
        # is certain and clear; the call could only fail to encode its header, and go `unknown`
        # for lookups that cannot name it either.
        return _Settle(
            Decision(
                Outcome.FAILED,
                error=(
                    f"key {claimed.key!r} cannot be sent as an Idempotency-Key header (not printable "
                    "ASCII); no call was made. Write the operation again under an ASCII key"
                ),
            )
        )
    if invalid is not None:
        # No call now, and the same payload would fail the same way: final. Certain only when no
        # earlier call may have charged (a model deployed between an ambiguous call and its
        # retry): else `unknown`, for the lookup, like a deadline passed.
        decision = Decision(Outcome.FAILED, error=f"{invalid}; no call was made")
        if claimed.earlier_call:
            return _Settle(
                decision,
                Move(
                    "unknown",
                    0.0,
                    f"{invalid}; no call was made, but an earlier call may have taken effect: the "
                    "lookup decides",
                ),
            )
        return _Settle(decision, Move("failed", 0.0, decision.error))
    return None


def _sum_runs(counts: Mapping[Any, int], seconds: float) -> None:
    """The INFO line summing a worker's runs of the last ``seconds`` (counted by result and
    destination): ``delivered: sent=… retried=… failed=… in the last 10.0 s``."""
    named: dict[str, int] = dict.fromkeys(_SUM_ALWAYS, 0)
    by_destination: dict[str, int] = {}
    for (result, destination), n in counts.items():
        name = _SUM_NAMES.get(result, result)
        named[name] = named.get(name, 0) + n
        by_destination[destination] = by_destination.get(destination, 0) + n
    fields = {name: named[name] for name in _SUM_NAMES.values() if name in named}
    fields.update((name, n) for name, n in named.items() if name not in fields)
    logger.info(
        "delivered: %s in the last %.1f s",
        " ".join(f"{name}={n}" for name, n in fields.items()),
        seconds,
        extra={
            **fields,
            "runs": sum(fields.values()),
            "seconds": round(seconds, 1),
            "by_destination": by_destination,
            "_shown": ("seconds",),
        },
    )


class Deliverer:
    """Runs deliveries for the handlers of one deploy; one instance is shared by all threads.
    (Not ``Consumer``: Dramatiq has its own, which fetches the messages this one is given.)

    Claims and records go through two small pools of connections shared by the threads: claims
    (synchronous commit: the claim must survive a database crash before the call starts) and
    records (asynchronous commit). A thread holds a connection around its statements only, never
    across the provider's call, so ``concurrency`` calls in flight need no more connections than
    the pools hold. Each thread that runs sync handlers has one helper thread for its calls;
    async handlers' calls are tasks on the process's event loop (outbox.aio).
    """

    def __init__(
        self,
        database_url: str,
        handlers: Mapping[str, Handler],
        *,
        failover_guard: FailoverGuard | None = None,
        concurrency: int = DEFAULT_ASYNC_POOL_SIZE,
        claim_connections: int = DEFAULT_WORKER_CLAIM_CONNECTIONS,
        record_connections: int = DEFAULT_WORKER_RECORD_CONNECTIONS,
        pooled: bool = False,
    ) -> None:
        self.database_url = database_url
        #: ``database_url`` leads to a pooler in transaction mode: no startup options, no
        #: prepared statements, and any error of a claim counts as a lost reply (the pooler may
        #: have sent it on, or may still).
        self.pooled = pooled
        #: The async handlers' clients, one per destination for the whole process (they belong
        #: to its one event loop), each with a pool for every call that may run at once.
        self.async_deliveries = Deliveries(pool_size=max(concurrency, DEFAULT_ASYNC_POOL_SIZE))
        #: Read before every claim (an attribute, no I/O); set by the worker.
        self.failover_guard = failover_guard
        #: Set when the worker stops: a delivery its destination's in-flight limit holds gives its
        #: message up at once (the row waits `dispatched` for the re-dispatch) instead of waiting.
        self.stopping = threading.Event()
        #: Whether the in-flight limits this process's handlers declare are still on record (its
        #: heartbeat's last beat is recent): a claim of such a destination waits while they are
        #: not, or the database would stop counting the declaration (outbox.limits).
        self.declarations_fresh: Callable[[], bool] | None = None
        #: Set by the worker: held deliveries wait on it, and the record of a call of a
        #: destination in ``in_flight_limited()`` (its heartbeat's last read) publishes the end
        #: of the call (outbox.wakes).
        self.wakes: Wakes | None = None
        self.in_flight_limited: Callable[[], frozenset[str]] = frozenset
        self.handlers = dict(handlers)
        self._local = threading.local()
        self._pools = {"claim_conn": _Pool(claim_connections), "record_conn": _Pool(record_connections)}
        self._all: list[psycopg.Connection[Any]] = []
        self._callers: list[_CallThread] = []
        self._all_lock = threading.Lock()
        #: Set when PostgreSQL does not answer: a connection could not be opened, or one broke
        #: under a statement. The worker stops fetching while it is set and hands the messages it
        #: fetched back unclaimed (outbox.runner); :meth:`database_answers` clears it.
        self.database_down = threading.Event()
        #: Every run counted by result and destination, summed up at INFO every
        #: :data:`RUN_LOG_SECONDS` (:class:`outbox.logs.Window`; the worker ticks it); failed,
        #: unknown, released and superseded runs are each a WARNING line of their own too.
        self.runs = logs.Window(_sum_runs, RUN_LOG_SECONDS)

    # -- connections ---------------------------------------------------------------------------

    def _conn(self, name: str) -> psycopg.Connection[Any]:
        """The connection of kind ``name`` this thread holds, taken from its pool if none."""
        conn: psycopg.Connection[Any] | None = getattr(self._local, name, None)
        if conn is not None and not conn.closed:
            return conn
        if conn is not None:
            self._pools[name].discard(conn)
        conn = self._pools[name].take(lambda: self._open(name))
        setattr(self._local, name, conn)
        return conn

    def _open(self, name: str) -> psycopg.Connection[Any]:
        try:
            conn = self._connect(name)
        except psycopg.OperationalError:
            self.database_down.set()
            raise
        tolerate_unloadable(conn)
        with self._all_lock:
            # The closed ones go (dropped, or closed idle while the database did not answer): a
            # worker that reconnected for hours keeps only what it holds.
            self._all = [c for c in self._all if not c.closed]
            self._all.append(conn)
        if name == "claim_conn" and self.failover_guard is not None:
            self.failover_guard.check_now()
        return conn

    def _connect(self, name: str) -> psycopg.Connection[Any]:
        if self.pooled:
            # The delivery statements that take a row lock set their lock wait (and the records
            # their asynchronous commit) inside themselves (store.sql.LOCK_WAIT_SQL).
            conn = connect_raw(self.database_url, autocommit=True, pooled=True)
        else:
            options = f"-c lock_timeout={LOCK_WAIT_MS}"
            if name == "claim_conn":
                # A group claim's plan does not depend on its size: left to choose, the server
                # planned it anew for every small group (about 1 ms of its CPU a time) instead of
                # keeping one plan; the single claims' plans are generic already.
                options += " -c plan_cache_mode=force_generic_plan"
            if name == "record_conn":
                options += " -c synchronous_commit=off"
            conn = connect_raw(self.database_url, autocommit=True, options=options)
        return conn

    def database_answers(self) -> bool:
        """Whether PostgreSQL answers a statement on a claim connection now (clearing
        :attr:`database_down` when it does); the failover guard, which fails closed while it
        cannot check, checks again then too. May wait as long as a connect to an unreachable
        server does (``OUTBOX_TCP_USER_TIMEOUT``). Asked on a new connection: the idle ones are
        closed first (any may have died with the link), so an answer proves the way is open."""
        self._put_back("claim_conn")
        for pool in self._pools.values():
            pool.close_idle()
        try:
            self._conn("claim_conn").execute("SELECT 1")
        except psycopg.OperationalError:
            self._drop("claim_conn")
            self.database_down.set()
            return False
        finally:
            self._put_back("claim_conn")
        guard = self.failover_guard
        if guard is not None and guard.unreachable:
            guard.check_now()
        self.database_down.clear()
        return True

    def _waiting_for_locks(
        self, name: str, row_id: int, statement: Callable[[Any], Any]
    ) -> Generator[_Pause, Any, Any]:
        """``statement`` on a connection of pool ``name``, tried again, the connection given back
        and a pause yielded in between, for as long as a row lock refuses it (:data:`LOCK_WAIT_MS`)."""
        locked = _LockWait(row_id)
        while True:
            try:
                return statement(self._conn(name))
            except psycopg.errors.LockNotAvailable:
                self._put_back(name)
                yield _Pause(locked.next_pause(None, "statement"))

    def _put_back(self, *names: str) -> None:
        """Give the connections this thread holds back to their pools."""
        for name in names:
            conn = getattr(self._local, name, None)
            if conn is not None:
                setattr(self._local, name, None)
                self._pools[name].give(conn)

    def warm_thread(self) -> None:
        """Open the pools' connections (as far as the threads booting at once take them), start
        the calling thread's call thread and make its HTTP clients before its first message: a worker's first
        deliveries otherwise paid for them all at once, its threads contending for one
        interpreter (a few hundred milliseconds after a start). Best effort: a failure is left
        for the first delivery to meet, and report, as it would have."""
        try:
            self._conn("claim_conn")
            self._conn("record_conn")
            self._put_back("claim_conn", "record_conn")
            caller = self._caller()
            # And its HTTP clients, and the IDNA codec every first request of a process imports
            # (10 ms, under the import lock): on a paced destination a call that starts late
            # bunches with the next ones on time.
            for handler in self.handlers.values():
                if not handler.is_async:
                    caller.deliveries.client(handler)
            "localhost".encode("idna")
        except Exception as exc:
            logger.debug(
                "worker thread not warmed up (%s); its first delivery connects",
                type(exc).__name__,
                extra={"error": type(exc).__name__},
            )

    def _drop(self, name: str) -> None:
        """Discard this thread's connection of kind ``name`` after an error; a broken one (the
        server or the link gone) also sets :attr:`database_down`."""
        conn = getattr(self._local, name, None)
        if conn is not None:
            if conn.broken or conn.closed:
                self.database_down.set()
            setattr(self._local, name, None)
            self._pools[name].discard(conn)

    def _caller(self) -> _CallThread:
        caller: _CallThread | None = getattr(self._local, "caller", None)
        if caller is None:
            caller = self._local.caller = _CallThread()
            with self._all_lock:
                self._callers.append(caller)
        return caller

    def close_thread(self) -> None:
        """Give back the calling thread's connections and stop its call thread: for a thread that
        runs no more deliveries (Dramatiq's worker threads live as long as the worker)."""
        self._put_back("claim_conn", "record_conn")
        caller: _CallThread | None = getattr(self._local, "caller", None)
        if caller is not None:
            self._forget_caller(caller)
            caller.stop()

    def _forget_caller(self, caller: _CallThread) -> None:
        """This thread's next call gets a new call thread; ``caller`` is no longer closed here."""
        self._local.caller = None
        with self._all_lock:
            if caller in self._callers:
                self._callers.remove(caller)

    def close(self) -> None:
        """Close every thread's connections (call once the worker threads have stopped)."""
        with self._all_lock:
            conns, self._all = self._all, []
            callers, self._callers = self._callers, []
        for caller in callers:
            caller.stop()
        for conn in conns:
            conn.close()
        self.async_deliveries.close()
        self.runs.flush()

    def _declarations_fresh(self) -> bool:
        fresh = self.declarations_fresh
        return fresh is None or fresh()

    def _halted(self) -> bool:
        if self.failover_guard is None:
            return False
        # Opening the claim connection (after a drop: perhaps to a new server) re-checks the
        # database identity first; otherwise this is an attribute read.
        self._conn("claim_conn")
        return self.failover_guard.halted

    # -- the run -------------------------------------------------------------------------------

    def deliver(self, row_id: int, destination: str, taken: Taken | None = None) -> DeliveryResult:
        """One delivery run on the calling thread, its call included (an async handler's call as
        a task on the process's event loop, this thread waiting for it). ``taken``: what
        :meth:`claim_group` decided for the row (None: the run claims it alone)."""
        observed = metrics.Observed()
        steps = self._steps(row_id, destination, observed, taken)
        try:
            step = next(steps)
            while True:
                if isinstance(step, _OffLoop):
                    step = steps.send(None)
                elif isinstance(step, _Pause):
                    if step.wake_on is not None and self.wakes is not None:
                        self.wakes.wait(step.wake_on, step.seconds)
                    else:
                        time.sleep(step.seconds)
                    step = steps.send(None)
                else:
                    wait = step.not_before - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    step = steps.send(self._call(step.handler, step.claimed, step.sent_at))
        except StopIteration as done:
            result: DeliveryResult = done.value
        finally:
            self._put_back("claim_conn", "record_conn")
        # Counted once the outcome is recorded, and never raising: see metrics.never_raises.
        metrics.count_delivery(destination, result.value, observed)
        self.runs.count((result.value, destination))
        return result

    async def deliver_async(
        self,
        row_id: int,
        destination: str,
        in_thread: InThread,
        after: Callable[[DeliveryResult], None] | None = None,
        taken: Taken | None = None,
    ) -> DeliveryResult:
        """One delivery run as a task of the event loop, for an async handler: the claim and the
        record run on a thread ``in_thread`` gives them (they block on the database), the call
        on the loop itself, so a call in flight holds no thread and no connection. ``after``
        runs on the record's thread once the run is over (the worker's ack: no second hop).
        ``taken``: as for :meth:`deliver`."""
        observed = metrics.Observed()
        steps = self._steps(row_id, destination, observed, taken)
        first: _CallAsked | _Pause | _OffLoop = _OFF_LOOP
        if isinstance(taken, tuple):
            # Claimed by its fetch's group: the pre-flight (no I/O) runs here, on the loop, and
            # a call goes out without a hop to a thread and back; any other move needs one.
            first = steps.send(None)
        step: _CallAsked | _Pause | DeliveryResult
        if isinstance(first, _OffLoop):
            step = await in_thread(self._advance, steps, None, after)
        else:
            step = first
        while not isinstance(step, DeliveryResult):
            if isinstance(step, _Pause):
                if step.wake_on is not None and self.wakes is not None:
                    await self.wakes.wait_async(step.wake_on, step.seconds)
                else:
                    await asyncio.sleep(step.seconds)
                step = await in_thread(self._advance, steps, None, after)
            else:
                wait = step.not_before - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                called = await self._call_on_loop(step.handler, step.claimed, step.sent_at)
                step = await in_thread(self._advance, steps, called, after)
        metrics.count_delivery(destination, step.value, observed)
        self.runs.count((step.value, destination))
        return step

    def _advance(
        self,
        steps: _Steps,
        called: tuple[Decision | _NotCalled, int | None] | None,
        after: Callable[[DeliveryResult], None] | None,
    ) -> _CallAsked | _Pause | DeliveryResult:
        """Run ``steps`` on this thread to the call (or pause) it asks for or to its result, then
        give the thread's connections back: the next step may run on another thread."""
        try:
            step = steps.send(called)
            while isinstance(step, _OffLoop):
                step = steps.send(None)
            return step
        except StopIteration as done:
            result: DeliveryResult = done.value
        finally:
            self._put_back("claim_conn", "record_conn")
        if after is not None:
            after(result)
        return result

    def _steps(
        self, row_id: int, destination: str, observed: metrics.Observed, taken: Taken | None = None
    ) -> _Steps:
        """The delivery run up to its call (the claim and the pre-flight), then, sent the call's
        decision, the rest (the verdict, the record and the aftercare): a generator, so that the
        thread that claims need not be the one that records, nor wait."""
        if taken is None:
            taken = yield from self._take(row_id, destination)
        elif isinstance(taken, LostClaim):
            taken = yield from self._recover_lost_claim(self.handlers[destination], row_id, taken.token)
        if isinstance(taken, DeliveryResult):
            return taken
        handler, claimed, sent_at = taken
        failpoint("after_claim")
        claimed_at = time.monotonic()
        observed.since_published_seconds = claimed.since_published_seconds
        observed.since_written_seconds = claimed.since_written_seconds
        observed.written_to_published_seconds = claimed.written_to_published_seconds
        before = preflight(handler, claimed, held_seconds=claimed_at - sent_at)
        if before is not None:
            yield _OFF_LOOP
        if isinstance(before, _LeaveForNewer):
            return (yield from self._leave_for_newer(handler, claimed, before.reason))
        if isinstance(before, _NotCalled):
            return (yield from self._release(handler, claimed.id, claimed.token, before.reason))
        if isinstance(before, _Settle):
            decision, chosen = before.decision, before.move
        else:
            # Not held across the call: another delivery's claim or record may use them meanwhile.
            self._put_back("claim_conn", "record_conn")
            # A paced destination's start, counted from here: after the claim's reply came, so
            # never before the start the database booked.
            not_before = claimed_at + claimed.pace_seconds
            answer = yield _CallAsked(handler, claimed, sent_at, not_before)
            assert answer is not None  # a call is answered with its outcome
            called, http_status = answer
            if isinstance(called, _NotCalled):
                return (yield from self._release(handler, claimed.id, claimed.token, called.reason))
            decision, chosen = called, None
            observed.called = True
            observed.http_status = http_status
            observed.call_seconds = time.monotonic() - max(claimed_at, not_before)
        failpoint("after_call")
        verdict = self._verdict(handler, claimed, decision, chosen, observed)
        recorded = yield from self._record(
            claimed,
            decision,
            verdict.move,
            policy.deadline_error(claimed.deadline, verdict.move.error),
            refund=verdict.refund,
            follow=verdict.plan,
        )
        failpoint("after_record")
        return self._aftercare(handler, claimed, decision, verdict, recorded, observed)

    def claim_group(self, row_ids: Sequence[int], destination: str) -> dict[int, Taken]:
        """Claim the rows of one fetch in one statement and one commit (store.delivery.claim_group),
        on the calling thread: what was decided for each row (:data:`Taken`), by id, for its
        delivery to go on from. A row left out is claimed by its delivery alone: the group did not
        claim it, or there was no group (fewer than two rows, no handler, halted after a failover,
        a row lock that made the statement wait too long, an error the server reported, which
        rolled it back). A lost reply is every row's: each delivery fences its own token first.

        Every row's lease is measured from when the group's claim was sent, on this clock."""
        handler = self.handlers.get(destination)
        ids = list(dict.fromkeys(row_ids))
        if handler is None or len(ids) < 2:
            return {}
        tokens = {row_id: uuid.uuid4() for row_id in ids}
        sent = False
        try:
            if self._halted():
                return {}
            conn = self._conn("claim_conn")
            sent_at = time.monotonic()
            sent = True
            claimed = store.delivery.claim_group(
                conn,
                tokens=tokens,
                destination=destination,
                lease_seconds=handler.lease_seconds,
                key_ttl=handler.key_ttl if handler.idempotent else None,
                skip_when_failed=handler.on_failed_head == "skip",
                pace_ahead_seconds=handler.pace_ahead_seconds,
            )
        except psycopg.errors.LockNotAvailable:
            # Rolled back: each row waits for its lock in its own delivery, without a connection.
            return {}
        except psycopg.OperationalError:
            lost = sent and (self.pooled or self._broken("claim_conn"))
            self._drop("claim_conn")
            if lost:
                return {row_id: LostClaim(token) for row_id, token in tokens.items()}
            return {}
        except Exception as exc:
            # An error the server reported (it has an SQLSTATE) rolled the statement back: the rows'
            # own claims meet it again, one by one. Any other came after the commit, reading the
            # rows back (a value this process cannot load: a deadline of 'infinity', a payload
            # nested too deep for its JSON parser, written by plain SQL): every row is claimed,
            # and claimed alone none would be; each fences its own token and is released.
            committed = sent and not (isinstance(exc, psycopg.Error) and exc.sqlstate)
            logger.warning(
                "a group claim of %s rows of %s failed (%s); %s",
                len(ids),
                destination,
                type(exc).__name__,
                "each row is released without a call" if committed else "each row is claimed alone",
                extra={"destination": destination, "error": type(exc).__name__},
            )
            if committed:
                return {row_id: LostClaim(token) for row_id, token in tokens.items()}
            return {}
        finally:
            self._put_back("claim_conn")
        taken: dict[int, Taken] = {}
        for row_id, got in claimed.items():
            if isinstance(got, store.delivery.Aged):
                logger.warning(
                    "outbox row %s -> unknown: %s",
                    row_id,
                    got.error,
                    extra={"outbox_id": row_id, "destination": destination, "outbox_run": "unknown"},
                )
                taken[row_id] = DeliveryResult.UNKNOWN
            else:
                taken[row_id] = (handler, got, sent_at)
        return taken

    def _broken(self, name: str) -> bool:
        conn: psycopg.Connection[Any] | None = getattr(self._local, name, None)
        return conn is None or conn.broken or conn.closed

    def _take(
        self, row_id: int, destination: str
    ) -> Generator[_Pause, Any, tuple[Handler, store.delivery.Claimed, float] | DeliveryResult]:
        """The claim: the handler, the claimed row and when the claim was sent (this process's
        monotonic clock); or the run's result when there is nothing to call (halted after a
        failover, no handler, the claim's reply lost, the row aged, paused or not claimable)."""
        try:
            halted = self._halted()
        except psycopg.OperationalError:
            return DeliveryResult.UNREACHABLE
        if halted and self.failover_guard is not None and self.failover_guard.unreachable:
            # The guard could not check (it fails closed): not another history, no answer.
            self.database_down.set()
            return DeliveryResult.UNREACHABLE
        if halted:
            # Nothing claimed, nothing written: the row stays `dispatched`, and the reconciler
            # re-queues it once an operator accepted the new database history.
            logger.warning(
                "outbox row %s not claimed: stopped after a database failover",
                row_id,
                extra={"outbox_id": row_id, "destination": destination, "outbox_run": "halted"},
            )
            return DeliveryResult.HALTED
        handler = self.handlers.get(destination)
        if handler is None:
            reason = f"no handler for destination {destination!r} in this deploy"
            yield from self._waiting_for_locks(
                "claim_conn",
                row_id,
                lambda conn: store.delivery.fail_unhandled(conn, row_id=row_id, error=reason),
            )
            logger.error(
                "outbox row %s failed: %s",
                row_id,
                reason,
                extra={"outbox_id": row_id, "destination": destination},
            )
            return DeliveryResult.UNHANDLED
        locked = _LockWait(row_id)
        held: _Hold | None = None
        while True:
            if handler.declares_limits and not self._declarations_fresh():
                held = held or _Hold(
                    row_id, destination, _limits_text(handler.max_in_flight, handler.max_calls_per_second)
                )
                delay = held.next_pause()
                if delay is None or self.stopping.is_set():
                    return DeliveryResult.HELD
                yield _Pause(delay)
                continue
            try:
                conn = self._conn("claim_conn")
            except psycopg.OperationalError:
                # Not connected, nothing sent: certainly not claimed.
                return DeliveryResult.UNREACHABLE
            token = uuid.uuid4()
            # The lease is measured on this clock from here, before the claim is sent: a wait
            # for a row lock or for the commit only shortens what is left, whatever the clocks say.
            sent_at = time.monotonic()
            try:
                claimed = store.delivery.claim(
                    conn,
                    row_id=row_id,
                    destination=destination,
                    lease_seconds=handler.lease_seconds,
                    token=token,
                    key_ttl=handler.key_ttl if handler.idempotent else None,
                    skip_when_failed=handler.on_failed_head == "skip",
                    pace_ahead_seconds=handler.pace_ahead_seconds,
                )
            except psycopg.errors.LockNotAvailable:
                # The server refused the wait: the claim rolled back. Wait without the connection
                # (and, for a task, without the thread).
                self._put_back("claim_conn")
                yield _Pause(locked.next_pause(destination, "claim"))
                continue
            except psycopg.OperationalError:
                # A broken connection may have lost the reply to a committed claim; on a live one
                # the server reported the error, so the statement rolled back. Not through a
                # pooler: the error may be the pooler's, about a claim it sent on or still holds.
                lost = conn.broken or conn.closed or self.pooled
                self._drop("claim_conn")
                if not lost:
                    raise
                return (yield from self._recover_lost_claim(handler, row_id, token))
            if claimed is not None:
                break
            limit = store.delivery.held_by_limit(conn, row_id=row_id, destination=destination, token=token)
            if limit is None:
                break
            held = held or _Hold(row_id, destination, _limits_text(limit.in_flight, limit.per_second))
            delay = held.next_pause(
                limits.rebook_seconds(limit.booked_ahead_seconds, handler.pace_ahead_seconds)
            )
            if delay is None or self.stopping.is_set():
                return DeliveryResult.HELD
            self._put_back("claim_conn")
            # Held by the calls in flight: the end of one (in any process) wakes it; a paced
            # start is a time, waited out.
            yield _Pause(delay, wake_on=destination if limit.in_flight is not None else None)
        if isinstance(claimed, store.delivery.Aged):
            logger.warning(
                "outbox row %s -> unknown: %s",
                row_id,
                claimed.error,
                extra={"outbox_id": row_id, "destination": destination, "outbox_run": "unknown"},
            )
            return DeliveryResult.UNKNOWN
        if claimed is None:
            held_back = pauses.held_reason(conn, destination=destination)
            if held_back is not None:
                # Acked without a claim: the row waits `dispatched`, attempts untouched, and the
                # reconciler re-queues it once the pause ends or the breaker closes.
                logger.info(
                    "outbox row %s not claimed: destination %s %s",
                    row_id,
                    destination,
                    held_back,
                    extra={"outbox_id": row_id, "destination": destination, "outbox_run": "paused"},
                )
                return DeliveryResult.PAUSED
            logger.info(
                "outbox row %s: nothing to claim (already claimed, settled or not due)",
                row_id,
                extra={"outbox_id": row_id, "destination": destination, "outbox_run": "empty"},
            )
            return DeliveryResult.EMPTY
        return handler, claimed, sent_at

    def _verdict(
        self,
        handler: Handler,
        claimed: store.delivery.Claimed,
        decision: Decision,
        chosen: Move | None,
        observed: metrics.Observed,
    ) -> _Verdict:
        """Where the outcome moves the row: the provider's health it showed, whether a probe's
        attempt is refunded, the move, and the next steps the record writes."""
        health = policy.health(
            called=observed.called,
            outcome=decision.outcome.value,
            not_processed=decision.not_processed,
            http_status=decision.http_status if decision.http_status is not None else observed.http_status,
        )
        # A probe that found the provider still down is not counted against its row: the row
        # only carried the breaker's question (outbox.breaker); up to max_attempts times a row.
        refund = claimed.probe and handler.breaker is not None and health is policy.Health.NOT_PROCESSED
        if refund:
            refund = self._refundable(handler, claimed)
        if refund:
            wait = max(handler.backoff_seconds(1), decision.retry_after_seconds or 0.0)
            chosen = Move(
                "pending", wait, f"{decision.error} (the breaker's probe: not counted as an attempt)"
            )
        move = chosen or next_state(handler, decision, attempt=claimed.attempt)
        return _Verdict(health, refund, move, self._plan(handler, claimed, decision, move))

    def _aftercare(
        self,
        handler: Handler,
        claimed: store.delivery.Claimed,
        decision: Decision,
        verdict: _Verdict,
        recorded: store.delivery.Recorded,
        observed: metrics.Observed,
    ) -> DeliveryResult:
        """After the record: its chain problem reported, the destination's Retry-After hold and
        its breaker, the run's one log line."""
        destination = handler.destination
        state = recorded.state
        if recorded.chain_problem:
            logger.error(
                "outbox %s:%s: next steps not all written: %s",
                claimed.key,
                claimed.step,
                recorded.chain_problem,
                extra={
                    "outbox_id": claimed.id,
                    "key": claimed.key,
                    "step": claimed.step,
                    "destination": destination,
                },
            )
        if decision.retry_after_seconds and handler.retry_after_scope == "destination":
            self._hold(handler, decision)
        self._breaker(handler, claimed, verdict.health, decision, called=observed.called)
        result = DeliveryResult(state) if state is not None else DeliveryResult.SUPERSEDED
        nxt = verdict.move
        # The record fails a retry that would fall past the deadline (decided on the database's clock).
        past_deadline = state == "failed" and nxt.state == "pending"
        error = policy.deadline_error(claimed.deadline, nxt.error) if past_deadline else nxt.error
        # Sent and pending are the stream (the sum line counts them); the others are the audit trail.
        level = logging.DEBUG if result in _STREAM else logging.WARNING
        if not logger.isEnabledFor(level):
            return result
        logger.log(
            level,
            "outbox %s:%s -> %s (attempt %s)%s",
            claimed.key,
            claimed.step,
            result.value,
            claimed.attempt,
            # The provider's text, bounded: the row keeps a longer copy for `outbox show`.
            f": {logs.provider_text(error)}" if error else "",
            extra={
                "outbox_id": claimed.id,
                "key": claimed.key,
                "step": claimed.step,
                "destination": destination,
                "attempt": claimed.attempt,
                "outbox_run": result.value,
                "provider_ref": decision.ref,
                "_shown": _RUN_SHOWN,
            },
        )
        return result

    def _plan(
        self, handler: Handler, claimed: store.delivery.Claimed, decision: Decision, nxt: Move
    ) -> chains.Plan:
        """The next steps the record writes (outbox.chains): the ``then`` steps of a confirmed
        call; the ``on_failure`` steps of a certain failure, also of a retry that the record may
        fail for its deadline (the record decides, on the database's clock)."""
        if decision.outcome is Outcome.SENT:
            if handler.then_fn is None or not decision.ref:
                return chains.NO_NEXT_STEPS
            # As the record stores it: the same answer a lookup or an operator's path gives.
            confirmed = chains.as_stored(Confirmed(decision.ref, decision.response))
            return chains.then_plan(handler, self._delivery(handler, claimed), confirmed)
        if handler.on_failure_fn is None or decision.outcome is Outcome.UNKNOWN:
            return chains.NO_NEXT_STEPS
        if nxt.state == "failed" or (nxt.state == "pending" and claimed.deadline is not None):
            return chains.failure_plan(handler, self._delivery(handler, claimed, strict=False), nxt.error)
        return chains.NO_NEXT_STEPS

    def _delivery(
        self, handler: Handler, claimed: store.delivery.Claimed, *, strict: bool = True
    ) -> Delivery:
        return delivery_for(claimed, handler, self._caller().deliveries, strict=strict)

    def _call(
        self, handler: Handler, claimed: store.delivery.Claimed, sent_at: float
    ) -> tuple[Decision | _NotCalled, int | None]:
        """The call on this thread (an async handler's as a task this thread waits for): its
        decision, or why it was not a call; and the provider's last HTTP status in it, for the
        metrics (None: no answer).

        Why it may not be a call: the start check passed, but a pause since (SIGSTOP, a VM
        stall, a starved thread) took the process past the last instant a call may start, so
        its lease may already be running out; or its only request waited for a connection of
        the client's pool past the pool timeout, so nothing was sent.

        Both bounds count from ``sent_at`` (when the claim was sent) on this process's monotonic
        clock, like the start check: the call starts no later than ``time_limit`` plus the start
        margin before the lease ends, and is given up (and ``d.http`` sends nothing more) at its
        deadline or half the start margin before the lease ends, whichever comes first."""
        asynchronous = handler.is_async
        caller = None if asynchronous else self._caller()
        deliveries = self.async_deliveries if caller is None else caller.deliveries
        bounded = self._bounded(handler, claimed, sent_at, deliveries)
        if isinstance(bounded, _NotCalled):
            return bounded, None
        fn, delivery, start_by, end_by = bounded
        if caller is None:
            try:
                call = _run_async(fn, delivery, start_by=start_by, end_by=end_by)
            finally:
                deliveries.give_back(delivery.http)
        else:
            call = caller.run(fn, delivery, start_by=start_by, end_by=end_by)
            if call is None:
                # Abandoned: that thread ends after it; this thread's next call gets another.
                self._forget_caller(caller)
        return self._called(handler, call, sent_at)

    async def _call_on_loop(
        self, handler: Handler, claimed: store.delivery.Claimed, sent_at: float
    ) -> tuple[Decision | _NotCalled, int | None]:
        """:meth:`_call` for an async handler, awaited on the event loop: no thread waits."""
        deliveries = self.async_deliveries
        bounded = self._bounded(handler, claimed, sent_at, deliveries)
        if isinstance(bounded, _NotCalled):
            return bounded, None
        fn, delivery, start_by, end_by = bounded
        running = _Call(fn, delivery, start_by, end_by)
        task = asyncio.ensure_future(_task(running))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, end_by - time.monotonic()))
        finally:
            deliveries.give_back(delivery.http)
        if not done or task.cancelled():
            # Stops it at its next await (a request not sent is not sent).
            task.cancel()
            return self._called(handler, None, sent_at)
        # _task keeps the handler's exception in the call; anything else is ours: raise it.
        task.result()
        return self._called(handler, running, sent_at)

    def _bounded(
        self, handler: Handler, claimed: store.delivery.Claimed, sent_at: float, deliveries: Deliveries
    ) -> tuple[Callable[[Any], Any], Delivery, float, float] | _NotCalled:
        """The function to call, its argument, and the instants it may start by and must end by;
        or, past the start bound already, why it is not a call."""
        delivery = delivery_for(claimed, handler, deliveries, asynchronous=handler.is_async)
        start_by = sent_at + handler.lease_seconds - handler.time_limit - handler.start_margin_seconds
        now = time.monotonic()
        if now > start_by:
            if handler.is_async:
                deliveries.give_back(delivery.http)
            return self._not_started(handler, sent_at)
        end_by = min(
            now + handler.call_deadline_seconds,
            sent_at + handler.lease_seconds - handler.start_margin_seconds / 2,
        )
        fn: Callable[[Any], Any] = handler.fn if handler.is_async else handler
        if tracing.active():
            fn = tracing.in_span(
                fn,
                trace_context=claimed.trace_context,
                destination=handler.destination,
                row_id=claimed.id,
                key=claimed.key,
                step=claimed.step,
                attempt=claimed.attempt,
            )
        return fn, delivery, start_by, end_by

    def _called(
        self, handler: Handler, call: _Call | None, sent_at: float
    ) -> tuple[Decision | _NotCalled, int | None]:
        """What a finished call (None: abandoned at its end bound) decides."""
        if call is None:
            # Its late result, if any, is ignored: the outcome is recorded now, inside the lease.
            return Decision(
                Outcome.UNKNOWN,
                error=f"the handler hit its time limit ({handler.time_limit:g} s); the call was "
                "abandoned and may have taken effect",
            ), None
        if isinstance(call.error, _NotStarted):
            return self._not_started(handler, sent_at), call.http_status
        if isinstance(call.error, httpx.PoolTimeout) and call.requests <= 1 and call.http_status is None:
            # Its only request never left the pool: nothing reached the provider, and the wait
            # was ours, not the provider's; no attempt, no breaker count.
            return _NotCalled(
                "released without a call: no connection of the provider client's pool came free "
                f"within its pool timeout ({handler.timeouts().pool:g} s); no request was sent"
            ), None
        if call.error is not None:
            decision = decide_exception(
                handler, call.error, last_status=call.http_status, last_retry_after=call.retry_after
            )
            return decision, call.http_status
        return decide_result(call.result), call.http_status

    @staticmethod
    def _not_started(handler: Handler, sent_at: float) -> _NotCalled:
        return _NotCalled(
            "released without a call: the worker reached the call after its start bound "
            f"(the process was paused or starved; {time.monotonic() - sent_at:.1f} s since "
            f"the claim was sent, lease {handler.lease_seconds:g} s)"
        )

    def _refundable(self, handler: Handler, claimed: store.delivery.Claimed) -> bool:
        try:
            carried = breaker.refunds_so_far(
                self._conn("record_conn"), row_id=claimed.id, attempts=claimed.attempt
            )
        except psycopg.Error:
            self._drop("record_conn")
            return False  # counted: the safe side of a bound
        return carried < handler.max_attempts

    def _breaker(
        self,
        handler: Handler,
        claimed: store.delivery.Claimed,
        health: policy.Health,
        decision: Decision,
        *,
        called: bool,
    ) -> None:
        """Tell the destination's breaker what this delivery says about the provider. After the
        record, and never at its expense: a failure here loses one count (or leaves a probe to
        its lease's end), never an outcome."""
        destination = handler.destination
        extra = {"destination": destination, "outbox_id": claimed.id}
        reason = f"{decision.error or decision.outcome.value} (row {claimed.id})"
        try:
            conn = self._conn("record_conn")
            if claimed.probe and handler.breaker is None:
                # A deploy turned the breaker off while it was open: nothing else would close it.
                if breaker.close(conn, destination):
                    logger.warning("breaker of %s closed: no breaker declared", destination, extra=extra)
            elif claimed.probe and not called:
                breaker.free_probe(conn, destination, token=claimed.token)
            elif claimed.probe and handler.breaker is not None:
                settled = breaker.settle_probe(
                    conn, destination, handler.breaker, token=claimed.token, health=health, reason=reason
                )
                if settled is not None and settled.closed:
                    logger.warning(
                        "breaker of %s closed: the probe (row %s) was processed",
                        destination,
                        claimed.id,
                        extra={**extra, "outbox_run": "breaker_closed"},
                    )
                elif settled is not None:
                    logger.warning(
                        "breaker of %s open again for %g s: the probe (row %s) %s",
                        destination,
                        settled.open_seconds or 0.0,
                        claimed.id,
                        "was not processed" if health is policy.Health.NOT_PROCESSED else "proved nothing",
                        extra={**extra, "outbox_run": "breaker_open"},
                    )
            elif handler.breaker is not None and health is policy.Health.NOT_PROCESSED:
                if breaker.count_not_processed(conn, destination, handler.breaker, reason=reason):
                    logger.error(
                        "breaker of %s tripped after %s consecutive calls not processed within %g s "
                        "(latest: %s); its rows wait without spending attempts, a probe in %g s",
                        destination,
                        handler.breaker.failures,
                        handler.breaker.window_seconds,
                        logs.provider_text(reason),
                        handler.breaker.open_seconds,
                        extra={**extra, "outbox_run": "breaker_tripped"},
                    )
            elif health is policy.Health.PROCESSED and claimed.breaker_failures > 0:
                breaker.reset(conn, destination)
        except psycopg.Error as exc:
            self._drop("record_conn")
            logger.warning("breaker of %s not updated (%s)", destination, type(exc).__name__, extra=extra)

    def _hold(self, handler: Handler, decision: Decision) -> None:
        """The provider's Retry-After speaks for every request (``retry_after_scope=
        "destination"``): pause the destination that long. After the record, and never at its
        expense: a failure here only loses the hold (each row still waits its own Retry-After)."""
        seconds = float(decision.retry_after_seconds or 0.0)
        reason = (
            f"the provider answered HTTP {decision.http_status or '429/503'} with Retry-After "
            f"{seconds:g} s (retry_after_scope='destination')"
        )
        try:
            held = pauses.hold(
                self._conn("record_conn"),
                handler.destination,
                seconds=seconds,
                by=f"worker {socket.gethostname()}:{os.getpid()}",
                reason=reason,
            )
        except psycopg.Error as exc:
            self._drop("record_conn")
            logger.warning(
                "destination %s not paused for its Retry-After (%s)",
                handler.destination,
                type(exc).__name__,
                extra={"destination": handler.destination},
            )
            return
        if held:
            logger.warning(
                "destination %s paused for %g s: %s",
                handler.destination,
                seconds,
                reason,
                extra={"destination": handler.destination, "outbox_run": "held"},
            )

    def _leave_for_newer(
        self, handler: Handler, claimed: store.delivery.Claimed, reason: str
    ) -> Generator[_Pause, Any, DeliveryResult]:
        """A payload newer than this worker's handler (new writers deployed before the workers):
        released, no attempt spent, due again in a while for a newer worker."""
        released = yield from self._waiting_for_locks(
            "claim_conn",
            claimed.id,
            lambda conn: store.delivery.release(
                conn,
                row_id=claimed.id,
                token=claimed.token,
                reason=reason,
                retry_after_seconds=payloads.NEWER_PAYLOAD_RETRY_SECONDS,
            ),
        )
        if released is None:
            return DeliveryResult.EMPTY
        late = released.waited_seconds >= payloads.NEWER_PAYLOAD_ALERT_AFTER_SECONDS
        (logger.error if late else logger.info)(
            "outbox %s:%s released for a newer worker%s: %s",
            claimed.key,
            claimed.step,
            f" (written {released.waited_seconds / 60:.0f} min ago: is the new release deployed?)"
            if late
            else "",
            reason,
            extra={
                "outbox_id": claimed.id,
                "key": claimed.key,
                "step": claimed.step,
                "destination": handler.destination,
                "outbox_run": "released",
                "payload_version": claimed.payload_version,
            },
        )
        return DeliveryResult.RELEASED

    def _release(
        self, handler: Handler, row_id: int, token: uuid.UUID, reason: str
    ) -> Generator[_Pause, Any, DeliveryResult]:
        released = yield from self._waiting_for_locks(
            "claim_conn",
            row_id,
            lambda conn: store.delivery.release(conn, row_id=row_id, token=token, reason=reason),
        )
        if released is None:
            logger.warning(
                "outbox row %s: claim not released, it no longer owns the row (%s)",
                row_id,
                reason,
                extra={"outbox_id": row_id, "destination": handler.destination, "outbox_run": "released"},
            )
            return DeliveryResult.EMPTY
        extra = {
            "outbox_id": row_id,
            "key": released.key,
            "step": released.step,
            "destination": handler.destination,
            "outbox_run": "released",
            "releases": released.releases,
        }
        if released.releases >= RELEASE_ALERT_THRESHOLD:
            logger.error(
                "outbox %s:%s released %s times without a call, latest: %s; something holds the row "
                "or stalls commits (look for a long transaction on outbox_message in pg_stat_activity)",
                released.key,
                released.step,
                released.releases,
                reason,
                extra=extra,
            )
        else:
            logger.warning("outbox %s:%s %s", released.key, released.step, reason, extra=extra)
        return DeliveryResult.RELEASED

    def _recover_lost_claim(
        self, handler: Handler, row_id: int, token: uuid.UUID
    ) -> Generator[_Pause, Any, DeliveryResult]:
        """The claim's reply was lost: it may have committed, or may still (queued in a pooler).

        Fence it first (its token inserted as a release: once that commits, the claim can no
        longer commit), then, if it had committed, release the row: it made no call. No backend
        is ended: through a pooler the claim's backend is not this connection's to know.
        """
        started = time.monotonic()
        give_up_at = started + max(LOST_CLAIM_RECOVERY_SECONDS, handler.lease_seconds)
        #: Since when no try got an answer (None: the last one did).
        failing_since: float | None = None
        delay = 0.1
        while True:
            tried_at = time.monotonic()
            try:
                fenced = store.delivery.fence_lost_claim(self._conn("claim_conn"), row_id=row_id, token=token)
                break
            except psycopg.errors.LockNotAvailable:
                # The claim is running now: its end decides, once it comes.
                self._put_back("claim_conn")
                failing_since = None
            except psycopg.OperationalError:
                self._drop("claim_conn")
                if failing_since is None:
                    failing_since = tried_at
            now = time.monotonic()
            silent = failing_since is not None and now - failing_since >= LOST_CLAIM_UNREACHABLE_SECONDS
            if now >= give_up_at or silent:
                logger.error(
                    "outbox row %s: the reply to its claim was lost and the claim could not be settled "
                    "(the database did not answer the fence in %.0f s); if it committed, the row expires "
                    "to unknown with no call made (claim token %s)",
                    row_id,
                    now - started,
                    token,
                    extra={
                        "outbox_id": row_id,
                        "destination": handler.destination,
                        "claim_token": str(token),
                    },
                )
                if not self.database_down.is_set():
                    return DeliveryResult.EMPTY
                # No call was made: if the claim did not commit, whoever claims the message next
                # calls; if it did, that claim finds the row held and does nothing.
                return DeliveryResult.UNREACHABLE
            yield _Pause(delay)
            delay = min(delay * 2, 2.0)
        if fenced:
            logger.info(
                "outbox row %s: the claim whose reply was lost did not commit, and now never will",
                row_id,
                extra={"outbox_id": row_id, "destination": handler.destination, "outbox_run": "empty"},
            )
            return DeliveryResult.EMPTY
        reason = "released without a call: the reply to the claim was lost (connection error)"
        return (yield from self._release(handler, row_id, token, reason))

    def _record(
        self,
        claimed: store.delivery.Claimed,
        decision: Decision,
        nxt: Move,
        deadline_error: str | None,
        *,
        refund: bool = False,
        follow: chains.Plan = chains.NO_NEXT_STEPS,
    ) -> Generator[_Pause, Any, store.sql.Recorded]:
        # A failed record is not a lost outcome (the lease and the lookup recover it), but a
        # short database blip should not cost a lookup: try a few times within the lease.
        # An ambiguous call stays "unknown" on its attempt row even when the row fails (an
        # idempotent destination out of attempts): a later replay must see it (outbox.outcomes).
        ambiguous = decision.outcome is Outcome.UNKNOWN
        outcome = decision.outcome.value if nxt.state != "failed" or ambiguous else "failed"
        # Claims before records, never the other way round: no two threads wait on each other.
        self._put_back("claim_conn")
        locked = _LockWait(claimed.id)
        attempt = 0
        while True:
            try:
                recorded = store.delivery.record(
                    self._conn("record_conn"),
                    row_id=claimed.id,
                    token=claimed.token,
                    state=nxt.state,
                    outcome=outcome,
                    ref=decision.ref,
                    response=decision.response,
                    error=nxt.error,
                    http_status=decision.http_status,
                    delay_seconds=nxt.delay_seconds,
                    deadline_error=deadline_error,
                    refund_attempt=refund,
                    follow=follow,
                )
            except psycopg.errors.LockNotAvailable:
                # Rolled back, the connection fine: wait for the row without it. A record later
                # than the lease is still this claim's (it settles nothing a newer claim owns).
                self._put_back("record_conn")
                yield _Pause(locked.next_pause(claimed.destination, "record"))
            except psycopg.OperationalError:
                self._drop("record_conn")
                attempt += 1
                if attempt == 3:
                    raise
                yield _Pause(0.2 * attempt)
            else:
                if self.wakes is not None and claimed.destination in self.in_flight_limited():
                    # Its place in the limit is free: the deliveries it holds, anywhere, may claim.
                    self.wakes.freed(claimed.destination)
                return recorded


def delivery_for(
    claimed: store.delivery.Claimed,
    handler: Handler,
    deliveries: Deliveries,
    *,
    strict: bool = True,
    asynchronous: bool = False,
) -> Delivery:
    """What the handler sees of a claimed row; ``strict=False``: the payload as stored when it
    does not fit the handler's model (an ``on_failure`` function of a row failed for that);
    ``asynchronous``: its ``http`` an AsyncClient, for an ``async def`` handler."""
    return deliveries.delivery(
        handler,
        id=claimed.id,
        key=claimed.key,
        step=claimed.step,
        payload=claimed.payload,
        attempt=claimed.attempt,
        deadline=claimed.deadline,
        payload_version=claimed.payload_version,
        strict=strict,
        asynchronous=asynchronous,
    )
