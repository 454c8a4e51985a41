"""The consumer API: ``@handler`` declarations, ``Delivery`` and ``Confirmed``.

Declarations are checked when the module is imported, so a bad timing fails the deploy, not a
payment at three in the morning.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from .exceptions import ConfigError, RetryableError
from .validation import destination_problem

DEFAULT_TIME_LIMIT_SECONDS = 30.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF_SECONDS: tuple[float, ...] = (10.0, 60.0, 300.0)
#: How long providers keep an Idempotency-Key (Stripe: 24 h).
DEFAULT_KEY_TTL_SECONDS = 86400.0
#: The least ``lease_seconds - time_limit`` a handler may declare: below it, the claim's own round
#: trip would eat the room the record needs after the call's deadline.
MIN_LEASE_MARGIN_SECONDS = 1.0
#: The most lease beyond ``time_limit`` a worker keeps for the record (see ``start_margin_seconds``).
MAX_START_MARGIN_SECONDS = 5.0


@dataclass(frozen=True)
class Confirmed:
    """What a handler returns when the provider confirmed the effect."""

    ref: str
    response: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ref, str) or not self.ref:
            raise TypeError(f"Confirmed.ref must be the provider's non-empty reference, got {self.ref!r}")


_clients = threading.local()
#: The monotonic instant after which ``Delivery.http`` sends no request from this thread (set by
#: the worker around each call): a process paused after its start check (SIGSTOP, a VM stall)
#: must not send once its lease may have run out.
_send_bound = threading.local()


def set_send_bound(not_after: float | None) -> None:
    _send_bound.not_after = not_after


def _check_send_bound(request: httpx.Request) -> None:
    not_after = getattr(_send_bound, "not_after", None)
    if not_after is not None and time.monotonic() > not_after:
        raise RetryableError(
            "the request was not sent: the call ran out of lease before it could send "
            "(the worker was paused or starved)"
        )


_all_clients: list[httpx.Client] = []
_all_clients_lock = threading.Lock()


def close_http_clients() -> None:
    """Close every thread's provider client (once the worker threads have stopped)."""
    with _all_clients_lock:
        clients, _all_clients[:] = list(_all_clients), []
    for client in clients:
        client.close()


def close_thread_http_clients() -> None:
    """Close the calling thread's provider clients (a thread that is about to end)."""
    clients: dict[str, httpx.Client] = getattr(_clients, "by_destination", None) or {}
    _clients.by_destination = {}
    with _all_clients_lock:
        _all_clients[:] = [c for c in _all_clients if all(c is not mine for mine in clients.values())]
    for client in clients.values():
        client.close()


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
    """One claimed outbox row, as a handler sees it."""

    id: int
    key: str
    step: str
    destination: str
    payload: dict[str, Any]
    attempt: int
    idempotency_key: str
    deadline: datetime | None
    handler: Handler = field(repr=False)

    @property
    def http(self) -> httpx.Client:
        """A per-thread client whose timeouts add up to less than the handler's time_limit."""
        return self.handler.http_client()


@dataclass
class Handler:
    destination: str
    fn: Callable[[Delivery], Any]
    time_limit: float
    max_attempts: int
    backoff: tuple[float, ...]
    idempotent: bool
    key_ttl: float
    lease_seconds: float
    lookup_fn: Callable[[Delivery], Confirmed | None] | None = None
    #: Optional override: exception -> "sent" | "retry" | "failed" | "unknown" | None (default).
    classify: Callable[[BaseException], str | None] | None = None

    def __call__(self, delivery: Delivery) -> Any:
        return self.fn(delivery)

    def lookup(self, fn: Callable[[Delivery], Confirmed | None]) -> Callable[[Delivery], Confirmed | None]:
        """Register how to ask the provider whether an earlier call took effect."""
        self.lookup_fn = fn
        return fn

    @property
    def start_margin_seconds(self) -> float:
        """Lease a call must leave over for its record: a worker starts no call with less than
        ``time_limit`` plus this left, by its own clock since it sent the claim. Half the lease's
        margin over ``time_limit``, at most 5 s; the other half absorbs the claim's own wait."""
        return min(MAX_START_MARGIN_SECONDS, (self.lease_seconds - self.time_limit) / 2)

    @property
    def call_deadline_seconds(self) -> float:
        """When the worker stops waiting for a call: ``time_limit``, which the timeouts of
        ``d.http`` add up to, plus half the start margin, so that a timeout firing at the limit
        is still classified by its kind (a connect timeout was certainly not sent). The record
        keeps the other half of the margin."""
        return self.time_limit + self.start_margin_seconds / 2

    def backoff_seconds(self, attempt: int) -> float:
        """Delay before attempt ``attempt + 1`` (attempt counts from 1)."""
        return self.backoff[min(attempt - 1, len(self.backoff) - 1)]

    def total_backoff_seconds(self) -> float:
        return sum(self.backoff_seconds(a) for a in range(1, self.max_attempts))

    def timeouts(self) -> httpx.Timeout:
        # connect + write + read stays inside time_limit even when each phase takes its maximum.
        tl = self.time_limit
        return httpx.Timeout(connect=tl * 0.2, write=tl * 0.2, read=tl * 0.55, pool=tl * 0.05)

    def http_client(self) -> httpx.Client:
        clients: dict[str, httpx.Client] | None = getattr(_clients, "by_destination", None)
        if clients is None:
            clients = _clients.by_destination = {}
        client = clients.get(self.destination)
        if client is None or client.is_closed:
            client = clients[self.destination] = httpx.Client(
                timeout=self.timeouts(), event_hooks={"request": [_check_send_bound]}
            )
            with _all_clients_lock:
                _all_clients.append(client)
        return client


