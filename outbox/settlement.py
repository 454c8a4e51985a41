"""Settlement through a lookup: an `unknown` row's provider is asked, through its handler's
lookup, whether the call took effect, and the row is settled by the answer (sent, not found:
retried or failed, or parked for a human).

Used by the reconciler's ``resolve_unknown`` job (every due row), ``outbox repair`` (one row, or
a lookup's answer for a chain) and the testing helpers (outbox.testing.delivery). The
connection is in autocommit mode: nothing is held open while a lookup talks to a provider.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from . import aio, chains, logs, outcomes, policy, sanitize, settings, store, tracing
from .alerts import AlertHook, AlertRow, log_alert
from .db import require_autocommit
from .handlers import Confirmed, Deliveries, Delivery, Handler, idempotency_key
from .validation import header_safe

logger = logging.getLogger(__name__)


class LookupClients(Deliveries):
    """The lookups' deliveries: one HTTP client per destination, kept across runs and closed by
    ``close``. The reconciler may share a process with a worker (tests, the demo), so it owns
    clients of its own and closes exactly those. A lookup runs outside any worker call, so its
    clients have no send bound."""

    def __init__(self) -> None:
        super().__init__(send_bound=False)


def _only_nonzero(counts: Counter[str]) -> dict[str, int]:
    # Only what happened: an idle run reports {} rather than a row of zeros.
    return {k: v for k, v in counts.items() if v}


#: Rows read per batch, oldest due first. A run takes batch after batch while they come full,
#: up to DEFAULT_RESOLVE_MAX_BATCHES and its time budget; the rest wait for the next run.
DEFAULT_RESOLVE_BATCH = 100
#: Batches a run takes at most: every row of a batch leaves it settled or pushed back, so the
#: bound only matters where even pushing a row back failed (it would be read again).
DEFAULT_RESOLVE_MAX_BATCHES = 20
#: A run stops starting lookups after this long, so one slow provider cannot hold the job.
DEFAULT_RESOLVE_BUDGET_SECONDS = 60.0
#: Lookups of one destination that may fail in a row before the others of that destination
#: are deferred for this run: a provider that is down answers every lookup the same way.
LOOKUP_FAILURES_BEFORE_DEFERRING = 3
#: Lookups of one destination in flight at once in a run (OUTBOX_LOOKUP_CONCURRENCY). A worker
#: killed with its calls in flight leaves as many `unknown` rows, and a 300 ms provider asked one
#: row at a time settles three a second. A destination's run starts with one lookup in flight
#: and doubles it with each answer up to this, back to one after a failure: a provider that is
#: down sees its failures one at a time, and is left alone after LOOKUP_FAILURES_BEFORE_DEFERRING.
DEFAULT_LOOKUP_CONCURRENCY = settings.DEFAULT_LOOKUP_CONCURRENCY
#: An unknown row nobody can resolve automatically is looked at again after this long.
HUMAN_RECHECK_SECONDS = 3600.0

_DUE_UNKNOWN = """
SELECT id, key, step, destination, payload, attempts, deadline, claim_token, trace_context,
       payload_version
FROM outbox_message
WHERE state = 'unknown' AND available_at <= now()
  AND (CAST(%(only)s AS text[]) IS NULL OR destination = ANY(CAST(%(only)s AS text[])))
