"""Deliver and reconcile in-process, through the real path: for the tests of users' own code.

``deliver`` runs each due row through the worker's own claim → call → record
(:class:`outbox.consumer.Deliverer`, no broker); ``reconcile_once`` runs the reconciler's jobs
that need no broker (expire leases, resolve unknown rows through the lookups);
``crash_after_call`` makes the call and then dies before recording, as a worker killed between
the provider's answer and its commit; ``pass_time`` makes time pass for the rows.

``recover`` then does what the running system would (deliver, reconcile, let time pass) until
every row is settled. A test of a handler with a lookup says in three lines that a crash after
the call charges once::

    crash_after_call(handlers, database_url=url)          # charged, never recorded
    assert recover(handlers, database_url=url) == {1: "sent"}
    assert provider.charges() == 1
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import psycopg
from sqlalchemy import URL, Engine

from .. import aio, store
from ..consumer import Deliverer, DeliveryResult, delivery_for
from ..exceptions import ConfigError
from ..handlers import Deliveries, Handler, registry
from ..settings import libpq_url
from ..states import TERMINAL
from . import clock

#: Rows ``deliver`` takes per round, and rounds at most (a row retried at once comes back).
_BATCH = 1000
_MAX_ROUNDS = 50

# Only the given handlers' destinations: a row of a destination the test did not hand over is
# left alone, not failed as "no handler in this deploy" as a worker would.
_DUE = """
SELECT id, destination FROM outbox_message
WHERE (state = 'dispatched' OR (state = 'pending' AND available_at <= now()))
  AND destination = ANY(%(destinations)s)
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
ORDER BY available_at, id
LIMIT %(limit)s
"""

Handlers = Mapping[str, Handler] | ModuleType | str | None
Database = str | URL | Engine


def _handlers(handlers: Handlers) -> dict[str, Handler]:
    """A mapping as given; None: every declared handler; a module (or its name): the handlers
    it declares or re-exports."""
    if handlers is None:
        return registry()
    if isinstance(handlers, Mapping):
        table = dict(handlers)
        wrong = [d for d, h in table.items() if not isinstance(h, Handler) or h.destination != d]
        if wrong or not table:
            raise ConfigError(
                "handlers must map each destination to the @outbox.handler declared for it "
                f"({{'payments.charge': charge}}); got {handlers!r}"
            )
        return table
    if not isinstance(handlers, ModuleType | str):
        raise TypeError(
            "handlers: a handler module (or its name), a {destination: handler} dict, or None for "
            f"every declared handler; got {type(handlers).__name__}"
        )
    module = importlib.import_module(handlers) if isinstance(handlers, str) else handlers
    name = module.__name__
    declared = registry()
    found = {h.destination: h for h in vars(module).values() if isinstance(h, Handler)}
    mine = set(found) | {
        d for d, h in declared.items() if f"{getattr(h.fn, '__module__', '')}.".startswith(f"{name}.")
    }
    if not mine:
        raise ConfigError(f"module {name!r} declares no @outbox.handler")
    # The registry's entry when there is one: it is what a worker would run.
    return {d: declared.get(d) or found[d] for d in sorted(mine)}


def _url(database_url: str | URL | Engine) -> str:
    """The URL as given, or an engine's (its password included: ``str(engine.url)`` hides it)."""
    if isinstance(database_url, Engine):
        database_url = database_url.url
    if isinstance(database_url, URL):
        return database_url.render_as_string(hide_password=False)
    if not isinstance(database_url, str):
        raise TypeError(f"database_url: a URL or an Engine, got {type(database_url).__name__}")
    return database_url


def deliver(handlers: Handlers = None, *, database_url: Database) -> dict[int, DeliveryResult]:
    """Run every due row (``pending`` and due, or ``dispatched``) of the handlers' destinations
    through the worker's delivery, until none is due; each row's last outcome. A row whose retry
    is due later is left pending: make time pass (:func:`pass_time`) and call again."""
    table, url = _handlers(handlers), _url(database_url)
    deliverer = Deliverer(url, table)
    results: dict[int, DeliveryResult] = {}
    try:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            for _ in range(_MAX_ROUNDS):
                due = conn.execute(_DUE, _due_params(table, None)).fetchall()
                ran = 0
                for row_id, destination in due:
                    result = deliverer.deliver(int(row_id), str(destination))
                    results[int(row_id)] = result
                    ran += result not in (DeliveryResult.EMPTY, DeliveryResult.PAUSED, DeliveryResult.HELD)
                if not ran:
                    break
    finally:
        deliverer.close()
    return results


