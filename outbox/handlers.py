"""The consumer API: ``@handler`` declarations, ``Delivery`` and ``Confirmed``.

Declarations are checked when the module is imported, so a bad timing fails the deploy, not a
payment at three in the morning.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from . import aio, netio, payloads, provider_headers
from .exceptions import ConfigError, RetryableError
from .ordering import ON_FAILED_HEAD
from .settings import (
    DEFAULT_ASYNC_POOL_SIZE,
    DEFAULT_BACKOFF_SECONDS,
    DEFAULT_KEY_TTL_SECONDS,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_TIME_LIMIT_SECONDS,
    MAX_CALLS_PER_SECOND,
    MAX_START_MARGIN_SECONDS,
    MIN_CALLS_PER_SECOND,
    MIN_LEASE_MARGIN_SECONDS,
    PACE_AHEAD_SECONDS,
    default_lease_seconds,
)
from .usermodules import import_user_module
from .validation import destination_problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Breaker:
    """A destination's breaker thresholds (``@handler(breaker=...)``; ``breaker=None``: none).

    ``failures`` consecutive "not processed" outcomes, the first of them at most
    ``window_seconds`` before the last, open the breaker for ``open_seconds``; each probe that
    finds the provider still down doubles that, up to ``max_open_seconds``.
    """

    failures: int = 5
    window_seconds: float = 60.0
    open_seconds: float = 10.0
    max_open_seconds: float = 300.0

    def problems(self) -> list[str]:
        problems: list[str] = []
        if not isinstance(self.failures, int) or isinstance(self.failures, bool) or self.failures < 1:
            problems.append(f"breaker failures must be a whole number >= 1, got {self.failures!r}")
        for name in ("window_seconds", "open_seconds", "max_open_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                problems.append(f"breaker {name} must be a finite number of seconds > 0, got {value!r}")
        if not problems and self.max_open_seconds < self.open_seconds:
            problems.append(
                f"breaker max_open_seconds ({self.max_open_seconds:g}) must be >= open_seconds "
                f"({self.open_seconds:g})"
            )
        return problems


#: What ``@handler`` uses unless told otherwise.
DEFAULT_BREAKER = Breaker()


@dataclass(frozen=True)
class Confirmed:
    """What a handler returns when the provider confirmed the effect."""

    ref: str
    response: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ref, str) or not self.ref:
            raise TypeError(f"Confirmed.ref must be the provider's non-empty reference, got {self.ref!r}")


class _CallState:
    """The current call's state: ``not_after``, the monotonic instant after which
    ``Delivery.http`` sends no request (set by the worker around each call: a process paused after
    its start check (SIGSTOP, a VM stall) must not send once its lease may have run out);
    ``status``, the last HTTP status the provider answered during the call (kept on a permanent
    error, whose exception rarely carries it), and its ``retry_after``; ``requests``, how many
    requests the call began (a pool timeout on the only one means nothing was sent)."""

    __slots__ = ("not_after", "requests", "retry_after", "status")

    def __init__(self, not_after: float | None) -> None:
        self.not_after = not_after
        self.status: int | None = None
        self.retry_after: float | None = None
        self.requests = 0


#: A context variable, not a thread-local: the async calls of one thread (the event loop's) run
#: as tasks, each in a context of its own. The value is a mutable object so that a task the
#: handler starts (``asyncio.gather``) shares its call's state instead of a copy of it.
_call_state: contextvars.ContextVar[_CallState | None] = contextvars.ContextVar("outbox_call", default=None)


def set_send_bound(not_after: float | None) -> None:
    """Start the current call's state (in this thread, or this task): no request is sent past
    ``not_after`` (None: no bound)."""
    _call_state.set(_CallState(not_after))


def last_response_status() -> int | None:
    """The status of the last answer ``Delivery.http`` received in the current call (since the
    send bound was last set, in this thread or task), or None."""
    state = _call_state.get()
    return state.status if state is not None else None


def last_retry_after() -> float | None:
    """Seconds the last 429 or 503 answer of the current call asked to wait (its
    ``Retry-After``), or None: for a handler that raises its own error on such an answer."""
    state = _call_state.get()
    return state.retry_after if state is not None else None


def requests_begun() -> int:
    """How many requests ``Delivery.http`` began in the current call."""
    state = _call_state.get()
    return state.requests if state is not None else 0


def _check_send_bound(request: httpx.Request) -> None:
    state = _call_state.get()
    if state is None:
        return
    if state.not_after is not None and time.monotonic() > state.not_after:
        raise RetryableError(
            "the request was not sent: the call ran out of lease before it could send "
            "(the worker was paused or starved)"
        )
    state.requests += 1


def _note_status(destination: str, response: httpx.Response) -> None:
    # An exception out of a response hook would be the handler's, and a certain "not processed"
    # would become unknown: the parser never raises, whatever the provider sent.
    state = _call_state.get()
    if state is None:
        return
    state.status = response.status_code
    state.retry_after = provider_headers.retry_after_seconds(response, destination=destination)


async def _check_send_bound_async(request: httpx.Request) -> None:
    _check_send_bound(request)


async def _note_status_async(destination: str, response: httpx.Response) -> None:
    _note_status(destination, response)


_ssl_lock = threading.Lock()
_ssl: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every ``Delivery.http`` client of the process, made as httpx makes
    its default one (certifi's roots, or SSL_CERT_FILE / SSL_CERT_DIR). A context per client
    costs milliseconds of CPU each: a worker's first deliveries (a client per call thread and
    destination, made on first use) would wait out many of them, and so would the first call
    after a call thread is abandoned at its time limit (docs/decisions/hot-path-costs.md)."""
    global _ssl
    with _ssl_lock:
        if _ssl is None:
            _ssl = httpx.create_ssl_context()
        return _ssl


