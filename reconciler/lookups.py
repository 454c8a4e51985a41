"""HTTP clients for the lookups of ``resolve_unknown``, owned by the reconciler."""

from __future__ import annotations

import dataclasses
import threading

import httpx

from outbox.handlers import Handler


class _LookupHandler(Handler):
    """A destination's handler whose ``http_client()`` is one the reconciler owns.

    The worker's clients are per thread and closed all at once by ``close_http_clients``; the
    reconciler may share a process with a worker (tests, the demo), so it keeps clients of its
    own and closes exactly those.
    """

    _owned_client: httpx.Client

    def http_client(self) -> httpx.Client:
        return self._owned_client


class LookupClients:
    """HTTP clients for lookups, one per destination, kept across runs and closed by ``close``."""

    def __init__(self) -> None:
        self._handlers: dict[str, _LookupHandler] = {}
        self._lock = threading.Lock()

    def handler_for(self, handler: Handler) -> Handler:
        with self._lock:
            wrapped = self._handlers.get(handler.destination)
            if wrapped is None or wrapped.fn is not handler.fn or wrapped._owned_client.is_closed:
                fields = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)}
                wrapped = _LookupHandler(**fields)
                wrapped._owned_client = httpx.Client(timeout=handler.timeouts())
                old = self._handlers.get(handler.destination)
                if old is not None:
                    old._owned_client.close()
                self._handlers[handler.destination] = wrapped
            return wrapped

    def close(self) -> None:
        with self._lock:
            handlers, self._handlers = list(self._handlers.values()), {}
        for h in handlers:
            h._owned_client.close()