_registry: dict[str, Handler] = {}
_registry_lock = threading.Lock()


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
) -> Callable[[Callable[[Delivery], Any]], Handler]:
    """Declare the handler of ``destination`` (all timings in seconds).

    ``time_limit`` bounds one call, in total (the worker stops waiting for it at that point);
    the lease (default ``time_limit + max(15, time_limit)``) must be longer by at least 1 s, so
    that the reconciler never takes over a call still under way.
    ``idempotent=True`` says the provider deduplicates on our Idempotency-Key, which makes an
    ambiguous outcome safe to retry. The total of the backoffs must stay under ``key_ttl``.
    """
    problem = destination_problem(destination)
    if problem is not None:
        raise ConfigError(f"handler {problem}")
    if not time_limit or time_limit <= 0:
        raise ConfigError(f"handler {destination}: time_limit must be > 0 seconds, got {time_limit!r}")
    if not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigError(f"handler {destination}: max_attempts must be a whole number >= 1")
    delays = tuple(float(b) for b in backoff)
    if not delays or any(b <= 0 for b in delays):
        raise ConfigError(
            f"handler {destination}: every backoff entry must be > 0 seconds, got {tuple(backoff)!r}"
        )
    lease = float(lease_seconds) if lease_seconds is not None else time_limit + max(15.0, time_limit)
    if lease <= time_limit:
        raise ConfigError(
            f"handler {destination}: lease_seconds ({lease:g}) must be longer than time_limit "
            f"({time_limit:g}), or the reconciler could take over a call still under way"
        )
    if lease - time_limit < MIN_LEASE_MARGIN_SECONDS:
        raise ConfigError(
            f"handler {destination}: lease_seconds ({lease:g}) must exceed time_limit ({time_limit:g}) "
            f"by at least {MIN_LEASE_MARGIN_SECONDS:g} s, the room the claim's round trip and the "
            "record need around the call"
        )

    def register(fn: Callable[[Delivery], Any]) -> Handler:
        h = Handler(
            destination=destination,
            fn=fn,
            time_limit=float(time_limit),
            max_attempts=max_attempts,
            backoff=delays,
            idempotent=idempotent,
            key_ttl=float(key_ttl),
            lease_seconds=lease,
            classify=classify,
        )
        if h.total_backoff_seconds() >= key_ttl:
            raise ConfigError(
                f"handler {destination}: the backoffs add up to {h.total_backoff_seconds():g} s over "
                f"{max_attempts} attempts, not under key_ttl ({key_ttl:g} s); the provider would "
                "forget the Idempotency-Key before the last retry"
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


def load_module(name: str) -> dict[str, Handler]:
    """Import the user's handler module and return the handlers it declared."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ConfigError(f"cannot import handler module {name!r}: {exc}; is it on PYTHONPATH?") from exc
        raise
    handlers = registry()
    if not handlers:
        raise ConfigError(f"module {name!r} declares no @outbox.handler")
    return handlers


def clear_registry() -> None:
    """For tests: forget every declared handler."""
    with _registry_lock:
        _registry.clear()