_all_clients: list[httpx.Client | httpx.AsyncClient] = []
_all_clients_lock = threading.Lock()


def close_http_clients() -> None:
    """Close every provider client still open (once the worker threads have stopped)."""
    with _all_clients_lock:
        clients, _all_clients[:] = list(_all_clients), []
    for client in clients:
        _close_client(client)


def _close_client(client: httpx.Client | httpx.AsyncClient) -> None:
    if isinstance(client, httpx.Client):
        client.close()
        return
    if client.is_closed:
        return
    if aio.on_loop():
        aio.submit(client.aclose())  # closed when the loop gets to it: this code runs on it
        return
    try:
        aio.run(client.aclose(), timeout_seconds=5.0)
    except (RuntimeError, TimeoutError):
        pass  # the loop is gone or stuck: its connections go with it


def idempotency_key(key: str, step: str) -> str:
    """The ``Idempotency-Key`` of every call for ``(key, step)``: the business key, so that each
    attempt, a lookup and a replay all name the same operation to the provider.

    Never encoded: ``write`` only accepts a ``key:step`` of printable ASCII (an HTTP header
    carries nothing else unchanged), so this is the header value byte for byte. ``write``
    refuses a ``:`` in the step, so the key is what precedes the last ``:``: two rows never
    share one header (rows stored before that rule keep theirs)."""
    return f"{key}:{step}"


@dataclass(frozen=True)
class Delivery:
    """One claimed outbox row, as a handler (or its lookup) sees it."""

    id: int
    key: str
    step: str
    destination: str
    payload: dict[str, Any]
    attempt: int
    idempotency_key: str
    deadline: datetime | None
    #: A client whose timeouts add up to less than the handler's time_limit: an
    #: ``httpx.AsyncClient`` for an ``async def`` handler or lookup, an ``httpx.Client`` otherwise.
    http: Any = field(repr=False, compare=False)
    #: The payload validated by the handler's ``payload_model`` (None without one); ``payload``
    #: is then the dict it was validated from, upgraded to the current version.
    model: Any = field(default=None, repr=False, compare=False)


#: Lookups by destination (``@handler.lookup``): registered after the handler, which stays frozen.
_lookups: dict[str, Callable[[Delivery], Any]] = {}
#: Next steps by destination (``@handler.then``, ``@handler.on_failure``; outbox.chains).
_thens: dict[str, Callable[[Delivery, Confirmed], Any]] = {}
_on_failures: dict[str, Callable[[Delivery, str], Any]] = {}