ORDER BY available_at, id
LIMIT %(limit)s
"""


def _settle_not_found(
    conn: psycopg.Connection[Any],
    handler: Handler,
    *,
    row_id: int,
    token: uuid.UUID | None,
    attempts: int,
    deadline: datetime | None,
    result: str,
    error: str,
    settled: str,
) -> str | None:
    """The call certainly did not take effect (or repeating it is harmless): retry or give up,
    marking the row's ambiguous attempt rows ``settled`` in the same statement.

    Only while every call that may have taken effect is younger than ``handler.key_ttl``
    (database clock): past it, "not found" may mean the provider forgot the call, and a retry
    may charge twice, so the row stays ``unknown``, parked for a human with the reason (and
    alerted once). Returns the new state, ``past_key_ttl`` when parked, or None when the row had
    moved meanwhile."""
    nxt = policy.retry_or_fail(handler, attempt=attempts, error=error)
    moved = store.recovery.settle_unknown(
        conn,
        row_id=row_id,
        token=token,
        state=nxt.state,
        result=result,
        error=nxt.error,
        delay_seconds=nxt.delay_seconds,
        deadline_error=policy.deadline_error(deadline, nxt.error),
        settled=settled,
        key_ttl=handler.key_ttl,
    )
    if moved is not None:
        return moved
    reason = (
        f"needs a human: a call is older than key_ttl ({handler.key_ttl:g} s), so the provider may "
        f"have forgotten it and 'not found' proves nothing; a retry could charge twice. Check the "
        f"provider's records, then run outbox resolve {row_id} --sent REF or --not-sent"
    )
    parked = store.recovery.park_past_key_ttl(
        conn, row_id=row_id, token=token, seconds=HUMAN_RECHECK_SECONDS, error=reason, key_ttl=handler.key_ttl
    )
    if not parked:
        return None
    logger.warning(
        "outbox row %s on %s needs a human: %s after key_ttl, not retried",
        row_id,
        handler.destination,
        result,
        extra={"outbox_id": row_id, "destination": handler.destination},
    )
    return "past_key_ttl"


def _park(conn: psycopg.Connection[Any], row_id: int, token: uuid.UUID | None, error: str) -> bool:
    return store.recovery.park_unknown(
        conn, row_id=row_id, token=token, seconds=HUMAN_RECHECK_SECONDS, error=error
    )


def _unsettleable(
    conn: psycopg.Connection[Any],
    alert: AlertHook | None,
    row_id: int,
    key: str,
    step: str,
    destination: str,
    token: uuid.UUID | None,
    exc: Exception,
) -> None:
    reason = sanitize.clean_text(
        f"lookup answer could not be recorded ({type(exc).__name__}: {logs.first_line(exc)}); "
        f"looked up again later; if it persists, check the provider and run outbox resolve {row_id}"
    )
    age = 0.0
    try:
        _defer(conn, row_id, token, reason)
        found = conn.execute(
            "SELECT EXTRACT(EPOCH FROM now() - created_at) FROM outbox_message WHERE id = %s", (row_id,)
        ).fetchone()
        age = float(found[0]) if found else 0.0
    except (psycopg.OperationalError, psycopg.InterfaceError):
        raise
    except psycopg.Error as again:
        # Even the deferral was refused: the row stays due; the alert below still goes out.
        logger.error(
            "outbox row %s could not be deferred either: %s",
            row_id,
            type(again).__name__,
            extra={"outbox_id": row_id, "destination": destination},
        )
    row = AlertRow(
        id=row_id, key=key, step=step, destination=destination, state="unknown", reason=reason, age=age
    )
    try:
        (alert or log_alert)(row)
    except Exception:
        logger.exception("alert hook failed for outbox row %s", row_id, extra={"outbox_id": row_id})


def _defer(conn: psycopg.Connection[Any], row_id: int, token: uuid.UUID | None, error: str | None) -> bool:
    return store.recovery.defer_unknown(conn, row_id=row_id, token=token, error=error)


class _Due(NamedTuple):
    """A due `unknown` row, as ``_DUE_UNKNOWN`` reads it."""

    row_id: int
    key: str
    step: str
    destination: str
    payload: Any
    attempts: int
    deadline: datetime | None
    token: uuid.UUID | None
    #: The writer's trace context as stored (outbox.tracing): the lookup is a span of it.
    trace_context: Any
    payload_version: int


#: A lookup's delivery and its answer: None when the provider has no record of the call.
_Answer = tuple[Delivery, Confirmed | None]


@dataclass
class _Run:
    """One run of the job: what every row's path reads, and the per-destination failure streaks."""

    conn: psycopg.Connection[Any]
    handlers: Mapping[str, Handler]
    module: str
    clients: LookupClients
    time_budget_seconds: float
    stop: threading.Event | None
    started: float = field(default_factory=time.monotonic)
    consecutive_failures: Counter[str] = field(default_factory=Counter)
    #: Lookups of each destination that may be in flight at once now, across the run's batches
    #: (one at first, doubling with each answer up to the run's lookup concurrency).
    window: Counter[str] = field(default_factory=Counter)