def _due_params(table: Mapping[str, Handler], ids: list[int] | None) -> dict[str, Any]:
    return {"destinations": list(table), "ids": ids, "limit": _BATCH}


def crash_after_call(
    handlers: Handlers = None, *, database_url: Database, ids: list[int] | None = None
) -> list[int]:
    """Claim each due row (or only the rows ``ids``) and call its handler as the worker would,
    then "die": the outcome is never recorded, the rows stay ``in_flight`` until their lease
    expires. The ids whose handler was called, whatever it answered or raised: whether the
    provider acted is the provider's to say (``outbox_provider.charges()``)."""
    table, url = _handlers(handlers), _url(database_url)
    deliveries = Deliveries()
    called: list[int] = []
    try:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            for row_id, destination in conn.execute(_DUE, _due_params(table, ids)).fetchall():
                handler = table[destination]
                claimed = store.delivery.claim(
                    conn,
                    row_id=row_id,
                    destination=destination,
                    lease_seconds=handler.lease_seconds,
                    key_ttl=handler.key_ttl if handler.idempotent else None,
                )
                if not isinstance(claimed, store.delivery.Claimed):
                    continue  # not claimable, or sent to `unknown` (past key_ttl): no call
                try:
                    delivery = delivery_for(claimed, handler, deliveries, asynchronous=handler.is_async)
                    aio.call(handler.fn, delivery, timeout_seconds=handler.call_deadline_seconds)
                except Exception:  # whatever it answered, nobody records it
                    pass
                called.append(int(row_id))
    finally:
        deliveries.close()
    return called


def reconcile_once(handlers: Handlers = None, *, database_url: Database) -> dict[str, dict[str, int]]:
    """Run the reconciler's broker-free jobs once, in order, on the handlers' destinations only:
    expire leases, then resolve the due ``unknown`` rows through the lookups. Counts per job."""
    from outbox.reconciler.jobs.expire_leases import expire_leases

    from ..settlement import resolve_unknown

    table, url = _handlers(handlers), _url(database_url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        expired = expire_leases(conn, table, only_destinations=list(table))
        resolved = resolve_unknown(conn, table, only_destinations=list(table))
    return {"expire_leases": {"expired": expired} if expired else {}, "resolve_unknown": resolved}


# When the next thing happens to a row that is not settled: a retry or lookup falls due
# (available_at), a lease expires (lease_expires_at).
_NEXT_DUE = """
SELECT id, EXTRACT(EPOCH FROM
    CASE WHEN state = 'in_flight' THEN lease_expires_at ELSE available_at END - now())
FROM outbox_message
WHERE destination = ANY(%(destinations)s) AND state <> ALL(%(terminal)s)
"""


def recover(handlers: Handlers = None, *, database_url: Database, max_rounds: int = 20) -> dict[int, str]:
    """What the running system does after a crash, until every row of the handlers'
    destinations is settled: rounds of deliver and reconcile, time passing between them up to
    the next row's next event (a lease expiring, a retry or a lookup falling due), at most
    ``max_rounds``. Each row's state at the end: a row of a handler without a lookup stays
    ``unknown`` after an ambiguous call, as it would in production until an operator resolves
    it. Only those rows' time passes; other destinations' rows are left alone."""
    table, url = _handlers(handlers), _url(database_url)
    params = {"destinations": list(table), "terminal": list(TERMINAL)}
    states: dict[int, str] = {}
    for _ in range(max_rounds):
        deliver(table, database_url=url)
        reconcile_once(table, database_url=url)
        states = {r["id"]: r["state"] for r in rows(url) if r["destination"] in table}
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            waiting = conn.execute(_NEXT_DUE, params).fetchall()
        if not waiting:
            break
        seconds = max(0.0, min(float(w or 0) for _, w in waiting)) + 1
        pass_time(seconds, database_url=url, ids=[int(i) for i, _ in waiting])
    return states


def pass_time(seconds: float, *, database_url: Database, ids: list[int] | None = None) -> int:
    """Make ``seconds`` pass for the rows ``ids`` (all when None): leases expire, retries and
    lookups fall due (:func:`outbox.testing.clock.elapse`). How many rows."""
    with psycopg.connect(libpq_url(_url(database_url)), autocommit=True) as conn:
        return clock.elapse(conn, seconds, ids=ids)


def rows(database_url: Database) -> list[dict[str, Any]]:
    """Every outbox row, oldest first, as dictionaries."""
    with psycopg.connect(libpq_url(_url(database_url)), autocommit=True) as conn:
        cur = conn.execute(
            "SELECT id, key, step, destination, payload, state, attempts, provider_ref, last_error "
            "FROM outbox_message ORDER BY id"
        )
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