@dataclass(frozen=True)
class Handler:
    destination: str
    fn: Callable[[Delivery], Any]
    time_limit: float
    max_attempts: int
    backoff: tuple[float, ...]
    idempotent: bool
    key_ttl: float
    lease_seconds: float
    #: Optional override: exception -> "sent" | "retry" | "failed" | "unknown" | None (default).
    classify: Callable[[BaseException], str | None] | None = None
    #: Whom a 429/503's Retry-After holds back: "row" (that row's retry) or "destination" (every
    #: row of it: the worker pauses the destination for that long, outbox.pauses.hold).
    retry_after_scope: str = "row"
    #: The destination's circuit breaker (outbox.breaker); None: none, every row spends its
    #: attempts on a provider that is down.
    breaker: Breaker | None = DEFAULT_BREAKER
    #: Optional pydantic model of the payload, and the upgrades that bring older payload
    #: versions to its shape (outbox.payloads).
    payload_model: Any = field(default=None, compare=False)
    upgrades: Mapping[int, payloads.Upgrade] | None = field(default=None, compare=False)
    #: A failed row of an ordering key: "block" its key (default) or "skip" it (outbox.ordering).
    on_failed_head: str = "block"
    #: At most this many calls of the destination at once over every worker (outbox.limits), or
    #: None: no limit declared. The lowest that live workers declare holds; `outbox limit` over it.
    max_in_flight: int | None = None
    #: At most this many calls of the destination a second over every worker, their starts
    #: spaced 1/rate apart (outbox.limits), or None. The lowest that live workers declare holds.
    max_calls_per_second: float | None = None

    def __call__(self, delivery: Delivery) -> Any:
        return self.fn(delivery)

    @property
    def declares_limits(self) -> bool:
        """Whether the handler declares a limit that its worker's heartbeat must keep alive."""
        return self.max_in_flight is not None or self.max_calls_per_second is not None

    @property
    def is_async(self) -> bool:
        """Whether the handler is an ``async def`` function: its calls run as tasks on the
        process's event loop (outbox.aio) and its ``d.http`` is an ``httpx.AsyncClient``."""
        return aio.is_async(self.fn)

    def lookup(self, fn: Callable[[Delivery], Any]) -> Callable[[Delivery], Any]:
        """Register how to ask the provider whether an earlier call to this destination took
        effect: a function (or an ``async def`` one) returning ``Confirmed`` or None."""
        with _registry_lock:
            _lookups[self.destination] = fn
        return fn

    @property
    def lookup_fn(self) -> Callable[[Delivery], Any] | None:
        return _lookups.get(self.destination)

    def then(self, fn: Callable[[Delivery, Confirmed], Any]) -> Callable[[Delivery, Confirmed], Any]:
        """Register the steps that follow this one once the provider confirmed it: a pure
        function of the delivery and the confirmed answer returning a list of ``outbox.Next``.
        Every path that settles a row of this destination ``sent`` writes them, in the statement
        that settles it (outbox.chains)."""
        _refuse_async(fn, f"{self.destination}: @then")
        with _registry_lock:
            _thens[self.destination] = fn
        return fn

    def on_failure(self, fn: Callable[[Delivery, str], Any]) -> Callable[[Delivery, str], Any]:
        """Register the compensation written when a row of this destination fails for a certain
        reason (never out of ``unknown``): a pure function of the delivery and the failure's
        reason returning a list of ``outbox.Next``."""
        _refuse_async(fn, f"{self.destination}: @on_failure")
        with _registry_lock:
            _on_failures[self.destination] = fn
        return fn

    @property
    def then_fn(self) -> Callable[[Delivery, Confirmed], Any] | None:
        return _thens.get(self.destination)

    @property
    def on_failure_fn(self) -> Callable[[Delivery, str], Any] | None:
        return _on_failures.get(self.destination)

    @property
    def start_margin_seconds(self) -> float:
        """Lease a call must leave over for its record: a worker starts no call with less than
        ``time_limit`` plus this left, by its own clock since it sent the claim. Half the lease's
        margin over ``time_limit``, at most 5 s; the other half absorbs the claim's own wait."""
        return min(MAX_START_MARGIN_SECONDS, (self.lease_seconds - self.time_limit) / 2)

    @property
    def pace_ahead_seconds(self) -> float:
        """How far ahead a claim may book its call's start on a paced destination
        (outbox.limits): a second, or a quarter of the room the start bound leaves if less: the
        booking counts from the claim's UPDATE, after any row-lock wait, and the start bound from
        when the claim was sent, so the rest is for that wait, the commit and the reply."""
        room = self.lease_seconds - self.time_limit - self.start_margin_seconds
        return max(0.0, min(PACE_AHEAD_SECONDS, room / 4))

    @property
    def call_deadline_seconds(self) -> float:
        """When the worker stops waiting for a call: ``time_limit``, which the timeouts of
        ``d.http`` add up to, plus half the start margin, so that a timeout firing at the limit
        is still classified by its kind (a connect timeout was certainly not sent). The record
        keeps the other half of the margin."""
        return self.time_limit + self.start_margin_seconds / 2

    @property
    def payload_version(self) -> int:
        """The payload version this handler delivers (outbox.payloads): rows written without
        ``payload_version=`` while it is imported get this one."""
        return payloads.declared_version(self.payload_model, self.upgrades)

    @property
    def checks_payloads(self) -> bool:
        return self.payload_model is not None or bool(self.upgrades)

    def prepare(self, payload: Mapping[str, Any], version: int) -> payloads.Prepared:
        """The payload at this handler's version, validated; raises PayloadTooNew/PayloadInvalid."""
        return payloads.prepare(
            destination=self.destination,
            model=self.payload_model,
            upgrades=self.upgrades,
            payload=payload,
            version=version,
        )

    def backoff_seconds(self, attempt: int) -> float:
        """Delay before attempt ``attempt + 1`` (attempt counts from 1)."""
        return _delay(self.backoff, attempt)

    def total_backoff_seconds(self) -> float:
        """The backoffs of every retry added up (docs/timings.md): under ``key_ttl``."""
        return sum(self.backoff_seconds(a) for a in range(1, self.max_attempts))

    def timeouts(self) -> httpx.Timeout:
        # connect + write + read stays inside time_limit even when each phase takes its maximum.
        tl = self.time_limit
        return httpx.Timeout(connect=tl * 0.2, write=tl * 0.2, read=tl * 0.55, pool=tl * 0.05)

    def problems(self) -> list[str]:
        """Everything wrong with this declaration, one sentence each (empty when it is sound).

        ``@handler`` refuses a declaration with any; ``outbox doctor`` reports them."""
        return declaration_problems(
            self.destination,
            time_limit=self.time_limit,
            max_attempts=self.max_attempts,
            backoff=self.backoff,
            key_ttl=self.key_ttl,
            lease_seconds=self.lease_seconds,
        )


