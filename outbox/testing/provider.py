"""A payment provider simulator: a real HTTP server on loopback for tests, benchmarks and demos.

The simulator charges cards the way a real provider would, except that it can be told to
misbehave: fail before or after charging, drop the connection after charging, hang after
charging, or answer garbage. Every side effect is counted per idempotency key, so a test can
assert "exactly one charge per key" and see precisely which keys were charged twice.

HTTP interface::

    POST /charges                       Idempotency-Key header required; JSON object body
    GET  /charges?idempotency_key=K     the latest charge for K, or 404
    GET  /_stats                        effect counters (see ``ProviderSimulator.stats``)
    POST /_config                       update configuration; answers the whole config
    POST /_reset                        forget charges and counters, restore the start config

Command line (``outbox provider`` takes the same options)::

    python -m outbox.testing.provider --port 8099 --dedupe --ready-file /tmp/provider.url
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import email.utils
import json
import logging
import math
import os
import random
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Literal, cast
from urllib.parse import parse_qs, urlsplit

__all__ = ["FAULT_MODES", "ProviderSimulator", "main"]

logger = logging.getLogger(__name__)

FaultMode = Literal["decline", "fail_before", "fail_after", "drop_after", "hang_after", "garbage"]
FAULT_MODES: Final[tuple[FaultMode, ...]] = (
    "decline",
    "fail_before",
    "fail_after",
    "drop_after",
    "hang_after",
    "garbage",
)

_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "::1"})
_GARBAGE_BODY: Final = b"not json{"
# A request body larger than this is not a charge; refusing it keeps a buggy client from
# making the simulator allocate unbounded memory.
_MAX_BODY_BYTES: Final = 1 << 20
# Bounded so that stop() returns even if a handler is stuck somewhere unexpected.
_STOP_JOIN_SECONDS: Final = 5.0


#: How many charge arrival times the simulator keeps (ProviderSimulator.arrivals).
ARRIVALS_KEPT = 100_000


class _BadRequest(Exception):
    """A client error that becomes a 400 answer naming the problem."""


@dataclass
class _Config:
    dedupe: bool = False
    latency_ms: float = 0.0
    decline_rate: float = 0.0
    fail_before_rate: float = 0.0
    fail_after_rate: float = 0.0
    drop_after_rate: float = 0.0
    hang_after_rate: float = 0.0
    hang_seconds: float = 30.0
    lookup_fail: bool = False
    seed: int | None = None
    fault_keys: dict[str, FaultMode] = field(default_factory=dict)
    # Faults for the next charges, whatever their key, one each in order: "the first call
    # drops after charging, the retry goes through" without knowing the key.
    fault_next: list[FaultMode] = field(default_factory=list)
    # Raw JSON object text whose members are appended to every charge the simulator answers
    # (POST and lookup), verbatim: lets a test send what a real provider might, such as
    # "\u0000", NaN, 1e400 or a card number, which json.dumps would refuse or rewrite.
    response_extra: str = ""
    # The Retry-After header of a 503 "not processed" answer: seconds ("120"), an HTTP date
    # that many seconds after the answer's own Date header ("+90"), or verbatim; "" for none.
    retry_after: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["fault_keys"] = dict(self.fault_keys)
        out["fault_next"] = list(self.fault_next)
        return out


_CONFIG_FIELDS: Final = frozenset(f.name for f in fields(_Config))
_RATE_FIELDS: Final = frozenset(
    {"decline_rate", "fail_before_rate", "fail_after_rate", "drop_after_rate", "hang_after_rate"}
)


def _as_bool(name: str, value: object) -> bool:
    # Strict: "false" or 0 silently meaning something would hide mistakes in test setup.
    if not isinstance(value, bool):
        raise ValueError(f"config field {name!r} must be a boolean, got {value!r}")
    return value


def _as_number(name: str, value: object) -> float:
    # bool is an int subclass; True as a rate is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"config field {name!r} must be a finite number >= 0, got {value!r}")
    if name in _RATE_FIELDS and number > 1:
        raise ValueError(f"config field {name!r} must be between 0 and 1, got {value!r}")
    return number


def _as_fault_keys(value: object) -> dict[str, FaultMode]:
    if not isinstance(value, Mapping):
        raise ValueError(f"config field 'fault_keys' must be an object, got {value!r}")
    out: dict[str, FaultMode] = {}
    for key, mode in value.items():
        if not isinstance(key, str) or mode not in FAULT_MODES:
            raise ValueError(
                f"config field 'fault_keys' maps idempotency keys to one of "
                f"{', '.join(FAULT_MODES)}; got {key!r}: {mode!r}"
            )
        out[key] = cast(FaultMode, mode)
    return out


def _as_fault_next(value: object) -> list[FaultMode]:
    if not isinstance(value, list) or any(mode not in FAULT_MODES for mode in value):
        raise ValueError(f"config field 'fault_next' is a list of {', '.join(FAULT_MODES)}; got {value!r}")
    return [cast(FaultMode, mode) for mode in value]


def _as_response_extra(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"config field 'response_extra' must be a string, got {value!r}")
    if value.strip():
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("config field 'response_extra' must be a JSON object's text") from None
        if not isinstance(parsed, dict):
            raise ValueError("config field 'response_extra' must be a JSON object's text")
    return value.strip()


def _apply_config(config: _Config, updates: Mapping[str, object]) -> _Config:
    """Validate every field before changing anything, so a bad update has no partial effect."""
    unknown = sorted(set(updates) - _CONFIG_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown config field(s): {', '.join(unknown)}; "
            f"known fields: {', '.join(sorted(_CONFIG_FIELDS))}"
        )
    new = replace(config, fault_keys=dict(config.fault_keys), fault_next=list(config.fault_next))
    for name, value in updates.items():
        if name in ("dedupe", "lookup_fail"):
            setattr(new, name, _as_bool(name, value))
        elif name == "seed":
            # None reseeds from system randomness, like random.seed(None).
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"config field 'seed' must be an integer or null, got {value!r}")
            new.seed = value
        elif name == "response_extra":
            new.response_extra = _as_response_extra(value)
        elif name == "retry_after":
            if not isinstance(value, str):
                raise ValueError(f"config field 'retry_after' must be a string, got {value!r}")
            if value.startswith("+"):
                try:
                    _as_number(name, float(value[1:]))
                except ValueError:
                    raise ValueError(f"config field 'retry_after' {value!r}: '+' precedes seconds") from None
            new.retry_after = value
        elif name == "fault_keys":
            # Merged rather than replaced, so a test can arm faults one key at a time.
            new.fault_keys.update(_as_fault_keys(value))
        elif name == "fault_next":
            new.fault_next = _as_fault_next(value)
        else:
            setattr(new, name, _as_number(name, value))
    return new


@dataclass
class _Outcome:
    """What the handler must do once the state lock is released."""

    status: int
    body: dict[str, Any]
    fault: FaultMode | None = None


class _State:
    """All mutable simulator state, behind one lock: handlers run on many threads."""

    def __init__(self, baseline: _Config) -> None:
        self._lock = threading.Lock()
        self._baseline = baseline
        self._rng = random.Random()
        self._in_flight = 0
        self._lookups_in_flight = 0
        self._clear()

    def _clear(self) -> None:
        self._config = replace(
            self._baseline,
            fault_keys=dict(self._baseline.fault_keys),
            fault_next=list(self._baseline.fault_next),
        )
        self._rng.seed(self._baseline.seed)
        self._next_id = 1
        self._charges: dict[str, dict[str, Any]] = {}
        self._effects: dict[str, int] = {}
        #: The last W3C ``traceparent`` header received with a charge, by Idempotency-Key.
        self._traceparents: dict[str, str] = {}
        self._requests = 0
        self._deduplicated = 0
        self._declined = 0
        self._faults: dict[str, int] = dict.fromkeys(FAULT_MODES, 0)
        #: The most charges served at once since the reset (the requests in flight are not reset).
        self._most_in_flight = self._in_flight
        #: The charge requests that arrived within the last second (monotonic times), and the
        #: most that any sliding one-second window held since the reset.
        self._last_second: collections.deque[float] = collections.deque()
        self._most_in_one_second = 0
        #: When each charge request arrived (monotonic), the latest ARRIVALS_KEPT of them.
        self._arrivals: collections.deque[float] = collections.deque(maxlen=ARRIVALS_KEPT)
        #: The same for lookups (``GET /charges``).
        self._most_lookups_in_flight = self._lookups_in_flight
        self._lookups = 0

    def config(self) -> _Config:
        with self._lock:
            return replace(
                self._config,
                fault_keys=dict(self._config.fault_keys),
                fault_next=list(self._config.fault_next),
            )

    def configure(self, updates: Mapping[str, object]) -> dict[str, Any]:
        with self._lock:
            self._config = _apply_config(self._config, updates)
            if "seed" in updates:
                self._rng.seed(self._config.seed)
            return self._config.as_dict()

    def reset(self) -> None:
        with self._lock:
            self._clear()

    def clear_fault_keys(self) -> None:
        with self._lock:
            self._config.fault_keys.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "effects": dict(self._effects),
                "charges": sum(self._effects.values()),
                "requests": self._requests,
                "deduplicated": self._deduplicated,
                "declined": self._declined,
                "double_charged": sorted(k for k, n in self._effects.items() if n > 1),
                "faults": dict(self._faults),
                "traceparents": dict(self._traceparents),
                "most_in_flight": self._most_in_flight,
                "in_flight": self._in_flight,
                "most_in_one_second": self._most_in_one_second,
                "lookups": self._lookups,
                "most_lookups_in_flight": self._most_lookups_in_flight,
            }

    def enter(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._in_flight += 1
            self._most_in_flight = max(self._most_in_flight, self._in_flight)
            window = self._last_second
            while window and window[0] <= now - 1.0:
                window.popleft()
            window.append(now)
            self._most_in_one_second = max(self._most_in_one_second, len(window))
            self._arrivals.append(now)

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def arrivals(self) -> list[float]:
        with self._lock:
            return list(self._arrivals)

    def enter_lookup(self) -> None:
        with self._lock:
            self._lookups += 1
            self._lookups_in_flight += 1
            self._most_lookups_in_flight = max(self._most_lookups_in_flight, self._lookups_in_flight)

    def leave_lookup(self) -> None:
        with self._lock:
            self._lookups_in_flight -= 1

    def count_request(self) -> None:
        with self._lock:
            self._requests += 1

    def note_traceparent(self, key: str, traceparent: str | None) -> None:
        if traceparent:
            with self._lock:
                self._traceparents[key] = traceparent

    def lookup(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            charge = self._charges.get(key)
            return dict(charge) if charge is not None else None

    def charge(self, key: str, body: Mapping[str, Any]) -> _Outcome:
        with self._lock:
            cfg = self._config
            # A keyed fault wins over random ones so tests stay deterministic whatever the rates.
            fault = cfg.fault_keys.pop(key, None)
            if fault is None and cfg.fault_next:
                fault = cfg.fault_next.pop(0)
            if fault is None and self._rng.random() < cfg.fail_before_rate:
                fault = "fail_before"
            # Drawn only when asked for, so seeded runs without declines keep their sequence.
            if fault is None and cfg.decline_rate and self._rng.random() < cfg.decline_rate:
                fault = "decline"
            if fault == "decline":
                self._faults["decline"] += 1
                self._declined += 1
                return _Outcome(402, {"error": "card declined"}, "decline")
            if fault == "fail_before":
                self._faults["fail_before"] += 1
                return _Outcome(503, {"error": "provider unavailable (simulated)"}, "fail_before")

            if fault is None:
                # One draw for all after-faults keeps each configured rate exact while
                # their sum is <= 1.
                draw = self._rng.random()
                threshold = 0.0
                after: tuple[tuple[FaultMode, float], ...] = (
                    ("drop_after", cfg.drop_after_rate),
                    ("hang_after", cfg.hang_after_rate),
                    ("fail_after", cfg.fail_after_rate),
                )
                for mode, rate in after:
                    threshold += rate
                    if draw < threshold:
                        fault = mode
                        break
            if fault is not None:
                self._faults[fault] += 1

            existing = self._charges.get(key)
            if cfg.dedupe and existing is not None:
                self._deduplicated += 1
                return _Outcome(200, dict(existing), fault)

            amount = body.get("amount_cents")
            if isinstance(amount, int | float) and not isinstance(amount, bool) and amount < 0:
                self._declined += 1
                return _Outcome(402, {"error": "card declined"}, fault)

            charge: dict[str, Any] = {
                "id": f"ch_{self._next_id}",
                "idempotency_key": key,
                "amount_cents": amount,
                "currency": body.get("currency"),
                "status": "succeeded",
            }
            self._next_id += 1
            self._charges[key] = charge
            self._effects[key] = self._effects.get(key, 0) + 1
            return _Outcome(200, dict(charge), fault)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, delayed ACKs would add
    # ~40 ms to every keep-alive response.
    disable_nagle_algorithm = True
    server_version = "outbox-provider-simulator"

    @property
    def _server(self) -> _Server:
        return cast(_Server, self.server)

    def log_message(self, format: str, *args: Any) -> None:
        # One line per request would swamp benchmark output and slow the server down.
        return

    # -- plumbing -----------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            # Without Content-Length we cannot find the next request on this connection.
            self.close_connection = True
            raise _BadRequest("chunked request bodies are not supported; send Content-Length")
        raw_length = self.headers.get("Content-Length", "0")
        try:
            length = int(raw_length)
        except ValueError:
            self.close_connection = True
            raise _BadRequest(f"bad Content-Length {raw_length!r}") from None
        if length < 0 or length > _MAX_BODY_BYTES:
            self.close_connection = True
            raise _BadRequest(f"Content-Length {length} out of range")
        return self.rfile.read(length) if length else b""

    def _read_json_object(self) -> dict[str, Any]:
        raw = self._read_body()
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("request body is not valid JSON") from None
        if not isinstance(value, dict):
            raise _BadRequest("request body must be a JSON object")
        return value

    def _send(self, status: int, payload: bytes, headers: Mapping[str, str] | None = None) -> None:
        try:
            self.send_response_only(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            # The client gave up (e.g. its read timeout fired during a hang); nothing to tell.
            self.close_connection = True

    def _send_json(self, status: int, body: Mapping[str, Any]) -> None:
        self._send(status, json.dumps(body, separators=(",", ":")).encode())

    def _send_charge(self, status: int, body: Mapping[str, Any]) -> None:
        config = self._server.state.config()
        extra = config.response_extra if status == 200 else ""
        text = json.dumps(body, separators=(",", ":"))
        if extra and extra != "{}" and text.endswith("}"):
            text = text[:-1] + ("," if len(text) > 2 else "") + extra.strip()[1:]
        headers = {}
        if status == 503 and config.retry_after:
            now = time.time()
            headers["Date"] = email.utils.formatdate(now, usegmt=True)
            if config.retry_after.startswith("+"):
                later = now + float(config.retry_after[1:])
                headers["Retry-After"] = email.utils.formatdate(later, usegmt=True)
            else:
                headers["Retry-After"] = config.retry_after
        self._send(status, text.encode(), headers)

    def _drop(self) -> None:
        # Simulates a response lost on the wire: the charge happened, the client never hears.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.connection.close()

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; True means the server is stopping."""
        return seconds > 0 and self._server.stopping.wait(seconds)

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        routes = {
            ("POST", "/charges"): self._post_charge,
            ("GET", "/charges"): self._get_charge,
            ("GET", "/_stats"): self._get_stats,
            ("POST", "/_config"): self._post_config,
            ("POST", "/_reset"): self._post_reset,
        }
        try:
            route = routes.get((method, path))
            if route is None:
                # Drain any body so the keep-alive connection stays in sync.
                self._read_body()
                self._send_json(404, {"error": f"no route for {method} {path}"})
                return
            route()
        except _BadRequest as exc:
            self._send_json(400, {"error": str(exc)})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- routes -------------------------------------------------------------------------

    def _post_charge(self) -> None:
        state = self._server.state
        state.count_request()
        state.enter()
        try:
            self._charge(state)
        finally:
            state.leave()

    def _charge(self, state: _State) -> None:
        config = state.config()
        if self._sleep(config.latency_ms / 1000):
            self._drop()
            return
        body = self._read_json_object()
        key = self.headers.get("Idempotency-Key", "").strip()
        if not key:
            raise _BadRequest("missing Idempotency-Key header")
        state.note_traceparent(key, self.headers.get("traceparent"))

        outcome = state.charge(key, body)
        if outcome.fault in (None, "fail_before", "decline"):
            self._send_charge(outcome.status, outcome.body)
        elif outcome.fault == "fail_after":
            self._send_json(500, {"error": "internal error after charging (simulated)"})
        elif outcome.fault == "drop_after":
            self._drop()
        elif outcome.fault == "garbage":
            self._send(200, _GARBAGE_BODY)
        elif outcome.fault == "hang_after":
            if self._sleep(state.config().hang_seconds):
                self._drop()
            else:
                self._send_charge(outcome.status, outcome.body)

    def _get_charge(self) -> None:
        state = self._server.state
        state.enter_lookup()
        try:
            self._look_up(state)
        finally:
            state.leave_lookup()

    def _look_up(self, state: _State) -> None:
        self._read_body()
        config = state.config()
        if self._sleep(config.latency_ms / 1000):
            self._drop()
            return
        if config.lookup_fail:
            self._send_json(503, {"error": "lookup unavailable (simulated)"})
            return
        keys = parse_qs(urlsplit(self.path).query).get("idempotency_key")
        if not keys or not keys[0]:
            raise _BadRequest("missing idempotency_key query parameter")
        charge = self._server.state.lookup(keys[0])
        if charge is None:
            self._send_json(404, {"error": "no such charge"})
        else:
            self._send_charge(200, charge)

    def _get_stats(self) -> None:
        self._read_body()
        self._send_json(200, self._server.state.stats())

    def _post_config(self) -> None:
        updates = self._read_json_object()
        try:
            config = self._server.state.configure(updates)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
        self._send_json(200, config)

    def _post_reset(self) -> None:
        self._read_body()
        self._server.state.reset()
        self._send_json(200, {"reset": True})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # We join handler threads ourselves, with a bound, in close_all(); the stdlib join has none.
    block_on_close = False
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, state: _State) -> None:
        self.address_family = family
        self.state = state
        self.stopping = threading.Event()
        self._tracked_lock = threading.Lock()
        self._tracked_conns: set[socket.socket] = set()
        self._tracked_threads: set[threading.Thread] = set()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS lookup we do not need.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._run_request,
            args=(request, client_address),
            name=f"provider-sim-{client_address}",
            daemon=True,
        )
        with self._tracked_lock:
            self._tracked_conns.add(request)
            self._tracked_threads.add(thread)
        thread.start()

    def _run_request(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._tracked_lock:
                self._tracked_conns.discard(request)
                self._tracked_threads.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr; client disconnects are routine here.
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            logger.debug("client %s disconnected: %s", client_address, exc)
        else:
            logger.exception("provider simulator handler failed for %s", client_address)

    def close_all(self) -> None:
        """Wake sleeping handlers and cut idle keep-alive connections, then join handlers."""
        self.stopping.set()
        with self._tracked_lock:
            conns = list(self._tracked_conns)
            threads = list(self._tracked_threads)
        for conn in conns:
            # Unblocks handlers waiting in readline() for the next keep-alive request.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(_STOP_JOIN_SECONDS)
            if thread.is_alive():
                logger.warning("provider simulator handler %s did not stop", thread.name)


def _resolve_loopback(host: str, *, any_address: bool = False) -> tuple[str, socket.AddressFamily]:
    if host not in _LOOPBACK_HOSTS:
        if any_address:
            # Asked for on the command line (a compose network): the caller chose to expose it.
            return host, socket.AF_INET6 if ":" in host else socket.AF_INET
        raise ValueError(
            f"the provider simulator only binds loopback (127.0.0.1, localhost, ::1), not {host!r}"
        )
    if host == "::1":
        return host, socket.AF_INET6
    # "localhost" may resolve to ::1 or 127.0.0.1 depending on the system; pin it.
    return "127.0.0.1", socket.AF_INET


class ProviderSimulator:
    """A fake payment provider served over HTTP on loopback.

    Use as a context manager::

        with ProviderSimulator(dedupe=True) as provider:
            httpx.post(f"{provider.url}/charges", json={...}, headers={"Idempotency-Key": k})
            assert provider.stats()["double_charged"] == []

    ``reset()`` (and ``POST /_reset``) restores the configuration given to the constructor.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, dedupe: bool = False, any_address: bool = False
    ) -> None:
        self._host, self._family = _resolve_loopback(host, any_address=any_address)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {port}")
        self._port = port
        self._state = _State(_apply_config(_Config(), {"dedupe": dedupe}))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def _with_config(
        cls, host: str, port: int, config: Mapping[str, object], *, any_address: bool = False
    ) -> ProviderSimulator:
        sim = cls(host, port, any_address=any_address)
        sim._state = _State(_apply_config(_Config(), config))
        return sim

    def start(self) -> ProviderSimulator:
        """Bind and serve in a daemon thread; returns self so ``start()`` can be chained."""
        if self._server is not None:
            raise RuntimeError("provider simulator already started")
        server = _Server((self._host, self._port), self._family, self._state)
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="provider-simulator",
            daemon=True,
        )
        self._server, self._thread = server, thread
        thread.start()
        logger.debug("provider simulator listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving, cut open connections and release the port; safe to call twice."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._server = self._thread = None
        server.shutdown()
        thread.join()
        server.close_all()
        server.server_close()
        logger.debug("provider simulator stopped")

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``; only known once started."""
        if self._server is None:
            raise RuntimeError("provider simulator is not running")
        port = self._server.server_port
        host = f"[{self._host}]" if self._family == socket.AF_INET6 else self._host
        return f"http://{host}:{port}"

    def stats(self) -> dict[str, Any]:
        """Same as ``GET /_stats``.

        Keys: ``effects`` (key -> charges made), ``charges`` (sum of effects), ``requests``
        (``POST /charges`` received), ``deduplicated``, ``declined``, ``double_charged``
        (sorted keys with more than one effect), ``faults`` (mode -> times injected) and
        ``traceparents`` (key -> the last ``traceparent`` header a charge carried) and
        ``most_in_flight`` (the most charge requests it was serving at once), ``in_flight`` (how
        many it is serving now), ``most_in_one_second`` (the most charge requests that arrived
        within any sliding one-second window), ``lookups``
        (``GET /charges`` received) and ``most_lookups_in_flight`` (the most it served at once).
        """
        return self._state.stats()

    def arrivals(self) -> list[float]:
        """When each charge request arrived since the reset, on this process's monotonic clock
        (the latest ARRIVALS_KEPT): for tests of rates, in-process only."""
        return self._state.arrivals()

    def configure(self, **fields: Any) -> dict[str, Any]:
        """Same as ``POST /_config``: update fields, return the whole config.

        Raises ValueError naming an unknown or invalid field; nothing changes then.
        """
        return self._state.configure(fields)

    def reset(self) -> None:
        """Same as ``POST /_reset``: forget charges and counters, restore the start config."""
        self._state.reset()

    # -- named faults, for tests of handlers -------------------------------------------------
    # Each applies to every charge from now on (times=None: until healthy()) or to the next
    # ``times`` charges, whatever their key; keyed one-shot faults stay available through
    # configure(fault_keys={idempotency_key: mode}).

    def decline(self, times: int | None = None) -> None:
        """Answer 402 "card declined" without charging."""
        self._fault("decline", "decline_rate", times)

    def unavailable(self, times: int | None = None, *, retry_after: str | int | None = None) -> None:
        """Answer 503 without charging: the provider is down, nothing happened. With
        ``retry_after``, the answer carries that ``Retry-After`` (seconds, or ``"+N"``: an HTTP
        date N seconds after the answer's ``Date``)."""
        if retry_after is not None:
            self.configure(retry_after=str(retry_after))
        self._fault("fail_before", "fail_before_rate", times)

    def drop_after_charge(self, times: int | None = None) -> None:
        """Charge, then close the connection unanswered: the caller cannot know it charged."""
        self._fault("drop_after", "drop_after_rate", times)

    def slow(self, ms: float) -> None:
        """Wait ``ms`` milliseconds before each charge and lookup (0: no wait)."""
        self.configure(latency_ms=ms)

    def healthy(self) -> None:
        """No faults and no latency from now on; charges and counters are kept."""
        self.configure(
            decline_rate=0.0,
            fail_before_rate=0.0,
            fail_after_rate=0.0,
            drop_after_rate=0.0,
            hang_after_rate=0.0,
            latency_ms=0.0,
            lookup_fail=False,
            fault_next=[],
        )
        self._state.clear_fault_keys()

    def charges(self, idempotency_key: str | None = None) -> int:
        """Charges made (effects): in all, or for one Idempotency-Key (``key:step`` for a row)."""
        effects = self.stats()["effects"]
        return int(effects.get(idempotency_key, 0) if idempotency_key else sum(effects.values()))

    def _fault(self, mode: FaultMode, rate_field: str, times: int | None) -> None:
        if times is None:
            self.configure(**{rate_field: 1.0})
            return
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"times must be a positive integer or None, got {times!r}")
        self.configure(fault_next=[*self._state.config().fault_next, *[mode] * times])

    def __enter__(self) -> ProviderSimulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _write_ready_file(path: Path, url: str) -> None:
    # Written under a temporary name and renamed, so a poller never reads a partial URL.
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(url)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