def resolve_unknown(
    conn: psycopg.Connection[Any],
    handlers: Mapping[str, Handler],
    *,
    module: str = "the handler module",
    clients: LookupClients | None = None,
    batch_size: int = DEFAULT_RESOLVE_BATCH,
    time_budget_seconds: float = DEFAULT_RESOLVE_BUDGET_SECONDS,
    stop: threading.Event | None = None,
    alert: AlertHook | None = None,
    only_destinations: Sequence[str] | None = None,
    lookup_concurrency: int = DEFAULT_LOOKUP_CONCURRENCY,
    max_batches: int = DEFAULT_RESOLVE_MAX_BATCHES,
) -> dict[str, int]:
    """Ask each due `unknown` row's provider, through the handler's lookup, whether the call
    took effect, and settle the row accordingly: ``batch_size`` rows at a time, oldest due
    first, batch after batch while they come full (at most ``max_batches``, and none begun
    past ``time_budget_seconds``).

    Up to ``lookup_concurrency`` lookups of a destination are in flight at once (threads; an
    ``async def`` lookup runs on the process's event loop, outbox.aio); every row is settled on
    ``conn``, one statement at a time, as its answer arrives.

    Counts: ``sent`` (found), ``pending`` / ``failed`` (not found: retried, or out of attempts
    or deadline), ``lookup_failed`` (the lookup raised; looked up again later), ``deferred``
    (not looked up: its destination's lookups keep failing, or the time budget ran out),
    ``interrupted`` (left due because ``stop`` was set: the process is shutting down; lookups
    already asked are settled),
    ``needs_human`` (no lookup and not idempotent, or a key no Idempotency-Key header can
    carry), ``past_key_ttl`` (not found, or idempotent without a lookup, but a call is older
    than the destination's ``key_ttl``: parked for a human, never retried automatically),
    ``no_handler`` (destination unknown to ``module``), ``raced`` (the row moved while we
    looked; someone else settled it), ``unsettleable`` (the database refused the row's statement,
    or its path raised: deferred with the reason and reported through ``alert``, default
    :func:`~outbox.alerts.log_alert`; the other rows proceed).

    ``only_destinations``: leave the rows of every other destination alone (the in-process test
    helpers, :mod:`outbox.testing.delivery`); the reconciler passes None: every row.
    """
    require_autocommit(conn, "resolve_unknown")
    if lookup_concurrency < 1:
        raise ValueError(f"lookup_concurrency must be at least 1, got {lookup_concurrency}")
    own_clients = clients is None
    lookup_clients = LookupClients() if clients is None else clients
    run = _Run(conn, handlers, module, lookup_clients, time_budget_seconds, stop)
    tally = _Tally(run, alert)
    try:
        only = list(only_destinations) if only_destinations is not None else None
        for _ in range(max_batches):
            rows = conn.execute(_DUE_UNKNOWN, {"limit": batch_size, "only": only}).fetchall()
            to_ask: dict[str, deque[tuple[Handler, _Due]]] = {}
            for fields in rows:
                row = _Due(*fields)
                handler = tally.count(row, _triage, run, row)
                if isinstance(handler, Handler):
                    to_ask.setdefault(row.destination, deque()).append((handler, row))
            if to_ask:
                _ask_all(run, tally, to_ask, lookup_concurrency)
            stopping = stop is not None and stop.is_set()
            if len(rows) < batch_size or stopping or time.monotonic() - run.started > time_budget_seconds:
                break
    finally:
        if own_clients:
            lookup_clients.close()
    return _only_nonzero(tally.counts)