def _refuse_async(fn: Any, what: str) -> None:
    # Next steps are written in the statement that settles the row: a pure function of the
    # delivery and the answer, nothing to await.
    if aio.is_async(fn):
        raise ConfigError(f"{what} must be a plain function (pure: it returns Next steps), not async def")


def _delay(backoff: tuple[float, ...], attempt: int) -> float:
    # The last entry repeats for the attempts beyond the list.
    return backoff[min(attempt - 1, len(backoff) - 1)]


def declaration_problems(
    destination: Any,
    *,
    time_limit: Any,
    max_attempts: Any,
    backoff: Any,
    key_ttl: Any,
    lease_seconds: Any,
) -> list[str]:
    """The checks behind :meth:`Handler.problems`, on raw values: ``@handler`` runs them before
    it can build a Handler (a bad value may not even convert)."""
    problem = destination_problem(destination)
    if problem is not None:
        return [problem]
    problems: list[str] = []
    timing_ok = isinstance(time_limit, int | float) and time_limit > 0
    if not timing_ok:
        problems.append(f"time_limit must be > 0 seconds, got {time_limit!r}")
    attempts_ok = isinstance(max_attempts, int) and max_attempts >= 1
    if not attempts_ok:
        problems.append("max_attempts must be a whole number >= 1")
    try:
        delays = tuple(float(b) for b in backoff)
    except (TypeError, ValueError):
        delays = ()
    if not delays or any(not b > 0 for b in delays):
        problems.append(f"every backoff entry must be > 0 seconds, got {_shown(backoff)}")
        delays = ()
    if timing_ok and lease_seconds is not None:
        lease = float(lease_seconds)
        if lease <= time_limit:
            problems.append(
                f"lease_seconds ({lease:g}) must be longer than time_limit ({time_limit:g}), or the "
                "reconciler could take over a call still under way"
            )
        elif lease - time_limit < MIN_LEASE_MARGIN_SECONDS:
            problems.append(
                f"lease_seconds ({lease:g}) must exceed time_limit ({time_limit:g}) by at least "
                f"{MIN_LEASE_MARGIN_SECONDS:g} s, the room the claim's round trip and the record need "
                "around the call"
            )
    if attempts_ok and delays:
        total = sum(_delay(delays, a) for a in range(1, max_attempts))
        if total >= key_ttl:
            problems.append(
                f"the backoffs add up to {total:g} s over {max_attempts} attempts, not under key_ttl "
                f"({key_ttl:g} s); the provider would forget the Idempotency-Key before the last retry"
            )
    return [f"{destination}: {p}" for p in problems]