#: The command line's description, for ``python -m outbox.testing.provider`` and ``outbox provider``.
DESCRIPTION = (
    "Run the payment provider simulator on 127.0.0.1 until SIGTERM or SIGINT. "
    "It serves POST /charges (Idempotency-Key header required), "
    "GET /charges?idempotency_key=K, GET /_stats, POST /_config and POST /_reset. "
    "Every option below can also be changed at run time through POST /_config."
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing.provider",
        description=DESCRIPTION,
        epilog=(
            "Prints 'provider listening on http://127.0.0.1:PORT' once ready. "
            "Example: python -m outbox.testing.provider --dedupe --fail-after-rate 0.1 "
            "--ready-file /tmp/provider.url"
        ),
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's options, on ``parser``."""
    parser.add_argument(
        "--port", type=int, default=0, help="TCP port to listen on (default: 0, any free port)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1). Anything but loopback exposes a test tool "
        "that charges nothing real but answers anyone: only on a private network, such as the "
        "compose file's (0.0.0.0 there)",
    )
    parser.add_argument(
        "--dedupe",
        action="store_true",
        help="honour Idempotency-Key: a repeated key returns the first charge, no new effect "
        "(default: off, every request charges, like a provider without idempotency)",
    )
    parser.add_argument(
        "--latency-ms",
        type=_non_negative,
        default=0.0,
        metavar="MS",
        help="delay before handling each charge and lookup, in milliseconds (default: 0)",
    )
    parser.add_argument(
        "--decline-rate",
        type=_rate,
        default=0.0,
        metavar="R",
        help="fraction of charges answered 402 card declined, without charging (default: 0)",
    )
    parser.add_argument(
        "--fail-before-rate",
        type=_rate,
        default=0.0,
        metavar="R",
        help="fraction of charges answered 503 without charging (default: 0)",
    )
    parser.add_argument(
        "--fail-after-rate",
        type=_rate,
        default=0.0,
        metavar="R",
        help="fraction of charges that charge, then answer 500 (default: 0)",
    )
    parser.add_argument(
        "--drop-after-rate",
        type=_rate,
        default=0.0,
        metavar="R",
        help="fraction of charges that charge, then close the connection unanswered (default: 0)",
    )
    parser.add_argument(
        "--hang-after-rate",
        type=_rate,
        default=0.0,
        metavar="R",
        help="fraction of charges that charge, then wait --hang-seconds before answering (default: 0)",
    )
    parser.add_argument(
        "--hang-seconds",
        type=_non_negative,
        default=30.0,
        metavar="S",
        help="how long a hang_after fault waits (default: 30)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed the fault RNG for a reproducible run")
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="once listening, atomically write the base URL (no newline) to PATH",
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    """Serve with the options of :func:`add_arguments` until SIGTERM or SIGINT; the exit status."""
    config: dict[str, object] = {
        "dedupe": args.dedupe,
        "latency_ms": args.latency_ms,
        "decline_rate": args.decline_rate,
        "fail_before_rate": args.fail_before_rate,
        "fail_after_rate": args.fail_after_rate,
        "drop_after_rate": args.drop_after_rate,
        "hang_after_rate": args.hang_after_rate,
        "hang_seconds": args.hang_seconds,
        "seed": args.seed,
    }
    try:
        sim = ProviderSimulator._with_config(args.host, args.port, config, any_address=True)
    except ValueError as exc:
        print(f"provider: {exc}", file=sys.stderr)
        return 2
    try:
        sim.start()
    except OSError as exc:
        print(f"provider: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if args.ready_file is not None:
            _write_ready_file(args.ready_file, sim.url)
        print(f"provider listening on {sim.url}", flush=True)
        # A timed wait keeps the main thread returning to the interpreter, where signal
        # handlers run.
        while not stop.wait(0.5):
            pass
    finally:
        sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