class _Tally:
    """The counts of a run, and what becomes of a row whose path raised."""

    def __init__(self, run: _Run, alert: AlertHook | None) -> None:
        self.run = run
        self.alert = alert
        self.counts: Counter[str] = Counter()

    def count(self, row: _Due, path: Callable[..., str | Handler], *args: Any) -> str | Handler | None:
        """``path(*args)``, counting the name it returns (a handler is counted later, when its
        lookup's answer settles the row)."""
        try:
            outcome = path(*args)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            # A lost connection is not this row's fault: the job ends, the next run retries.
            raise
        except Exception as exc:
            # One row the database will not take (or a bug on its path) must not hold back
            # the others, of any destination: it is pushed back, with the reason, and alerted.
            self.counts["unsettleable"] += 1
            _unsettleable(
                self.run.conn, self.alert, row.row_id, row.key, row.step, row.destination, row.token, exc
            )
            return None
        if isinstance(outcome, str):
            self.counts[outcome] += 1
        return outcome


def _ask_all(
    run: _Run, tally: _Tally, to_ask: dict[str, deque[tuple[Handler, _Due]]], concurrency: int
) -> None:
    """Look up the rows of ``to_ask`` (by destination, oldest first), each destination's window
    of lookups in flight growing from one to ``concurrency`` while its answers come, and settle
    each row on the run's connection as its answer arrives."""
    window = run.window
    for destination in to_ask:
        window[destination] = window[destination] or 1
    in_flight: Counter[str] = Counter()
    asked: dict[Future[_Answer], tuple[Handler, _Due]] = {}
    threads = min(sum(len(q) for q in to_ask.values()), concurrency * len(to_ask))
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="outbox-lookup")
    try:
        while True:
            for destination, queue in to_ask.items():
                while queue and in_flight[destination] < window[destination]:
                    handler, row = queue.popleft()
                    if run.stop is not None and run.stop.is_set():
                        tally.counts["interrupted"] += 1
                    elif _out_of_turn(run, destination):
                        tally.count(row, _push_back, run, row)
                    else:
                        asked[executor.submit(_ask, run.clients, handler, row)] = (handler, row)
                        in_flight[destination] += 1
            if not asked:
                return
            done, _ = wait(asked, return_when=FIRST_COMPLETED)
            for answer in done:
                handler, row = asked.pop(answer)
                in_flight[row.destination] -= 1
                grown = 1 if answer.exception() is not None else 2 * window[row.destination]
                window[row.destination] = min(grown, concurrency)
                tally.count(row, _settle_answer, run, handler, row, answer)
    finally:
        # Lookups already asked finish (bounded by their clients' timeouts); their answers are
        # lost only when the run ends on a lost connection: the rows stay due, asked again.
        executor.shutdown(wait=True, cancel_futures=True)


_ONE_UNKNOWN = """
SELECT id, key, step, destination, payload, attempts, deadline, claim_token, trace_context,
       payload_version
FROM outbox_message WHERE id = %(id)s AND state = 'unknown'
"""


def resolve_one(
    conn: psycopg.Connection[Any],
    handlers: Mapping[str, Handler],
    row_id: int,
    *,
    module: str = "the handler module",
    clients: LookupClients | None = None,
) -> str | None:
    """Ask the provider of one `unknown` row now, due or not, and settle it as a run of the job
    would (``outbox repair``); returns the count it would add to (``sent``, ``pending``,
    ``failed``, ``lookup_failed``, ``past_key_ttl``, ``needs_human``, ``no_handler``,
    ``raced``), or None when the row is not `unknown`."""
    require_autocommit(conn, "resolve_one")
    fields = conn.execute(_ONE_UNKNOWN, {"id": row_id}).fetchone()
    if fields is None:
        return None
    own_clients = clients is None
    lookup_clients = LookupClients() if clients is None else clients
    try:
        run = _Run(conn, handlers, module, lookup_clients, DEFAULT_RESOLVE_BUDGET_SECONDS, None)
        return _resolve_row(run, _Due(*fields))
    finally:
        if own_clients:
            lookup_clients.close()