def _shown(backoff: Any) -> str:
    try:
        return repr(tuple(backoff))
    except TypeError:
        return repr(backoff)


class Deliveries:
    """Builds the ``Delivery`` a handler or a lookup gets, with one HTTP client per destination.

    One instance per owner of its clients: each of a worker's call threads (whose clients end
    with it: a call abandoned mid-request takes its connection along) and the reconciler's
    lookups (which may share a process with a worker: tests, the demo). ``close`` closes exactly
    these clients; :func:`close_http_clients` closes every one left open.
    """

    def __init__(self, *, send_bound: bool = True, pool_size: int = DEFAULT_ASYNC_POOL_SIZE) -> None:
        #: Whether the clients refuse to send past the call's bound (:func:`set_send_bound`).
        self._send_bound = send_bound
        #: Connections the async clients of a destination keep to its provider, in all: at least
        #: the calls in flight that may share them, so that no call waits for a pool slot.
        self._pool_size = pool_size
        self._clients: dict[str, tuple[Handler, httpx.Client]] = {}
        self._shards: dict[str, _Shards] = {}
        self._lock = threading.Lock()

    def client(self, handler: Handler, *, asynchronous: bool = False) -> Any:
        """The client of ``handler``'s destination: an ``httpx.AsyncClient`` (of the process's
        event loop, outbox.aio) when ``asynchronous``, lent until :meth:`give_back`; an
        ``httpx.Client`` otherwise."""
        if asynchronous:
            return self._lend(handler)
        with self._lock:
            known = self._clients.get(handler.destination)
            if known is not None and known[0] is handler and not known[1].is_closed:
                return known[1]
            hooks: dict[str, list[Callable[..., Any]]] = (
                {
                    "request": [_check_send_bound],
                    "response": [functools.partial(_note_status, handler.destination)],
                }
                if self._send_bound
                else {}
            )
            client = httpx.Client(timeout=handler.timeouts(), event_hooks=hooks, verify=_ssl_context())
            _skip_cookieless(client)
            self._clients[handler.destination] = (handler, client)
        _track(client)
        if known is not None:
            # A reloaded handler module: its timings may have changed.
            _close(known[1])
        return client

    def _lend(self, handler: Handler) -> httpx.AsyncClient:
        with self._lock:
            shards = self._shards.get(handler.destination)
            if shards is None or shards.handler is not handler or shards.closed():
                old, shards = shards, _Shards(handler, self._pool_size, self._send_bound)
                self._shards[handler.destination] = shards
            else:
                old = None
            client = shards.lend()
        if old is not None:
            # A reloaded handler module: its timings may have changed.
            old.close()
        return client

    def give_back(self, client: Any) -> None:
        """A lent async client's call is over (a sync client needs no giving back)."""
        with self._lock:
            for shards in self._shards.values():
                if shards.give_back(client):
                    return

    def delivery(
        self,
        handler: Handler,
        *,
        id: int,
        key: str,
        step: str,
        payload: dict[str, Any],
        attempt: int,
        deadline: datetime | None,
        payload_version: int,
        strict: bool = True,
        asynchronous: bool = False,
    ) -> Delivery:
        """The row as ``handler`` sees it: with a payload model or upgrades, its payload brought
        to the handler's version and validated (raises PayloadTooNew / PayloadInvalid; with
        ``strict=False`` such a payload is given as stored, without a model: what a lookup, which
        names the call by its key, and an ``on_failure`` function of a row failed for it see).
        ``asynchronous``: for an ``async def`` function, whose ``http`` is an AsyncClient."""
        model = None
        if handler.checks_payloads and not isinstance(payload, payloads.Unreadable):
            try:
                prepared = handler.prepare(payload, payload_version)
            except (payloads.PayloadInvalid, payloads.PayloadTooNew):
                if strict:
                    raise
            else:
                payload, model = prepared.payload, prepared.model
        return Delivery(
            id=id,
            key=key,
            step=step,
            destination=handler.destination,
            payload=payload,
            attempt=attempt,
            idempotency_key=idempotency_key(key, step),
            deadline=deadline,
            http=self.client(handler, asynchronous=asynchronous),
            model=model,
        )

    def close(self) -> None:
        with self._lock:
            clients, self._clients = [c for _, c in self._clients.values()], {}
            shards, self._shards = list(self._shards.values()), {}
        for client in clients:
            _close(client)
        for shard in shards:
            shard.close()


