"""The process's event loop, on which every ``async def`` handler and lookup runs.

One daemon thread runs one asyncio loop for the whole process, started on first use. Every
``httpx.AsyncClient`` that ``Delivery.http`` hands an async handler belongs to it: an async
client's connections are bound to the loop that opened them, so a loop per call (``asyncio.run``)
would open a connection per call, and a loop per thread a pool per thread.

A caller in any other thread submits a coroutine and waits for it with a bound; past the bound
the task is cancelled, which stops an async call at its next ``await`` (a request not sent yet is
not sent). Code running on the loop must not wait on it: :func:`run` refuses, rather than hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, started (again, after :func:`stop` or a fork) on first use."""
    global _loop, _thread
    with _lock:
        if _loop is not None and _thread is not None and _thread.is_alive() and not _loop.is_closed():
            return _loop
        new = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(new)
            new.call_soon(ready.set)
            try:
                new.run_forever()
            finally:
                _cancel_all(new)
                new.close()

        thread = threading.Thread(target=main, name="outbox-async", daemon=True)
        thread.start()
        ready.wait()
        _loop, _thread = new, thread
        return new


def _cancel_all(running: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(running) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        running.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    running.run_until_complete(running.shutdown_asyncgens())


def alive() -> bool:
    """Whether the loop runs (without starting one, as :func:`loop` would)."""
    return _loop is not None and _thread is not None and _thread.is_alive() and _loop.is_running()


def on_loop() -> bool:
    """Whether the calling thread is the loop's own."""
    return _thread is not None and threading.current_thread() is _thread


class _Escaped(Exception):
    """A ``KeyboardInterrupt`` or ``SystemExit`` raised by a coroutine, carried to the thread
    that waits for it: raised in a task, asyncio lets it out of ``run_forever``, and it would end
    the loop every async handler and lookup of the process shares."""


async def _contained(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return await coro
    except (KeyboardInterrupt, SystemExit) as exc:
        raise _Escaped(exc) from exc


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` as a task on the loop; cancelling the future cancels the task. A
    ``KeyboardInterrupt`` or ``SystemExit`` it raises ends it, not the loop."""
    return asyncio.run_coroutine_threadsafe(_contained(coro), loop())


def run(coro: Coroutine[Any, Any, T], *, timeout_seconds: float | None = None) -> T:
    """``coro``'s result, raised exception included (a ``KeyboardInterrupt`` or ``SystemExit``
    too, here, the loop going on); past ``timeout_seconds`` its task is cancelled and
    TimeoutError raised."""
    if on_loop():
        coro.close()
        raise RuntimeError("outbox: a blocking call was made from the event loop of async handlers")
    future = submit(coro)
    try:
        return future.result(timeout_seconds)
    except _Escaped as escaped:
        cause = escaped.__cause__
        assert cause is not None
        raise cause from None
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no result within {timeout_seconds:g} s; the task was cancelled") from None


def call(fn: Callable[[Any], Any], arg: Any, *, timeout_seconds: float | None = None) -> Any:
    """``fn(arg)``: on the loop when ``fn`` is an ``async def`` function, here otherwise."""
    if is_async(fn):
        return run(fn(arg), timeout_seconds=timeout_seconds)
    return fn(arg)


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine to await (an ``async def`` function, a partial of
    one, or an object whose ``__call__`` is one)."""
    if inspect.iscoroutinefunction(fn):
        return True
    method = type(fn).__dict__.get("__call__") if not inspect.isroutine(fn) else None
    return method is not None and inspect.iscoroutinefunction(method)


def stop(timeout_seconds: float = 5.0) -> None:
    """Stop the loop (its unfinished tasks are cancelled) and wait for its thread."""
    global _loop, _thread
    with _lock:
        running, thread, _loop, _thread = _loop, _thread, None, None
    if running is None or thread is None or running.is_closed():
        return
    running.call_soon_threadsafe(running.stop)
    if thread is not threading.current_thread():
        thread.join(timeout_seconds)