def _resolve_row(run: _Run, row: _Due) -> str:
    """Settle, defer or park one row, asking its provider here when it has a lookup; returns
    the count it adds to."""
    found = _triage(run, row)
    if isinstance(found, str):
        return found
    if _out_of_turn(run, row.destination):
        return _push_back(run, row)
    return _look_up(run, found, row)


def _triage(run: _Run, row: _Due) -> str | Handler:
    """Settle, park or leave one row that needs no lookup (the count it adds to), or the handler
    whose lookup is to be asked."""
    conn, row_id, token, destination = run.conn, row.row_id, row.token, row.destination
    if run.stop is not None and run.stop.is_set():
        return "interrupted"
    handler = run.handlers.get(destination)
    if handler is None:
        # Stays unknown: only this destination's own lookup (or a human) may conclude.
        error = (
            f"no handler for destination {destination} in {run.module}: its outcome cannot be "
            f"looked up; deploy its handler, or check the provider and run "
            f"outbox resolve {row_id} --sent REF / --not-sent"
        )
        return "no_handler" if _park(conn, row_id, token, error) else "raced"
    if handler.lookup_fn is None:
        return _without_lookup(conn, handler, row)
    if not header_safe(idempotency_key(row.key, row.step)):
        # Written before keys were checked at write: no lookup can name it to the
        # provider, and asking again every few seconds would never succeed.
        error = (
            f"needs a human: key {row.key!r} cannot be sent as an Idempotency-Key header "
            "(not printable ASCII); check the provider, then run "
            f"outbox resolve {row_id} --sent REF or --not-sent"
        )
        return "needs_human" if _park(conn, row_id, token, error) else "raced"
    return handler


def _push_back(run: _Run, row: _Due) -> str:
    # Pushed back rather than left due, or they would fill every next batch and starve the
    # rows of healthy destinations behind them.
    return "deferred" if _defer(run.conn, row.row_id, row.token, None) else "raced"


def _out_of_turn(run: _Run, destination: str) -> bool:
    """Whether a row's lookup is not to be asked this run: the time budget is spent, or its
    destination's lookups keep failing."""
    out_of_time = time.monotonic() - run.started > run.time_budget_seconds
    return out_of_time or run.consecutive_failures[destination] >= LOOKUP_FAILURES_BEFORE_DEFERRING


def _without_lookup(conn: psycopg.Connection[Any], handler: Handler, row: _Due) -> str:
    if handler.idempotent:
        # The provider deduplicates on our Idempotency-Key: calling again is safe.
        state = _settle_not_found(
            conn,
            handler,
            row_id=row.row_id,
            token=row.token,
            attempts=row.attempts,
            deadline=row.deadline,
            result="no_lookup_idempotent",
            error="outcome unknown; retried, the destination is idempotent",
            settled=outcomes.IDEMPOTENT_RETRY,
        )
        return state or "raced"
    key, step, destination, row_id = row.key, row.step, row.destination, row.row_id
    error = (
        f"needs a human: {destination} has no lookup and is not idempotent; check the "
        f"provider, then run outbox resolve {row_id} --sent REF or --not-sent"
    )
    if not _park(conn, row_id, row.token, error):
        return "raced"
    logger.warning(
        "outbox %s:%s on %s needs a human: no lookup, not idempotent",
        key,
        step,
        destination,
        extra={"outbox_id": row_id, "key": key, "step": step, "destination": destination},
    )
    return "needs_human"