#: Connections per async client. httpcore's pool matches each waiting request against every
#: connection (and polls each idle one) on every change: its cost grows with the square of the
#: pool. Many small clients carry many calls at once about ten times faster than one large one
#: (docs/decisions/hot-path-costs.md).
ASYNC_CLIENT_CONNECTIONS = 4


class _Shards:
    """A destination's async clients: as many small clients as its pool needs; each call gets
    the least busy one, so no call waits for a connection while another client has one free."""

    def __init__(self, handler: Handler, pool_size: int, send_bound: bool) -> None:
        self.handler = handler
        self._hooks: dict[str, list[Callable[..., Any]]] = (
            {
                "request": [_check_send_bound_async],
                "response": [functools.partial(_note_status_async, handler.destination)],
            }
            if send_bound
            else {}
        )
        self.clients = [self._client() for _ in range(-(-pool_size // ASYNC_CLIENT_CONNECTIONS))]
        self.busy = [0] * len(self.clients)
        #: Clients replaced because their pool was stuck (:func:`_stuck`).
        self.replaced = 0

    def _client(self) -> httpx.AsyncClient:
        size = ASYNC_CLIENT_CONNECTIONS
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        context = _ssl_context()
        client = httpx.AsyncClient(
            timeout=self.handler.timeouts(),
            event_hooks=self._hooks,
            verify=context,
            limits=limits,
            transport=netio.transport(context, limits),
        )
        _skip_cookieless(client)
        _track(client)
        return client

    def closed(self) -> bool:
        return any(c.is_closed for c in self.clients)

    def lend(self) -> httpx.AsyncClient:
        i = min(range(len(self.busy)), key=self.busy.__getitem__)
        if self.busy[i] == 0 and _stuck(self.clients[i]):
            # httpcore 1.0 can leave a pool's connections taken by requests that were cancelled
            # (as a call past its end bound is): every later request of that client would wait
            # out its pool timeout, a release without a call, for good. Nothing of ours uses it.
            stuck, self.clients[i] = self.clients[i], self._client()
            self.replaced += 1
            logger.warning(
                "the HTTP client of %s had connections held by no call; replaced with a new one",
                self.handler.destination,
                extra={"destination": self.handler.destination},
            )
            _close(stuck)
        self.busy[i] += 1
        return self.clients[i]

    def give_back(self, client: Any) -> bool:
        for i, mine in enumerate(self.clients):
            if mine is client:
                self.busy[i] = max(0, self.busy[i] - 1)
                return True
        return False

    def close(self) -> None:
        for client in self.clients:
            _close(client)


def _stuck(client: httpx.AsyncClient) -> bool:
    """Whether ``client``, lent to no call, still has a connection in use or a request waiting
    for one: held by requests whose tasks are gone."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    if pool is None:
        return False
    try:
        busy = [c for c in pool.connections if not c.is_idle() and not c.is_closed()]
        return bool(busy) or bool(getattr(pool, "_requests", ()))
    except Exception:
        return False


class _Cookies(httpx.Cookies):
    """httpx's cookie jar, which reads an answer's cookies only when it sets some: httpx builds
    urllib's request and response wrappers for every answer to look for them, about 2% of an
    async worker's CPU, and a provider's API answer rarely sets one. What is kept and sent is
    the same."""

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers:
            super().extract_cookies(response)


def _skip_cookieless(client: httpx.Client | httpx.AsyncClient) -> None:
    client._cookies = _Cookies(client.cookies)


def _track(client: httpx.Client | httpx.AsyncClient) -> None:
    with _all_clients_lock:
        _all_clients.append(client)


def _close(client: httpx.Client | httpx.AsyncClient) -> None:
    with _all_clients_lock:
        _all_clients[:] = [c for c in _all_clients if c is not client]
    _close_client(client)


_registry: dict[str, Handler] = {}
_registry_lock = threading.Lock()


#: What a ``Retry-After`` may hold back: the row's retry, or the whole destination.
RETRY_AFTER_SCOPES = ("row", "destination")


def handler(
    destination: str,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT_SECONDS,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    backoff: Sequence[float] = DEFAULT_BACKOFF_SECONDS,
    idempotent: bool = False,
    key_ttl: float = DEFAULT_KEY_TTL_SECONDS,
    lease_seconds: float | None = None,
    classify: Callable[[BaseException], str | None] | None = None,
    retry_after_scope: str = "row",
    breaker: Breaker | None = DEFAULT_BREAKER,
    payload_model: Any = None,
    upgrades: Mapping[int, payloads.Upgrade] | None = None,
    on_failed_head: str = "block",
    max_in_flight: int | None = None,
    max_calls_per_second: float | None = None,
) -> Callable[[Callable[[Delivery], Any]], Handler]:
    """Declare the handler of ``destination`` (all timings in seconds).

    ``time_limit`` bounds one call, in total (the worker stops waiting for it at that point);
    the lease (default ``time_limit + max(15, time_limit)``) must be longer by at least 1 s, so
    that the reconciler never takes over a call still under way.
    ``idempotent=True`` says the provider deduplicates on our Idempotency-Key, which makes an
    ambiguous outcome safe to retry. The total of the backoffs must stay under ``key_ttl``.
    ``retry_after_scope="destination"`` says a 429/503's ``Retry-After`` speaks for every request
    to the provider (an account-wide rate limit, a service down): the worker then pauses the whole
    destination that long, not only the row's retry.
    ``breaker`` (default ``Breaker()``: 5 consecutive connect errors, 429s or 503s within 60 s
    open it for 10 s, then 20, 40, … up to 300 s between probes) holds the whole destination back
    while its provider does not take requests, instead of letting every row spend its attempts;
    ``breaker=None`` turns it off (docs/handlers.md).
    ``payload_model`` (a pydantic model) validates each payload before its call: an invalid one
    fails its row, never retried; ``upgrades={1: fn}`` turn older payload versions into the
    current shape first (outbox.payloads, docs/payloads.md).
    ``on_failed_head="skip"``: a row written with an ``ordering_key`` that fails for certain lets
    the rows of its key behind it go; by default ("block") the key waits for an operator
    (outbox.ordering, docs/ordering.md). An ``unknown`` or ``in_flight`` row always blocks.
    ``max_in_flight=N``: at most N calls of the destination at once, over every worker process
    (outbox.limits, docs/flow-control.md); the lowest that live workers declare holds, and
    ``outbox limit D --in-flight N`` overrides it without a deploy.
    ``max_calls_per_second=R`` (may be fractional: 0.5 is one call every 2 s): the calls of the
    destination start at most R a second over every worker, spaced 1/R s apart, a group's calls
    included; the lowest live declaration holds, ``outbox limit D --per-second R`` overrides it.
    A declaration with any of :meth:`Handler.problems` raises ConfigError listing them all.
    """
    valid_limit = isinstance(time_limit, int | float) and time_limit > 0
    lease = lease_seconds
    if lease is None and valid_limit:
        lease = default_lease_seconds(float(time_limit))
    problems = declaration_problems(
        destination,
        time_limit=time_limit,
        max_attempts=max_attempts,
        backoff=backoff,
        key_ttl=key_ttl,
        lease_seconds=lease,
    )
    if retry_after_scope not in RETRY_AFTER_SCOPES:
        problems.append(f"retry_after_scope must be 'row' or 'destination', got {retry_after_scope!r}")
    if breaker is not None and not isinstance(breaker, Breaker):
        problems.append(f"breaker must be an outbox.Breaker or None, got {breaker!r}")
    elif breaker is not None:
        problems.extend(f"{destination}: {p}" for p in breaker.problems())
    problems.extend(f"{destination}: {p}" for p in payloads.declaration_problems(payload_model, upgrades))
    if on_failed_head not in ON_FAILED_HEAD:
        problems.append(f"on_failed_head must be 'block' or 'skip', got {on_failed_head!r}")
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        problems.append(f"max_in_flight must be a positive int or None, got {max_in_flight!r}")
    if max_calls_per_second is not None and (
        isinstance(max_calls_per_second, bool)
        or not isinstance(max_calls_per_second, int | float)
        or not MIN_CALLS_PER_SECOND <= max_calls_per_second <= MAX_CALLS_PER_SECOND
    ):
        problems.append(
            f"max_calls_per_second must be a number from {MIN_CALLS_PER_SECOND} to {MAX_CALLS_PER_SECOND}, "
            f"or None, got {max_calls_per_second!r}"
        )
    if problems:
        raise ConfigError("handler " + "; ".join(problems))
    assert lease is not None

    def register(fn: Callable[[Delivery], Any]) -> Handler:
        h = Handler(
            destination=destination,
            fn=fn,
            time_limit=float(time_limit),
            max_attempts=max_attempts,
            backoff=tuple(float(b) for b in backoff),
            idempotent=idempotent,
            key_ttl=float(key_ttl),
            lease_seconds=float(lease),
            classify=classify,
            retry_after_scope=retry_after_scope,
            breaker=breaker,
            payload_model=payload_model,
            upgrades=dict(upgrades) if upgrades else None,
            on_failed_head=on_failed_head,
            max_in_flight=max_in_flight,
            max_calls_per_second=float(max_calls_per_second) if max_calls_per_second is not None else None,
        )
        with _registry_lock:
            existing = _registry.get(destination)
            # The same function registering again is a module reload, not a second handler.
            same = existing is not None and (existing.fn.__module__, existing.fn.__qualname__) == (
                fn.__module__,
                fn.__qualname__,
            )
            if existing is not None and not same:
                raise ConfigError(
                    f"destination {destination!r} already has a handler "
                    f"({existing.fn.__module__}.{existing.fn.__qualname__})"
                )
            _registry[destination] = h
        return h

    return register


def registry() -> dict[str, Handler]:
    return dict(_registry)


def registered(destination: str) -> Handler | None:
    """The handler of ``destination`` if this process imported it (``write`` asks, per row)."""
    return _registry.get(destination)


def load_module(name: str) -> dict[str, Handler]:
    """Import the user's handler module and return the handlers it declared."""
    try:
        import_user_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ConfigError(
                f"cannot import handler module {name!r}: {exc}; run the command from the directory "
                "that holds it, or put that directory on PYTHONPATH"
            ) from exc
        raise
    handlers = registry()
    if not handlers:
        raise ConfigError(f"module {name!r} declares no @outbox.handler")
    return handlers


def clear_registry() -> None:
    """For tests: forget every declared handler."""
    with _registry_lock:
        _registry.clear()
        _lookups.clear()
        _thens.clear()
        _on_failures.clear()


@contextlib.contextmanager
def isolated_registry() -> Iterator[None]:
    """For tests: handlers and lookups declared inside are forgotten on exit; those declared
    before (a handler module imported by the test file) are what they were."""
    with _registry_lock:
        tables: tuple[dict[str, Any], ...] = (_registry, _lookups, _thens, _on_failures)
        saved = [(table, dict(table)) for table in tables]
    try:
        yield
    finally:
        with _registry_lock:
            for table, content in saved:
                table.clear()
                table.update(content)
