"""Deliver and reconcile in-process, through the real path: for the tests of users' own code.

``deliver`` runs each due row through the worker's own claim → call → record
(:class:`outbox.consumer.Executor`, no broker); ``reconcile_once`` runs the reconciler's jobs
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

from .. import transitions
from ..consumer import Executor, RunResult
from ..exceptions import ConfigError
from ..handlers import Deliveries, Handler, registry
from ..settings import libpq_url
from ..states import TERMINAL

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


def _handlers(handlers: Handlers) -> dict[str, Handler]:
    """A mapping as given; None: every declared handler; a module (or its name): the handlers
    it declares or re-exports."""
    if handlers is None:
        return registry()
    module = importlib.import_module(handlers) if isinstance(handlers, str) else handlers
    if not isinstance(module, ModuleType):
        return dict(handlers)  # type: ignore[arg-type]
    name = module.__name__
    declared = registry()
    mine = {h.destination for h in vars(module).values() if isinstance(h, Handler)}
    mine |= {d for d, h in declared.items() if f"{getattr(h.fn, '__module__', '')}.".startswith(f"{name}.")}
    if not mine:
        raise ConfigError(f"module {name!r} declares no @outbox.handler")
    # The registry's entry when there is one: it is what a worker would run.
    found = {h.destination: h for h in vars(module).values() if isinstance(h, Handler)}
    return {d: declared.get(d) or found[d] for d in sorted(mine)}


def deliver(handlers: Handlers = None, *, database_url: str) -> dict[int, RunResult]:
    """Run every due row (``pending`` and due, or ``dispatched``) through the worker's delivery,
    until none is due; each row's last outcome. A row whose retry is due later is left pending:
    make time pass (:func:`pass_time`) and call again."""
    table = _handlers(handlers)
    executor = Executor(database_url, table)
    results: dict[int, RunResult] = {}
    try:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            for _ in range(_MAX_ROUNDS):
                due = conn.execute(_DUE, _due_params(table, None)).fetchall()
                ran = 0
                for row_id, destination in due:
                    result = executor.deliver(int(row_id), str(destination))
                    results[int(row_id)] = result
                    ran += result is not RunResult.EMPTY
                if not ran:
                    break
    finally:
        executor.close()
    return results


def _due_params(table: Mapping[str, Handler], ids: list[int] | None) -> dict[str, Any]:
    return {"destinations": list(table), "ids": ids, "limit": _BATCH}


def crash_after_call(
    handlers: Handlers = None, *, database_url: str, ids: list[int] | None = None
) -> list[int]:
    """Claim each due row (or only the rows ``ids``) and call its handler as the worker would,
    then "die": the outcome is never recorded, the rows stay ``in_flight`` until their lease
    expires. The ids called."""
    table = _handlers(handlers)
    deliveries = Deliveries()
    called: list[int] = []
    try:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            for row_id, destination in conn.execute(_DUE, _due_params(table, ids)).fetchall():
                handler = table.get(destination)
                if handler is None:
                    continue
                claimed = transitions.claim(
                    conn, row_id=row_id, destination=destination, lease_seconds=handler.lease_seconds
                )
                if claimed is None:
                    continue
                delivery = deliveries.delivery(
                    handler,
                    id=claimed.id,
                    key=claimed.key,
                    step=claimed.step,
                    payload=claimed.payload,
                    attempt=claimed.attempt,
                    deadline=claimed.deadline,
                )
                try:
                    handler.fn(delivery)
                except Exception:  # whatever it answered, nobody records it
                    pass
                called.append(int(row_id))
    finally:
        deliveries.close()
    return called


def reconcile_once(handlers: Handlers = None, *, database_url: str) -> dict[str, dict[str, int]]:
    """Run the reconciler's broker-free jobs once, in order: expire leases, then resolve the
    unknown rows that are due through the handlers' lookups. Counts per job."""
    from reconciler.jobs.expire_leases import expire_leases
    from reconciler.jobs.resolve_unknown import resolve_unknown

    table = _handlers(handlers)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        expired = expire_leases(conn, table)
        resolved = resolve_unknown(conn, table)
    return {"expire_leases": {"expired": expired} if expired else {}, "resolve_unknown": resolved}


def recover(handlers: Handlers = None, *, database_url: str, max_rounds: int = 20) -> dict[int, str]:
    """What the running system would do after a crash, until every row is settled: rounds of
    deliver, reconcile, and time passing (one lease plus one time limit of the slowest handler,
    so leases expire and lookups fall due), at most ``max_rounds``. Each row's state at the end:
    a row of a handler without a lookup stays ``unknown`` after an ambiguous call, as it would
    in production until an operator resolves it."""
    table = _handlers(handlers)
    step = max((h.lease_seconds + h.time_limit for h in table.values()), default=0) + 1
    states: dict[int, str] = {}
    for _ in range(max_rounds):
        deliver(table, database_url=database_url)
        reconcile_once(table, database_url=database_url)
        states = {r["id"]: r["state"] for r in rows(database_url) if r["destination"] in table}
        if all(state in TERMINAL for state in states.values()):
            break
        pass_time(step, database_url=database_url)
    return states


def pass_time(seconds: float, *, database_url: str, ids: list[int] | None = None) -> int:
    """Make ``seconds`` pass for the rows (all when ``ids`` is None): leases expire, retries and
    first lookups fall due (:func:`outbox.transitions.elapse`). How many rows."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        return transitions.elapse(conn, seconds, ids=ids)


def rows(database_url: str) -> list[dict[str, Any]]:
    """Every outbox row, oldest first, as dictionaries."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        cur = conn.execute(
            "SELECT id, key, step, destination, payload, state, attempts, provider_ref, last_error "
            "FROM outbox_message ORDER BY id"
        )
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