def ask_provider(
    clients: LookupClients,
    handler: Handler,
    *,
    row_id: int,
    key: str,
    step: str,
    payload: Any,
    attempts: int,
    deadline: datetime | None,
    trace_context: Any,
    payload_version: int,
) -> tuple[Delivery, Confirmed | None]:
    """Call ``handler``'s lookup for a stored row (in a span of the writer's trace when tracing
    is on): the delivery it got and its answer. Raises what the lookup raised, and TypeError for
    an answer that is neither ``Confirmed`` nor None. Hold no transaction open around it."""
    assert handler.lookup_fn is not None  # checked by the caller
    lookup = handler.lookup_fn
    asynchronous = aio.is_async(lookup)
    delivery = clients.delivery(
        handler,
        id=row_id,
        key=key,
        step=step,
        payload=payload,
        attempt=attempts,
        deadline=deadline,
        payload_version=payload_version,
        # A lookup names the call by its key: a payload the model now refuses (the row went
        # `unknown` for it) must not keep the provider from being asked.
        strict=False,
        asynchronous=asynchronous,
    )
    if tracing.active():
        lookup = tracing.in_span(
            lookup,
            operation="lookup",
            trace_context=trace_context,
            destination=handler.destination,
            row_id=row_id,
            key=key,
            step=step,
            attempt=attempts,
        )
    # An async lookup runs on the process's event loop (outbox.aio), cancelled at the bound a
    # call of its handler has; a sync one is bounded by its client's timeouts.
    try:
        found = aio.call(lookup, delivery, timeout_seconds=handler.call_deadline_seconds)
    finally:
        if asynchronous:
            # Lent for this lookup: given back, a client that stayed stuck is replaced.
            clients.give_back(delivery.http)
    if found is not None and not isinstance(found, Confirmed):
        raise TypeError(f"lookup returned {type(found).__name__}, expected Confirmed or None")
    return delivery, found


def _ask(clients: LookupClients, handler: Handler, row: _Due) -> _Answer:
    # No transaction is open here: the connection is in autocommit mode, and lookups run
    # outside the thread that holds it.
    return ask_provider(
        clients,
        handler,
        row_id=row.row_id,
        key=row.key,
        step=row.step,
        payload=row.payload,
        attempts=row.attempts,
        deadline=row.deadline,
        trace_context=row.trace_context,
        payload_version=row.payload_version,
    )


def _look_up(run: _Run, handler: Handler, row: _Due) -> str:
    """Ask the provider, then settle the row on its answer."""
    answer: Future[_Answer] = Future()
    try:
        answer.set_result(_ask(run.clients, handler, row))
    except Exception as exc:
        answer.set_exception(exc)
    return _settle_answer(run, handler, row, answer)


def _settle_answer(run: _Run, handler: Handler, row: _Due, answer: Future[_Answer]) -> str:
    """Settle the row on its lookup's answer (found, not found, or the lookup raised)."""
    conn, row_id, token, destination = run.conn, row.row_id, row.token, row.destination
    exc = answer.exception()
    if isinstance(exc, Exception):
        run.consecutive_failures[destination] += 1
        error = policy.short_error(f"lookup failed: {policy.describe_exception(exc)}")
        counted = "lookup_failed" if _defer(conn, row_id, token, error) else "raced"
        logger.warning(
            "outbox %s:%s on %s: %s",
            row.key,
            row.step,
            destination,
            logs.provider_text(error),
            extra={"outbox_id": row_id, "key": row.key, "step": row.step, "destination": destination},
        )
        return counted
    run.consecutive_failures[destination] = 0
    delivery, found = answer.result()
    if found is not None:
        # The row's next steps (outbox.chains) are written by the statement that settles it.
        moved = store.recovery.settle_unknown(
            conn,
            row_id=row_id,
            token=token,
            state="sent",
            result="found",
            ref=found.ref,
            response=found.response,
            follow=chains.then_plan(handler, delivery, chains.as_stored(found)),
        )
        return "sent" if moved else "raced"
    state = _settle_not_found(
        conn,
        handler,
        row_id=row_id,
        token=token,
        attempts=row.attempts,
        deadline=row.deadline,
        result="not_found",
        # Why the call was ambiguous stays on its attempt row.
        error="lookup: the provider has no record of the call",
        settled=outcomes.LOOKUP_NOT_FOUND,
    )
    return state or "raced"
