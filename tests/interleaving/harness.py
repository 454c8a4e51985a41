"""A seeded random scheduler over the real components, then quiescence, then the promise checked.

One ``random.Random(seed)`` in the scheduler's thread makes every decision: which step runs next,
where a run crashes, which fault is injected. Steps that can block (a claim waiting on a row lock,
a relay holding its batch, an HTTP call to a slow provider) run in threads; the scheduler waits a
bounded, seeded time for them and moves on, so that the other components act while they wait.
A seed replays the same decisions; thread timing is real, so a replay follows the same schedule
but not always to the same microsecond.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import redis
from helpers import Forwarder
from sqlalchemy import Engine
from sqlalchemy.pool import NullPool

import outbox
from outbox.chains import NOT_COMPUTED
from outbox.db import make_engine
from outbox.ordering import HOLDING_SQL
from outbox.settings import libpq_url
from outbox.transport import delete_namespace

from . import components as c

logger = logging.getLogger(__name__)

FAULTS = frozenset(
    {
        "crash",  # a worker process dies at a checkpoint
        "lock",  # a blocker holds a row FOR UPDATE while a claim waits
        "relay_stall",  # the relay parks between its Redis push and its COMMIT
        "clock",  # worker and reconciler processes run with a clock offset
        "pg_drop",  # pg_terminate_backend of a component's backend
        "pg_unreachable",  # a worker process cut off from PostgreSQL for a while (its forwarder)
        "lost_reply",  # a committed claim's reply never reaches the worker
        "late_claim",  # a claim lost before it ran (queued in a pooler) runs later, or never
        "redis_flush",  # every key of the broker namespace is deleted
        "provider",  # the provider fails, drops, hangs, is slow, or its lookup is down
        "purge",  # terminal rows purged (short retention), keys written again afterwards
        "operator",  # resolve / replay / bulk replay, by the runbook
    }
)

#: Checkpoints where a run parks until the scheduler advances it. Between the claim and the
#: call there is none: a stall there is not a fault the product can guard against (nothing but the
#: provider could fence it), while a claim that waits on a lock is, and is modelled by real locks.
PARK_POINTS = frozenset({"fetched", "after_post", "after_call", "before_ack"})
CRASH_POINTS = frozenset(
    {
        "fetched",
        "after_group_claim",
        "after_claim",
        "before_post",
        "after_post",
        "after_call",
        "after_record",
        "before_ack",
        "before_hand_back",
    }
)

TERMINAL = frozenset({"sent", "failed", "cancelled"})


@dataclasses.dataclass
class Settings:
    seed: int
    steps: int = 80
    time_limit: float = 1.0
    redispatch_after: float = 3.0
    retention: float = 2.0
    unknown_alert_after: float = 3.0
    heartbeat_timeout_ms: int = 2000
    #: A slow provider stays under this fraction of time_limit: an effect landing later than
    #: the call's own time limit is a residual risk the product documents, not a bug.
    max_latency_fraction: float = 0.9
    quiesce_seconds: float = 60.0
    faults: frozenset[str] = FAULTS


@dataclasses.dataclass
class Finding:
    kind: str
    detail: str
    row_ids: list[int] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.detail}"


class Tracker:
    """What the test handler saw: calls in progress and started, per idempotency key."""

    def __init__(self, log: Callable[[str, int | None], None]) -> None:
        self.log = log
        self._lock = threading.Lock()
        self.in_progress: Counter[str] = Counter()
        self.last_started: dict[str, float] = {}
        self.calls: list[tuple[int, int, str]] = []  # (row id, attempt, worker)
        #: Calls started by each run. A sync handler's call runs on a thread of the Deliverer's,
        #: an async one's on the event loop: the run is found by the delivery it was given.
        self.calls_by_run: Counter[int] = Counter()
        self._runs_by_delivery: dict[tuple[int, int], Any] = {}
        #: > 0: the provider takes this long to execute a charge, longer than the client waits.
        self.processing_seconds = 0.0

    def on_delivery(self, run: Any, d: Any) -> None:
        """A delivery built for a claim of ``run`` (one claim holds a row's attempt at a time)."""
        if run is not None:
            with self._lock:
                self._runs_by_delivery[(d.id, d.attempt)] = run

    def post_started(self, d: Any) -> None:
        with self._lock:
            run = self._runs_by_delivery.get((d.id, d.attempt))
            self.in_progress[d.idempotency_key] += 1
            self.last_started[d.idempotency_key] = time.monotonic()
            self.calls.append((d.id, d.attempt, run.proc.name if run else "?"))
            if run is not None:
                self.calls_by_run[id(run)] += 1

    def calls_of(self, run: Any) -> int:
        with self._lock:
            return self.calls_by_run[id(run)]

    def post_ended(self, d: Any) -> None:
        with self._lock:
            self.in_progress[d.idempotency_key] -= 1


class Parkable:
    """A step sequence in its own thread that parks at checkpoints until the scheduler advances
    it ("go") or kills it ("crash")."""

    park_points: frozenset[str] = frozenset()
    #: Checkpoints where the run decides by itself (its own seeded RNG) to crash, without parking.
    random_crash_points: frozenset[str] = frozenset()

    def __init__(self, world: World, rng: random.Random, name: str) -> None:
        self.world = world
        self.rng = rng
        self.name = name
        self.row_id: int | None = None
        self.free = False  # never park, never crash (quiescence)
        self.parked_at: str | None = None
        self.command: str | None = None
        self.done = False
        self.crashed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"oxil-{name}", daemon=True)

    def checkpoint(self, name: str) -> None:
        if self.free:
            return
        # Half the time a run goes straight through a park point: the worker's own steps then race
        # the other components without waiting for the scheduler.
        if name not in self.park_points or self.rng.random() < 0.5:
            if (
                name in self.random_crash_points
                and "crash" in self.world.cfg.faults
                and self.rng.random() < 0.06
            ):
                self.world.log(f"{self.name}: crash at {name}", self.row_id)
                raise c.Crash(name)
            return
        with self.cond:
            self.parked_at, self.command = name, None
            self.cond.notify_all()
            while self.command is None:
                self.cond.wait()
            command, self.parked_at = self.command, None
        if command == "crash":
            self.world.log(f"{self.name}: crash at {name}", self.row_id)
            raise c.Crash(name)

    @property
    def waiting(self) -> bool:
        """Parked and not yet told what to do."""
        return not self.done and self.parked_at is not None and self.command is None

    def advance(self, command: str, wait: float) -> None:
        with self.cond:
            if self.parked_at is None:
                return
            self.command = command
            self.cond.notify_all()
        self.wait_parked(wait)

    def wait_parked(self, wait: float) -> None:
        """Wait until the run parks again or ends, at most ``wait`` seconds."""
        deadline = time.monotonic() + wait
        with self.cond:
            while not self.done and (self.parked_at is None or self.command is not None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def release(self) -> None:
        self.free = True
        with self.cond:
            if self.parked_at is not None and self.command is None:
                self.command = "go"
                self.cond.notify_all()

    def _run(self) -> None:
        try:
            self.main()
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def main(self) -> None:
        raise NotImplementedError


class Run(Parkable):
    """The deliveries of one fetch by one worker process: fetched → (a group claim of its rows,
    when it fetched several) → for each message in turn the product's actor (claim unless the
    group took it, call, record) → ack, parked at checkpoints. As the worker's loop does
    (outbox.runner): a message its group did not claim while its process's PostgreSQL does not
    answer, or whose delivery answered ``unreachable``, is handed back to its queue, not acked."""

    park_points = PARK_POINTS
    random_crash_points = CRASH_POINTS

    def __init__(self, world: World, proc: c.WorkerProcess, messages: list[Any], rng: random.Random) -> None:
        ids = [m.args[0] if m.args else None for m in messages]
        super().__init__(
            world, rng, f"{proc.name}/row{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}"
        )
        self.proc = proc
        self.messages = messages
        self.row_id = ids[0]
        #: When its messages were fetched (World's sequence).
        self.fetched_seq = 0

    def main(self) -> None:
        c.bind_thread(run=self, clock_offset=self.proc.clock_offset)
        try:
            self.checkpoint("fetched")
            taken: dict[int, Any] = {}
            if len(self.messages) > 1:
                try:
                    taken = self.proc.claim_group(self.messages)
                except c.Crash:
                    raise
                except Exception as exc:
                    self.world.log(
                        f"{self.name}: group claim raised {type(exc).__name__}: {exc}", self.row_id
                    )
                self.world.log(
                    f"{self.name}: group claim took rows {sorted(taken)} of {len(self.messages)}", self.row_id
                )
                # Between a group's commit and its rows' calls: a crash leaves them all claimed.
                self.checkpoint("after_group_claim")
            for message in self.messages:
                row_id = message.args[0] if message.args else None
                got = taken.pop(row_id, None)
                if self.proc.unclaimed_while_down(got):
                    self.world.log(
                        f"{self.name}: row {row_id} not claimed, PostgreSQL does not answer", row_id
                    )
                    self._hand_back(message, row_id)
                    continue
                calls = self.world.tracker.calls_of(self)
                result = None
                try:
                    result = self.proc.process(message, got)
                except c.Crash:
                    raise
                except Exception as exc:
                    self.world.log(f"{self.name}: actor raised {type(exc).__name__}: {exc}", row_id)
                if self.proc.hands_back(result):
                    self.world.on_unreachable(self, row_id, self.world.tracker.calls_of(self) - calls)
                    self._hand_back(message, row_id)
                    continue
                self.checkpoint("before_ack")
                self.proc.ack(message)
        except c.Crash:
            self.crashed = True
            self.proc.die()
        except Exception as exc:  # the ack, on a flushed or dropped Redis
            self.world.log(f"{self.name}: {type(exc).__name__}: {exc}", self.row_id)
        if not self.crashed:
            # Each run is a thread of its own: its connections end with it (a Dramatiq worker's
            # threads are a fixed pool), or a long schedule runs the server out of connections.
            with contextlib.suppress(Exception):
                self.proc.consumer.close_thread()

    def _hand_back(self, message: Any, row_id: int | None) -> None:
        self.checkpoint("before_hand_back")
        # Numbered before the requeue: a fetch of the message back in its queue comes after it.
        seq = self.world.next_seq()
        self.proc.hand_back(message)
        self.world.on_hand_back(self, message, row_id, seq)


class RelayRun(Parkable):
    """One relay batch; parks between its Redis push and its COMMIT, holding its rows' locks."""

    park_points = frozenset({"relay_after_publish"})

    def __init__(self, world: World, relay: Any, rng: random.Random) -> None:
        super().__init__(world, rng, "relay")
        self.relay = relay

    def main(self) -> None:
        c.bind_thread(run=self)
        try:
            published = c.relay_batch(self.relay)
            if published:
                self.world.log(f"relay: published {published}")
        except BaseException as exc:  # Crash included: the relay process is gone
            self.crashed = isinstance(exc, c.Crash)
            if not self.crashed:
                self.world.log(f"relay: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                self.relay.close()
            if self.world.relay is self.relay:
                self.world.relay = None
            if not isinstance(exc, c.Crash | Exception):
                raise


class World:
    def __init__(
        self,
        cfg: Settings,
        *,
        database_url: str,
        redis_url: str,
        namespace: str,
        provider: Any,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.database_url = database_url
        self.redis_url = redis_url
        self.namespace = namespace
        self.provider = provider
        self.started = time.monotonic()
        self.events: list[tuple[float, str, int | None]] = []
        self._events_lock = threading.Lock()
        self.tracker = Tracker(self.log)
        self._sql_lock = threading.Lock()
        self._sql_conn: psycopg.Connection[Any] | None = None
        c.install_hooks(monkeypatch, self)
        self.handlers, self.lease = c.declare_handlers(provider.url, self.tracker, time_limit=cfg.time_limit)
        # No pools: the server's connections are shared with the rest of the suite.
        self.engine: Engine = make_engine(
            database_url, connect_args={"application_name": "oxil-app"}, poolclass=NullPool
        )
        self.operator_engine: Engine = make_engine(
            database_url, connect_args={"application_name": c.OPERATOR}, poolclass=NullPool
        )
        self.redis = redis.Redis.from_url(redis_url)
        self.procs: list[c.WorkerProcess] = []
        self.runs: list[Run] = []
        self.relay: Any = None
        self.relay_run: RelayRun | None = None
        self.reconciler_offset = 0.0
        self.reconciler = self._new_reconciler()
        self.job_threads: dict[str, threading.Thread] = {}
        self.side_threads: list[threading.Thread] = []
        self.blockers: list[tuple[psycopg.Connection[Any], int, float]] = []
        self.keys: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        #: Each written key's priority and fairness key (issue 33): a retried write gives both again.
        self.turns: dict[tuple[str, str], dict[str, Any]] = {}
        #: issue 15: operations written with a payload ix.charge's model refuses
        self.invalid_keys: set[tuple[str, str]] = set()
        self.claims: dict[uuid.UUID, dict[str, Any]] = {}
        self.lost_claims: list[dict[str, Any]] = []
        #: Claims lost on their way (late_claim) that have not run yet: info, and how to run it.
        self.late_claims: list[tuple[dict[str, Any], Callable[[psycopg.Connection[Any]], Any]]] = []
        self.operator_failed: set[int] = set()
        self.purged_then_rewritten: set[tuple[str, str]] = set()
        #: batch name -> (members, then, catch, the member ids its first transaction wrote)
        self.batches: dict[str, tuple[list[tuple[str, dict[str, Any]]], Any, Any, list[int]]] = {}
        self.batch_retries: list[Finding] = []
        #: pg_unreachable: each worker process reaches PostgreSQL through a forwarder of its own,
        #: which a cut closes (every session ended, every connect refused) until it is restored.
        self.can_cut = "pg_unreachable" in cfg.faults and Forwarder.possible(database_url)
        self.forwarders: dict[str, Forwarder] = {}
        #: Worker processes cut off now: since when, and until when at least (monotonic).
        self.cuts: dict[str, tuple[float, float]] = {}
        #: How long the cut armed to come with a process's next claim or record lasts.
        self.cut_for: dict[str, float] = {}
        self._cuts_lock = threading.Lock()
        self.probes: dict[str, threading.Thread] = {}
        #: Ordering of fetches, hand-backs and flushes (a sequence, not a clock).
        self._seq = itertools.count()
        self.fetched_at: dict[str, list[int]] = {}
        self.handed_back: list[dict[str, Any]] = []
        self.flushed_at: list[int] = []
        self.hand_back_findings: list[Finding] = []
        self._next_proc = 1
        self._next_key = 1
        self._stop = threading.Event()
        self._heart = threading.Thread(target=self._heartbeats, name="oxil-heartbeats", daemon=True)
        self._heart.start()

    def _heartbeats(self) -> None:
        """Dramatiq's consumer threads heartbeat while worker threads work; a dead process stops."""
        while not self._stop.wait(0.3):
            for proc in list(self.procs):
                if proc.alive:
                    with contextlib.suppress(Exception):
                        proc.heartbeat()

    # -- bookkeeping -----------------------------------------------------------------------------

    def log(self, text: str, row_id: int | None = None) -> None:
        with self._events_lock:
            self.events.append((time.monotonic() - self.started, text, row_id))

    def on_claim(
        self,
        run: Run | None,
        row_id: Any,
        token: uuid.UUID | None,
        waited: float,
        *,
        lost: bool,
        broke: bool = False,
    ) -> None:
        info = {
            "row_id": row_id,
            "token": token,
            "waited": waited,
            "worker": run.proc.name if run else "?",
            "run": run,
            "offset": run.proc.clock_offset if run else 0.0,
            "lost": lost,
        }
        if token is not None:
            self.claims[token] = info
        if lost:
            self.lost_claims.append(info)
        if broke:
            # A cut or a terminated backend under the claim: it may have committed or not.
            shown = f"broke after {waited:.2f} s (the connection was lost: it may have committed)"
        else:
            shown = f"returned after {waited:.2f} s" + (
                " (reply lost: the connection broke after the commit)" if lost else ""
            )
        self.log(
            f"{info['worker']}: claim of row {row_id} {shown}", row_id if isinstance(row_id, int) else None
        )

    # -- pg_unreachable: a worker process cut off from PostgreSQL, and what its loop does ----------

    def on_cut_at_claim(self, proc: c.WorkerProcess) -> None:
        """The cut armed for ``proc``'s next claim, as the claim's reply is on its way."""
        self._cut(proc, self.cut_for.pop(proc.name, 1.0), "as the reply to its claim was on its way")

    def on_cut_at_record(self, proc: c.WorkerProcess, row_id: int | None) -> None:
        """The cut armed for ``proc``'s next record, as the record's reply is on its way."""
        self._cut(
            proc,
            self.cut_for.pop(proc.name, 1.0),
            f"as the reply to its record of row {row_id} was on its way",
        )

    def _cut(self, proc: c.WorkerProcess, seconds: float, how: str = "") -> None:
        forwarder = self.forwarders.get(proc.name)
        if forwarder is None:
            return
        with self._cuts_lock:
            now = time.monotonic()
            self.cuts[proc.name] = (now, now + seconds)
        forwarder.cut()
        self.log(
            f"fault: {proc.name} cut off from PostgreSQL{' ' + how if how else ''} (at least {seconds} s)"
        )

    def _restore(self, name: str) -> None:
        with self._cuts_lock:
            since, _ = self.cuts.pop(name)
        self.forwarders[name].restore()
        self.log(f"fault over: {name} reaches PostgreSQL again after {time.monotonic() - since:.1f} s")

    def on_unreachable(self, run: Run, row_id: int | None, calls: int) -> None:
        """A delivery answered ``unreachable``: its row not claimed, or its claim's reply lost and
        not settled before the database stayed silent LOST_CLAIM_UNREACHABLE_SECONDS. Its lost
        claims may then expire into unknown (docs/production.md, "A host cut off"); no call may
        have been made, or handing the message back calls twice."""
        self.log(f"{run.name}: delivery of row {row_id} answered unreachable", row_id)
        for info in self.lost_claims:
            if info.get("run") is run and info["row_id"] == row_id:
                info["unreachable"] = True
        if calls:
            self.hand_back_findings.append(
                Finding(
                    "handed back after a call",
                    f"row {row_id}: {run.name}'s delivery answered unreachable (its message handed "
                    f"back for another delivery) after it started {calls} call(s) to the provider",
                    [row_id] if row_id is not None else [],
                )
            )

    def next_seq(self) -> int:
        return next(self._seq)

    def on_hand_back(self, run: Run, message: Any, row_id: int | None, seq: int) -> None:
        mid = message.options.get("redis_message_id")
        self.handed_back.append(
            {
                "seq": seq,
                "fetched": run.fetched_seq,
                "run": run.name,
                "row_id": row_id,
                "mid": mid,
            }
        )
        self.log(f"{run.name}: the message of row {row_id} handed back to its queue", row_id)

    def on_late_claim(
        self, run: Run, row_id: Any, token: uuid.UUID | None, send: Callable[[psycopg.Connection[Any]], Any]
    ) -> None:
        info = {"row_id": row_id, "token": token, "worker": run.proc.name, "lost": True, "late": True}
        self.late_claims.append((info, send))
        self.log(
            f"{run.proc.name}: claim of row {row_id} lost on its way (it may still run, later)",
            row_id if isinstance(row_id, int) else None,
        )

    def step_late_claim(self, *, all_: bool = False) -> None:
        """A claim lost on its way finally runs, whatever its worker did since."""
        while self.late_claims:
            info, send = self.late_claims.pop(self.rng.randrange(len(self.late_claims)))
            try:
                with psycopg.connect(libpq_url(self.database_url), autocommit=True) as conn:
                    # A group's claim returns a row per row it claimed (token in column 7).
                    returned = send(conn).fetchall()
            except psycopg.Error as exc:
                self.log(
                    f"late claim of row {info['row_id']}: refused ({type(exc).__name__})", info["row_id"]
                )
            else:
                claimed = [(r[0], r[7]) for r in returned if r[7] is not None]
                self.log(
                    f"late claim of row {info['row_id']}: "
                    + (f"committed rows {[r for r, _ in claimed]}" if claimed else "claimed nothing"),
                    info["row_id"] if isinstance(info["row_id"], int) else None,
                )
                for row_id, token in claimed:
                    late = {**info, "row_id": row_id, "token": token}
                    self.claims[token] = late
                    self.lost_claims.append(late)
            if not all_:
                return

    def sql(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        """The harness's own queries, on one connection of its own. The server is shared with the
        rest of the suite: a refused connection is retried for a while rather than failing a seed."""
        with self._sql_lock:
            for attempt in range(40):
                try:
                    if self._sql_conn is None or self._sql_conn.closed:
                        self._sql_conn = psycopg.connect(
                            libpq_url(self.database_url), autocommit=True, application_name="oxil-harness"
                        )
                    cur = self._sql_conn.execute(statement, params)
                    return cur.fetchall() if cur.description else []
                except psycopg.OperationalError:
                    if self._sql_conn is not None:
                        self._sql_conn.close()
                    self._sql_conn = None
                    if attempt == 39:
                        raise
                    time.sleep(0.25)
        raise AssertionError("unreachable")

    def _thread(self, name: str, fn: Callable[[], Any], *, offset: float = 0.0) -> threading.Thread:
        def main() -> None:
            c.bind_thread(clock_offset=offset)
            try:
                result = fn()
                if isinstance(result, dict):
                    result = {k: v for k, v in result.items() if v}
                if result:
                    self.log(f"{name}: {result}")
            except Exception as exc:
                self.log(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

        thread = threading.Thread(target=main, name=f"oxil-{name}", daemon=True)
        thread.start()
        return thread

    def _new_reconciler(self) -> Any:
        return c.make_reconciler(
            self.database_url,
            self.redis_url,
            self.namespace,
            self.handlers,
            redispatch_after=self.cfg.redispatch_after,
            retention=self.cfg.retention if "purge" in self.cfg.faults else 7 * 86400.0,
            unknown_alert_after=self.cfg.unknown_alert_after,
        )

    def _offset(self) -> float:
        if "clock" not in self.cfg.faults or self.rng.random() < 0.5:
            return 0.0
        return self.rng.choice([-5.0, -2.0, -0.5, 0.5, 2.0, 5.0])

    # -- steps -----------------------------------------------------------------------------------

    def step_write_batch(self) -> None:
        """issue 14: a batch of 2-3 members; its then (none failed) or catch row is written by
        the reconciler's batches job once every member is terminal."""
        name = f"batch:{self.cfg.seed}-{self._next_key}"
        self._next_key += 1
        members = []
        for _ in range(self.rng.choice([2, 3])):
            amount = -100 if self.rng.random() < 0.15 else self.rng.randrange(100, 10000)
            members.append(
                (self.rng.choice(c.DESTINATIONS).name, {"amount_cents": amount, "currency": "EUR"})
            )
        then = outbox.Next("done", "ix.once", {"amount_cents": 1, "currency": "EUR"})
        catch = outbox.Next("undo", "ix.once", {"amount_cents": 2, "currency": "EUR"})
        ids = c.write_batch(self.engine, name=name, members=members, then=then, catch=catch)
        self.batches[name] = (members, then, catch, ids)
        self.log(f"app: batch {name} of rows {ids}")

    def step_rewrite_batch(self) -> None:
        """The application retries a batch's whole transaction (``outbox.batch`` and its member
        writes), its members and then/catch payloads maybe purged meanwhile (the purge's strip):
        until the ledger horizon it is answered with the old batch and the old rows."""
        if not self.batches:
            return
        name = self.rng.choice(sorted(self.batches))
        members, then, catch, ids = self.batches[name]
        try:
            again = c.write_batch(self.engine, name=name, members=members, then=then, catch=catch)
        except Exception as exc:
            again, error = [], f"{type(exc).__name__}: {exc}"
        else:
            error = ""
        self.log(f"app: batch {name} written again -> rows {again}{' ' + error if error else ''}")
        if again != ids:
            self.batch_retries.append(
                Finding("batch retry", f"batch {name} retried: rows {again} {error}, first {ids}", ids)
            )

    def step_write(self) -> None:
        for _ in range(self.rng.choice([1, 1, 2, 3])):
            destination = self.rng.choice(c.DESTINATIONS).name
            key, step = f"order:{self.cfg.seed}-{self._next_key}", "charge"
            self._next_key += 1
            # A negative amount is a declined card: a permanent error, never charged.
            amount = -100 if self.rng.random() < 0.08 else self.rng.randrange(100, 10000)
            payload: dict[str, Any] = {"amount_cents": amount, "currency": "EUR"}
            if destination == "ix.charge" and self.rng.random() < 0.05:
                # issue 15: a payload its handler's model refuses: failed without a call.
                payload = {"amount_cents": "twelve", "currency": "EUR"}
                self.invalid_keys.add((key, step))
            # issue 13: some rows must be done within seconds; a deadline passing while the
            # destination is paused or its breaker open fails the row in the reconciler.
            deadline = None
            ordering_key = None
            if destination != "ix.manual" and self.rng.random() < 0.35:
                # issue 15: a few ordering keys shared by many rows; no deadline (a row failed
                # by its deadline before any claim blocks its key until an operator skips it).
                ordering_key = f"cust:{self.cfg.seed}-{self.rng.randrange(3)}"
            elif self.rng.random() < 0.2:
                deadline = datetime.now(UTC) + timedelta(seconds=self.rng.uniform(1.5, 8.0))
            # issue 33: turns in a limited destination's window (priority, then fairness keys).
            turn = {
                "priority": self.rng.choice(["high", "normal", "normal", "low"]),
                "fairness_key": self.rng.choice([None, "tenant:a", "tenant:b"]),
            }
            written = c.write(
                self.engine,
                key=key,
                step=step,
                destination=destination,
                payload=payload,
                deadline=deadline,
                ordering_key=ordering_key,
                **turn,
            )
            self.keys[(key, step)] = (destination, payload)
            self.turns[(key, step)] = turn
            shown = f" deadline in {(deadline - datetime.now(UTC)).total_seconds():.1f} s" if deadline else ""
            self.log(f"app: write {key}:{step} on {destination} -> row {written.id}{shown}", written.id)

    def step_rewrite(self) -> None:
        """The application writes an operation it already wrote (a retried request)."""
        if not self.keys:
            return
        (key, step), (destination, payload) = self.rng.choice(sorted(self.keys.items()))
        existed = bool(self.sql("SELECT 1 FROM outbox_message WHERE key = %s AND step = %s", (key, step)))
        written = c.write(
            self.engine,
            key=key,
            step=step,
            destination=destination,
            payload=payload,
            **self.turns[(key, step)],
        )
        if not existed and written.created:
            self.purged_then_rewritten.add((key, step))
        self.log(f"app: write again {key}:{step} -> row {written.id} created={written.created}", written.id)

    def step_cancel(self) -> None:
        if not self.keys:
            return
        key, step = self.rng.choice(sorted(self.keys))
        self.side_threads.append(
            self._thread(f"app: cancel {key}", lambda: c.cancel(self.engine, key=key, step=step) or None)
        )

    def step_relay(self) -> None:
        run = self.relay_run
        if run is not None and not run.done:
            if run.parked_at is not None:
                crash = "crash" in self.cfg.faults and self.rng.random() < 0.15
                self.log(f"relay: {'crash' if crash else 'commit'} after the push")
                run.advance("crash" if crash else "go", self._wait())
            return
        if self.relay is None:
            self.relay = c.make_relay(
                self.database_url, self.redis_url, self.namespace, self.rng.choice([1, 2, 5, 100])
            )
        self.relay_run = RelayRun(self, self.relay, random.Random(self.rng.random()))
        self.relay_run.free = "relay_stall" not in self.cfg.faults or self.rng.random() < 0.5
        self.relay_run.thread.start()
        self.relay_run.wait_parked(self._wait())

    def step_start_worker(self) -> None:
        if sum(p.alive for p in self.procs) >= 3:
            return
        self._start_worker(self._offset())

    def _start_worker(self, offset: float) -> c.WorkerProcess:
        forwarder = Forwarder(self.database_url) if self.can_cut else None
        proc = c.WorkerProcess(
            self,
            self._next_proc,
            database_url=forwarder.url if forwarder is not None else self.database_url,
            redis_url=self.redis_url,
            namespace=self.namespace,
            handlers=self.handlers,
            clock_offset=offset,
            heartbeat_timeout_ms=self.cfg.heartbeat_timeout_ms,
        )
        self._next_proc += 1
        if forwarder is not None:
            self.forwarders[proc.name] = forwarder
        self.procs.append(proc)
        self.log(f"{proc.name}: started (clock offset {offset:+.1f} s)")
        return proc

    def _idle_procs(self) -> list[c.WorkerProcess]:
        busy = {r.proc.name for r in self.runs if not r.done}
        return [p for p in self.procs if p.alive and p.name not in busy]

    def step_fetch(self, *, free: bool = False) -> Run | None:
        # A process whose PostgreSQL does not answer fetches nothing until its probe says it does.
        idle = [p for p in self._idle_procs() if p.fetching]
        if not idle:
            return None
        proc = self.rng.choice(idle)
        for queue in self.rng.sample(proc.queues, len(proc.queues)):
            # One message, or several claimed as one group (outbox.runner's fetch of free slots).
            messages = proc.fetch(queue, self.rng.choice([1, 1, 2, 3]))
            if not messages:
                continue
            if "lost_reply" in self.cfg.faults and not free and self.rng.random() < 0.1:
                proc.lose_next_claim_reply = True
            elif "late_claim" in self.cfg.faults and not free and self.rng.random() < 0.08:
                proc.late_next_claim = True
            run = Run(self, proc, messages, random.Random(self.rng.random()))
            run.free = free
            self.runs.append(run)
            run.fetched_seq = next(self._seq)
            for m in messages:
                self.fetched_at.setdefault(m.options.get("redis_message_id"), []).append(run.fetched_seq)
            ids = [m.args[0] if m.args else None for m in messages]
            self.log(f"{proc.name}: fetched the messages of rows {ids} from {queue}", run.row_id)
            run.thread.start()
            run.wait_parked(self._wait() if not free else 10.0)
            return run
        return None

    def step_advance(self) -> None:
        parked = [r for r in self.runs if r.waiting]
        if not parked:
            return
        run = self.rng.choice(parked)
        crash = "crash" in self.cfg.faults and run.parked_at in CRASH_POINTS and self.rng.random() < 0.08
        if not crash:
            self.log(f"{run.name}: on from {run.parked_at}", run.row_id)
        run.advance("crash" if crash else "go", self._wait())

    def step_job(self, name: str | None = None) -> None:
        jobs = c.reconciler_jobs(self.reconciler)
        if name is None:
            name = self.rng.choice(jobs)
        if name not in jobs or (name == "purge" and "purge" not in self.cfg.faults):
            return
        thread = self.job_threads.get(name)
        if thread is not None and thread.is_alive():
            return
        thread = self._thread(
            f"reconciler {name}", lambda: c.run_job(self.reconciler, name), offset=self.reconciler_offset
        )
        self.job_threads[name] = thread
        thread.join(self._wait())

    def step_reconcile(self) -> None:
        """expire_leases then resolve_unknown, as one run of the reconciler does them in order."""
        thread = self.job_threads.get("tick")
        if thread is not None and thread.is_alive():
            return

        def tick() -> Any:
            return {n: c.run_job(self.reconciler, n) for n in ("expire_leases", "resolve_unknown")}

        thread = self._thread("reconciler", tick, offset=self.reconciler_offset)
        self.job_threads["tick"] = thread
        thread.join(self._wait())

    def step_block(self) -> None:
        if len(self.blockers) >= 2:
            return
        # Mostly the row at the head of a queue: the next worker to fetch there claims it, and waits.
        heads = []
        for dest in c.DESTINATIONS:
            mid = self.redis.lindex(f"{self.namespace}:{dest.name}", 0)
            if mid:
                with contextlib.suppress(ValueError, IndexError):
                    heads.append(int(mid.decode().split("-")[1]))
        if heads and self.rng.random() < 0.8:
            row_id = self.rng.choice(sorted(heads))
        else:
            rows = self.sql(
                "SELECT id FROM outbox_message WHERE state IN ('pending', 'dispatched') ORDER BY id"
            )
            if not rows:
                return
            row_id = self.rng.choice(rows)[0]
        conn = psycopg.connect(libpq_url(self.database_url), application_name="oxil-blocker")
        # An application transaction that only holds the row (changes nothing).
        locked = conn.execute(
            "SELECT id FROM outbox_message WHERE id = %s FOR UPDATE SKIP LOCKED", (row_id,)
        ).fetchone()
        if locked is None:
            conn.close()
            return
        hold = self.rng.choice([0.5, 2.0, 4.0, 4.0, 6.0])
        self.blockers.append((conn, row_id, time.monotonic() + hold))
        self.log(f"blocker: holds row {row_id} FOR UPDATE for at least {hold} s", row_id)

    def step_unblock(self, *, all_: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for conn, row_id, until in self.blockers:
            if all_ or (now >= until and self.rng.random() < 0.7):
                with contextlib.suppress(Exception):
                    conn.rollback()
                conn.close()
                self.log(f"blocker: released row {row_id}", row_id)
            else:
                keep.append((conn, row_id, until))
        self.blockers = keep

    def step_pg_drop(self) -> None:
        targets = [p.name for p in self.procs if p.alive] + ["relay", "reconcile"]
        target = self.rng.choice(targets)
        pattern = "outbox-reconcile-%" if target == "reconcile" else f"oxil-{target}"
        rows = self.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE %s AND pid <> pg_backend_pid()",
            (pattern,),
        )
        self.log(f"fault: pg_terminate_backend of {target} ({len(rows)} backend(s))")

    def step_pg_unreachable(self) -> None:
        """A worker process cut off from PostgreSQL (its sessions closed, its connects refused)
        for a while: now, or as the reply to its next claim or record is on its way (the
        statement committed)."""
        candidates = [
            p
            for p in self.procs
            if p.alive
            and p.name in self.forwarders
            and p.name not in self.cuts
            and not (p.cut_at_next_claim or p.cut_at_next_record)
        ]
        if not candidates:
            return
        proc = self.rng.choice(candidates)
        seconds = self.rng.choice([0.5, 1.0, 2.0, 4.0])
        when = self.rng.choices(["now", "claim", "record"], [0.6, 0.25, 0.15])[0]
        if when == "now":
            self._cut(proc, seconds)
            return
        self.cut_for[proc.name] = seconds
        if when == "claim":
            proc.cut_at_next_claim = True
        else:
            proc.cut_at_next_record = True
        self.log(f"fault: {proc.name} will be cut off from PostgreSQL as its next {when} commits")

    def step_pg_reachable(self) -> None:
        now = time.monotonic()
        for name, (_, until) in sorted(self.cuts.items()):
            if now >= until and self.rng.random() < 0.7:
                self._restore(name)

    def step_probe(self, *, wait: float | None = None) -> None:
        """The worker's probe (Runner._probe_database): a process whose PostgreSQL did not answer
        asks it again; once it answers, the process fetches again."""
        down = [p for p in self.procs if p.alive and not p.fetching]
        probing = {n for n, t in self.probes.items() if t.is_alive()}
        down = [p for p in down if p.name not in probing]
        if not down:
            return
        proc = self.rng.choice(down)

        def probe() -> str:
            return "PostgreSQL answers: fetching again" if proc.probe() else "PostgreSQL does not answer"

        thread = self._thread(f"{proc.name} probe", probe, offset=proc.clock_offset)
        self.probes[proc.name] = thread
        thread.join(self._wait() if wait is None else wait)

    def step_redis_flush(self) -> None:
        self.flushed_at.append(next(self._seq))
        deleted = delete_namespace(self.redis, self.namespace)
        self.log(f"fault: Redis flushed ({deleted} keys of the namespace)")

    def step_provider(self) -> None:
        limit_ms = self.cfg.time_limit * 1000 * self.cfg.max_latency_fraction
        choice = self.rng.choice(
            [
                "calm",
                "fail_before",
                "fail_after",
                "drop_after",
                "hang_after",
                "latency",
                "lookup_fail",
                "processing",
            ]
        )
        base: dict[str, Any] = {
            "fail_before_rate": 0.0,
            "fail_after_rate": 0.0,
            "drop_after_rate": 0.0,
            "hang_after_rate": 0.0,
            "latency_ms": 0.0,
            "lookup_fail": False,
            "hang_seconds": 1.5 * self.cfg.time_limit,
        }
        if choice in ("fail_before", "fail_after", "drop_after", "hang_after"):
            base[f"{choice}_rate"] = self.rng.choice([0.3, 0.6])
        # issue 13: a 503 may say when to come back, in seconds or as an HTTP date.
        base["retry_after"] = self.rng.choice(["", "1", "+2"]) if choice == "fail_before" else ""
        if choice == "latency" or self.rng.random() < 0.4:
            # Slower than the call's read timeout: the client gives up before the effect lands.
            base["latency_ms"] = self.rng.uniform(0.7, 1.0) * limit_ms
        elif choice == "lookup_fail":
            base["lookup_fail"] = True
        self.tracker.processing_seconds = 0.0
        if choice == "processing" or self.rng.random() < 0.3:
            # Within the call's time limit, as the contract assumes of a provider: the simulator's
            # own latency delays the charge too, so the two together stay under the bound.
            total = self.rng.uniform(0.6, 1.0) * limit_ms / 1000
            self.tracker.processing_seconds = max(0.0, total - base["latency_ms"] / 1000)
        self.provider.configure(**base)
        self.log(
            f"provider: {choice} {self._provider_summary()} processing={self.tracker.processing_seconds:.2f}s"
        )

    def _provider_summary(self) -> str:
        cfg = self.provider._state.config()
        parts = [
            f"{k}={getattr(cfg, k)}"
            for k in (
                "fail_before_rate",
                "fail_after_rate",
                "drop_after_rate",
                "hang_after_rate",
                "latency_ms",
                "lookup_fail",
                "retry_after",
            )
        ]
        return " ".join(p for p in parts if not p.endswith(("=0.0", "=False", "=")))

    def step_sleep(self) -> None:
        seconds = self.rng.choice([0.1, 0.3, 0.6, 1.0])
        self.log(f"time: {seconds} s pass")
        time.sleep(seconds)

    # -- the operator, by docs/runbook.md ----------------------------------------------------------

    def _provider_can_tell(self, key: str) -> bool:
        """The provider's word: its records, once no request for the key can still land."""
        ikey = key
        if self.tracker.in_progress[ikey] > 0:
            return False
        last = self.tracker.last_started.get(ikey)
        settle = self.cfg.time_limit * self.cfg.max_latency_fraction + 0.5
        return last is None or time.monotonic() - last > settle

    def step_operator_resolve(self, *, patient: bool = False) -> None:
        # The runbook: act on unknown rows that need a human, whose lookup keeps failing, or that
        # the alert hook reported (unknown for longer than OUTBOX_UNKNOWN_ALERT_AFTER).
        rows = self.sql(
            "SELECT id, key, step FROM outbox_message WHERE state = 'unknown' AND "
            "(last_error LIKE 'needs a human%%' OR last_error LIKE 'lookup failed%%'"
            " OR alerted_at IS NOT NULL) ORDER BY id"
        )
        if not rows:
            return
        row_id, key, step = self.rng.choice(rows)
        ikey = c.idempotency_key(key, step)
        lookup_down = bool(self.provider._state.config().lookup_fail)
        if lookup_down or not self._provider_can_tell(ikey):
            if patient or self.rng.random() < 0.5:
                return  # the runbook: leave it unknown
            how: dict[str, Any] = {
                "failed_reason": "provider cannot tell; refunded by hand if it charged",
                "reason": "provider support cannot tell",
            }
            self.operator_failed.add(row_id)
        else:
            charge = c.provider_charge(self.provider, ikey)
            if charge is not None:
                how = {"sent_ref": charge["id"], "reason": "found in the provider dashboard"}
            else:
                how = {"not_sent": True, "reason": "provider: no charge for this key"}
        self.side_threads.append(
            self._thread(
                f"operator resolve {row_id} {sorted(how)}",
                lambda: c.operator_resolve(self.operator_engine, row_id, **how),
            )
        )

    def step_operator_replay(self) -> None:
        rows = self.sql("SELECT id, destination FROM outbox_message WHERE state = 'failed' ORDER BY id")
        if not rows:
            return
        if self.rng.random() < 0.3:
            destination = self.rng.choice(rows)[1]
            self.side_threads.append(
                self._thread(
                    f"operator replay --destination {destination}",
                    lambda: c.operator_replay_destination(
                        self.operator_engine, destination, "provider outage over, API key rotated"
                    ),
                )
            )
            return
        # Single replays: never a row the operator failed for "cannot tell" (the runbook).
        candidates = [r for r in rows if r[0] not in self.operator_failed]
        if not candidates:
            return
        row_id = self.rng.choice(candidates)[0]
        self.side_threads.append(
            self._thread(
                f"operator replay {row_id}",
                lambda: c.operator_replay(self.operator_engine, row_id, "cause fixed"),
            )
        )

    def step_old_release_replay(self) -> None:
        """An operator still on the floor release's CLI during a rolling deploy (issue 30)
        replays any failed row its own rules allow, a compensated or skipped one included."""
        rows = self.sql("SELECT id FROM outbox_message WHERE state = 'failed' ORDER BY id")
        candidates = [r[0] for r in rows if r[0] not in self.operator_failed]
        if not candidates:
            return
        row_id = self.rng.choice(candidates)
        self.side_threads.append(
            self._thread(
                f"operator (floor release) replay {row_id}",
                lambda: c.old_release_replay(self.database_url, row_id),
            )
        )

    def step_operator_repair(self) -> None:
        """``outbox repair KEY`` (issue 14) by the runbook: a key whose work stopped at a failed or
        unknown step, or at a confirmed one without its next steps; any such key, at any time
        (repair asks the provider before it re-runs anything)."""
        rows = self.sql(
            "SELECT DISTINCT key FROM outbox_message WHERE state IN ('failed', 'unknown')"
            " OR (state = 'sent' AND chain_problem IS NOT NULL) ORDER BY 1"
        )
        if not rows:
            return
        key = self.rng.choice(rows)[0]
        # A human overrules another's resolve --failed, by name and with a reason (--force).
        force = self.rng.random() < 0.5 and bool(
            self.sql(
                "SELECT 1 FROM outbox_message WHERE key = %s AND state = 'failed' AND id = ANY(%s)",
                (key, sorted(self.operator_failed)),
            )
        )
        self.side_threads.append(
            self._thread(
                f"operator repair {key}{' --force' if force else ''}",
                lambda: c.operator_repair(
                    self.operator_engine, self.database_url, key, self.handlers, force=force
                ),
            )
        )

    def step_operator_pause(self) -> None:
        """``outbox pause D`` (issue 13): until resumed, or for a few seconds by itself. Rows
        already claimed finish; no other claim of D succeeds while it lasts."""
        destination = self.rng.choice(c.DESTINATIONS).name
        for_seconds = self.rng.choice([None, 1.0, 3.0])
        self.side_threads.append(
            self._thread(
                f"operator pause {destination} for {for_seconds or 'ever'} s",
                lambda: c.operator_pause(self.operator_engine, destination, for_seconds=for_seconds),
            )
        )

    def step_operator_resume(self) -> None:
        destination = self.rng.choice(c.DESTINATIONS).name
        self.side_threads.append(
            self._thread(
                f"operator resume {destination}",
                lambda: c.operator_resume(self.operator_engine, destination),
            )
        )

    def step_operator_limit(self) -> None:
        """``outbox limit D --in-flight N --per-second R`` (issue 33), 1 to 3 calls at once and/or
        2 or 10 starts a second, or ``--clear``: claims past it move nothing, a held delivery
        waits in its worker without an attempt, a paced call starts no earlier than booked."""
        destination = self.rng.choice(c.DESTINATIONS).name
        in_flight = self.rng.choice([None, 1, 2, 3])
        per_second = self.rng.choice([None, None, 2.0, 10.0])
        self.side_threads.append(
            self._thread(
                f"operator limit {destination} to {in_flight or 'none'} in flight, {per_second or 'any'}/s",
                lambda: c.operator_limit(self.operator_engine, destination, in_flight, per_second),
            )
        )

    # -- the schedule ------------------------------------------------------------------------------

    def _wait(self) -> float:
        return self.rng.choice([0.02, 0.1, 0.3, 1.0])

    def _steps(self) -> list[tuple[float, Callable[[], Any]]]:
        f = self.cfg.faults
        steps: list[tuple[float, Callable[[], Any]]] = [
            (3, self.step_write),
            (3, self.step_relay),
            (1, self.step_start_worker),
            (5, self.step_fetch),
            (8, self.step_advance),
            (3, self.step_reconcile),
            (1.5, self.step_job),
            (1, self.step_sleep),
        ]
        if "purge" in f:
            steps.append((0.7, self.step_rewrite))
            steps.append((0.3, self.step_rewrite_batch))
        steps.append((0.5, self.step_cancel))
        steps.append((0.6, self.step_write_batch))
        if "lock" in f:
            steps += [(1, self.step_block), (1, self.step_unblock)]
        if "pg_drop" in f:
            steps.append((0.4, self.step_pg_drop))
        if self.can_cut:
            steps += [(0.4, self.step_pg_unreachable), (1, self.step_pg_reachable)]
        # Not a fault: a process that lost a connection (a cut, a terminated backend) asks.
        steps.append((1.5, self.step_probe))
        if "late_claim" in f:
            steps.append((0.8, self.step_late_claim))
        if "redis_flush" in f:
            steps.append((0.2, self.step_redis_flush))
        if "provider" in f:
            steps.append((0.8, self.step_provider))
        if "operator" in f:
            steps += [(1, self.step_operator_resolve), (0.6, self.step_operator_replay)]
            steps += [(0.4, self.step_operator_pause), (0.6, self.step_operator_resume)]
            steps.append((0.5, self.step_operator_limit))
            steps.append((0.6, self.step_operator_repair))
            steps.append((0.4, self.step_old_release_replay))
        return steps

    def run(self) -> list[Finding]:
        self.reconciler_offset = self._offset()
        self.log(f"reconciler: clock offset {self.reconciler_offset:+.1f} s; lease {self.lease} s")
        self._start_worker(self._offset())
        self._start_worker(self._offset())
        steps = self._steps()
        for _ in range(self.cfg.steps):
            # The reconciler is drawn more often while a call is under way or an unknown row is
            # due: that is when its timing matters.
            urgent = sum(self.tracker.in_progress.values()) > 0 or bool(
                self.sql(
                    "SELECT 1 FROM outbox_message WHERE state = 'unknown' AND available_at <= now() LIMIT 1"
                )
            )
            w = [x * 4 if fn == self.step_reconcile and urgent else x for x, fn in steps]
            # A step whose precondition does not hold (nothing parked, nothing queued) is drawn
            # again, so that every step of the budget does something.
            for _draw in range(20):
                before = len(self.events)
                _, step = self.rng.choices(steps, w)[0]
                try:
                    step()
                except Exception as exc:
                    self.log(f"step {step.__name__}: {type(exc).__name__}: {exc}")
                if len(self.events) > before:
                    break
            time.sleep(self.rng.choice([0.0, 0.05, 0.1]))
        stuck = self.quiesce()
        findings = stuck + self.check()
        return findings + self.retry_batches_after_purge()

    def retry_batches_after_purge(self) -> list[Finding]:
        """Once everything settled: the retention passes, the purge moves the sent rows into the
        ledger and replaces finished batches' then/catch payloads by their SHA-256, and the
        application retries every batch's transaction: each must get its old rows back."""
        if "purge" not in self.cfg.faults or not self.batches:
            return []
        time.sleep(self.cfg.retention + 0.2)
        self.step_job_sync("purge")
        stripped = self.sql("SELECT count(*) FROM outbox_batch WHERE then_step ? 'payload_sha256'")[0][0]
        self.log(f"after the retention: {stripped} of {len(self.batches)} batch(es) stripped")
        for name in sorted(self.batches):
            members, then, catch, ids = self.batches[name]
            try:
                again = c.write_batch(self.engine, name=name, members=members, then=then, catch=catch)
            except Exception as exc:
                again, error = [], f"{type(exc).__name__}: {exc}"
            else:
                error = ""
            if again != ids:
                self.batch_retries.append(
                    Finding("batch retry", f"batch {name} retried: rows {again} {error}, first {ids}", ids)
                )
        return list(self.batch_retries)

    # -- quiescence --------------------------------------------------------------------------------

    def quiesce(self) -> list[Finding]:
        """Stop injecting faults and let relay, workers, reconciler and the operator (by the
        runbook) run until nothing changes; bounded by cfg.quiesce_seconds."""
        self.log(f"quiescence: faults off ({len(self.events)} events so far)")
        self.cfg = dataclasses.replace(self.cfg, faults=frozenset({"operator", "purge"}) & self.cfg.faults)
        self.tracker.processing_seconds = 0.0
        self.step_late_claim(all_=True)
        self.provider.configure(
            fail_before_rate=0.0,
            fail_after_rate=0.0,
            drop_after_rate=0.0,
            hang_after_rate=0.0,
            latency_ms=0.0,
            lookup_fail=False,
            retry_after="",
        )
        self.step_unblock(all_=True)
        for proc in self.procs:
            proc.cut_at_next_claim = proc.cut_at_next_record = False
        for name in sorted(self.cuts):
            self._restore(name)
        # The runbook: the provider is back, the operator resumes every paused destination (once
        # the pauses under way have committed).
        for thread in self.side_threads:
            thread.join(5.0)
        for destination in c.DESTINATIONS:
            c.operator_resume(self.operator_engine, destination.name)
            c.operator_limit(self.operator_engine, destination.name, None)
        for run in self.runs:
            run.release()
        if self.relay_run is not None:
            self.relay_run.release()
        if not any(p.alive and p.clock_offset == 0 for p in self.procs):
            self._start_worker(0.0)
        deadline = time.monotonic() + self.cfg.quiesce_seconds
        jobs = [j for j in c.reconciler_jobs(self.reconciler) if j != "purge"]
        stable = 0
        while time.monotonic() < deadline:
            for thread in [*self.job_threads.values(), *self.side_threads]:
                thread.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if self.relay_run is None or self.relay_run.done:
                self.step_relay()
            if self.relay_run is not None:
                self.relay_run.thread.join(5.0)
            for name in sorted(self.cuts):
                self._restore(name)  # armed by a run that read its flag as quiescence cleared it
            while any(p.alive and not p.fetching for p in self.procs):
                before = [p.name for p in self.procs if p.alive and not p.fetching]
                self.step_probe(wait=10.0)
                if [p.name for p in self.procs if p.alive and not p.fetching] == before:
                    break
            while True:
                run = self.step_fetch(free=True)
                if run is None:
                    break
                run.thread.join(10.0)
            for run in self.runs:
                run.thread.join(max(0.0, min(5.0, deadline - time.monotonic())))
            for name in jobs:
                self.step_job_sync(name)
            self.step_operator_resolve(patient=True)
            # A batch whose members are terminal may still wait out a failed member's late
            # record before its then/catch row is written: open until it is finished.
            open_rows = self.sql(
                "SELECT (SELECT count(*) FROM outbox_message WHERE state <> ALL(%s))"
                " + (SELECT count(*) FROM outbox_batch WHERE finished_at IS NULL)",
                (sorted(TERMINAL),),
            )
            busy = any(not r.done for r in self.runs) or any(t.is_alive() for t in self.side_threads)
            self.log(f"quiescence: {open_rows[0][0]} row(s) not terminal or batch(es) open, busy={busy}")
            if open_rows[0][0] == 0 and not busy:
                stable += 1
                if stable >= 2:
                    break
            else:
                stable = 0
                time.sleep(0.3)
        findings = []
        for thread in self.side_threads:
            thread.join(2.0)
        alive = [r.name for r in self.runs if not r.done]
        if alive:
            findings.append(Finding("harness", f"runs still going after quiescence: {alive}"))
        return findings

    def step_job_sync(self, name: str) -> None:
        thread = self._thread(f"reconciler {name}", lambda: c.run_job(self.reconciler, name))
        thread.join(15.0)

    # -- the promise --------------------------------------------------------------------------------

    def check(self) -> list[Finding]:
        findings: list[Finding] = []
        effects = c.provider_effects(self.provider)
        rows = self.sql(
            "SELECT id, key, step, destination, state, provider_ref, last_error, history "
            "FROM outbox_message ORDER BY id"
        )
        by_ikey = {c.idempotency_key(r[1], r[2]): r for r in rows}
        for ikey, count in sorted(effects.items()):
            if count > 1:
                row = by_ikey.get(ikey)
                findings.append(
                    Finding(
                        "double charge",
                        f"{ikey} charged {count} times by the provider"
                        + (f" (row {row[0]}, now {row[4]})" if row else " (row purged)"),
                        [row[0]] if row else [],
                    )
                )
        for row_id, key, step, _dest, state, ref, last_error, history in rows:
            ikey = c.idempotency_key(key, step)
            charged = effects.get(ikey, 0)
            if state not in TERMINAL:
                findings.append(
                    Finding("not terminal", f"row {row_id} ({ikey}) is {state}: {last_error}", [row_id])
                )
            if state == "failed" and charged:
                # The row's last move, not its last entry: a repair that changed nothing (its
                # lookup failed) appends an entry without "to" after the operator's resolve.
                last = next((e for e in reversed(history or []) if e.get("to")), None)
                by_operator = (
                    last is not None
                    and last.get("to") == "failed"
                    and last.get("by") == c.OPERATOR
                    and (last.get("reason") or last.get("error"))
                    and not self.sql(
                        "SELECT 1 FROM outbox_attempt WHERE message_id = %s AND started_at > "
                        "CAST(%s AS timestamptz)",
                        (row_id, last.get("at")),
                    )
                )
                if not by_operator:
                    findings.append(
                        Finding(
                            "charged but failed",
                            f"row {row_id} ({ikey}) failed although the provider "
                            f"charged it {charged} time(s): {last_error}",
                            [row_id],
                        )
                    )
            if (
                state == "sent"
                and row_id in self.operator_failed
                and not any(e.get("forced") in (True, "true") for e in history or [])
            ):
                findings.append(
                    Finding(
                        "operator overruled",
                        f"row {row_id} ({ikey}) sent after an operator's resolve --failed, no human "
                        "forcing it",
                        [row_id],
                    )
                )
            if state == "cancelled" and charged:
                findings.append(
                    Finding("charged but cancelled", f"row {row_id} ({ikey}) cancelled, charged", [row_id])
                )
            if state == "sent":
                charge = c.provider_charge(self.provider, ikey)
                if charge is None or charge["id"] != ref:
                    findings.append(
                        Finding(
                            "wrong ref",
                            f"row {row_id} ({ikey}) sent with ref {ref!r}; the provider's charge is "
                            f"{charge['id'] if charge else None!r}",
                            [row_id],
                        )
                    )
        findings += self._check_chains(effects)
        findings += self._check_hand_backs()
        findings += self._check_batches()
        findings += self._check_invalid_payloads(effects)
        findings += self._check_ordering(effects)
        died = {p.name for p in self.procs if not p.alive}
        for claim in self.lost_claims:
            token = claim["token"]
            if token is None:
                continue
            if claim["worker"] in died:
                # A group's rows fence their lost claims one delivery after another: a worker that
                # died before a row's turn left it claimed, as a crash after any claim does (its
                # lease, then the lookup). A single claim is fenced before any crash point.
                continue
            if claim.get("unreachable"):
                # Its worker could not reach PostgreSQL to settle it and handed the message back:
                # documented (docs/production.md, "A host cut off"): the row waits for its lease.
                continue
            outcome = self.sql("SELECT outcome FROM outbox_attempt WHERE claim_token = %s", (token,))
            if outcome and outcome[0][0] == "lease_expired":
                findings.append(
                    Finding(
                        "call never made, row made unknown",
                        f"row {claim['row_id']}: the reply of its committed claim was lost while "
                        f"{claim['worker']} stayed alive and made no call; the claim was left to "
                        "expire into unknown (an operator is asked to check a call that never happened)",
                        [claim["row_id"]],
                    )
                )
        return findings

    def _check_hand_backs(self) -> list[Finding]:
        """pg_unreachable: a delivery that answered unreachable made no call (found as it
        answered), and every message handed back went back to its queue: some process fetched it
        again (unless Redis was flushed since), rather than it waiting in the un-acked set of a
        live worker or being lost, leaving its row to the re-dispatch. A Redis flush while it
        was out deleted it (its requeue finds no body to put back): the re-dispatch's case."""
        findings = list(self.hand_back_findings)
        for h in self.handed_back:
            if any(at > h["seq"] for at in self.fetched_at.get(h["mid"], ())):
                continue
            if any(at > h["fetched"] for at in self.flushed_at):
                continue  # its body was deleted while it was out: there was nothing to hand back
            findings.append(
                Finding(
                    "handed back, never fetched again",
                    f"row {h['row_id']}: {h['run']} handed its message {h['mid']} back; no process "
                    "fetched it again",
                    [h["row_id"]] if h["row_id"] is not None else [],
                )
            )
        if self.handed_back:
            again = sum(
                any(at > h["seq"] for at in self.fetched_at.get(h["mid"], ())) for h in self.handed_back
            )
            self.log(f"hand-backs: {len(self.handed_back)}, fetched again {again}")
        return findings

    def _check_ordering(self, effects: dict[str, int]) -> list[Finding]:
        """issue 15: within an ordering key, the provider took the rows' first charges in the
        order of their ids (commit order), whatever crashed, was re-dispatched or replayed."""
        findings: list[Finding] = []
        first_charge = {k: n for n, k in enumerate(effects)}  # the provider's order of first effects
        rows = self.sql(
            "SELECT ordering_key, id, key, step FROM outbox_message "
            "WHERE ordering_key IS NOT NULL ORDER BY ordering_key, id"
        )
        by_key: dict[str, list[tuple[int, int]]] = {}
        for ordering_key, row_id, key, step in rows:
            at = first_charge.get(c.idempotency_key(key, step))
            if at is not None:
                by_key.setdefault(ordering_key, []).append((row_id, at))
        for ordering_key, charged in by_key.items():
            order = [at for _, at in charged]
            if order != sorted(order):
                ids = [row_id for row_id, _ in charged]
                findings.append(
                    Finding(
                        "ordering broken",
                        f"ordering key {ordering_key}: rows {ids} (id order) were first charged in "
                        f"the order {[row_id for row_id, _ in sorted(charged, key=lambda x: x[1])]}",
                        ids,
                    )
                )
        return findings

    def _check_invalid_payloads(self, effects: dict[str, int]) -> list[Finding]:
        """issue 15: a payload the handler's model refuses is never sent to the provider, and its
        row ends failed (or cancelled), never sent."""
        findings: list[Finding] = []
        for key, step in sorted(self.invalid_keys):
            ikey = c.idempotency_key(key, step)
            rows = self.sql("SELECT id, state FROM outbox_message WHERE key = %s AND step = %s", (key, step))
            ids = [r[0] for r in rows]
            if effects.get(ikey):
                findings.append(
                    Finding("invalid payload called", f"{ikey} charged {effects[ikey]} time(s)", ids)
                )
            for row_id, state in rows:
                if state not in ("failed", "cancelled"):
                    findings.append(
                        Finding("invalid payload not failed", f"row {row_id} ({ikey}) {state}", [row_id])
                    )
        return findings

    def _check_chains(self, effects: dict[str, int]) -> list[Finding]:
        """issue 14: a step is sent exactly when its next step exists (or the reason it could not
        be written is flagged on it); a compensation exists only for a step that failed and was
        never charged."""
        findings: list[Finding] = []
        for row_id, key, step in self.sql(
            """SELECT p.id, p.key, p.step FROM outbox_message p
               WHERE p.destination = 'ix.charge' AND p.state = 'sent'
                 AND (p.chain_problem IS NULL OR p.chain_problem = %s)
                 AND NOT EXISTS (SELECT 1 FROM outbox_message n
                                 WHERE n.parent_id = p.id AND n.via = 'then')
                 AND NOT EXISTS (SELECT 1 FROM outbox_key_ledger n
                                 WHERE n.parent_id = p.id AND n.via = 'then')""",
            (NOT_COMPUTED,),
        ):
            findings.append(Finding("sent without its next step", f"row {row_id} ({key}:{step})", [row_id]))
        for row_id, parent_id, parent_state in self.sql(
            """SELECT n.id, p.id, p.state FROM outbox_message n JOIN outbox_message p ON p.id = n.parent_id
               WHERE n.via = 'then' AND p.state <> 'sent'"""
        ):
            findings.append(
                Finding(
                    "next step of an unconfirmed step",
                    f"row {row_id}: parent {parent_id} is {parent_state}",
                    [row_id, parent_id],
                )
            )
        for row_id, parent_id, key, step, parent_state in self.sql(
            """SELECT n.id, p.id, p.key, p.step, p.state FROM outbox_message n
               JOIN outbox_message p ON p.id = n.parent_id WHERE n.via = 'on_failure'"""
        ):
            charged = effects.get(c.idempotency_key(key, step), 0)
            if parent_state != "failed" or charged:
                findings.append(
                    Finding(
                        "compensation of a step that may have taken effect",
                        f"row {row_id} compensates row {parent_id} ({parent_state}, "
                        f"charged {charged} time(s))",
                        [row_id, parent_id],
                    )
                )
        return findings

    def _check_batches(self) -> list[Finding]:
        """issue 14: every batch ends once its members are terminal, with exactly one row of its
        outcome (then: none failed; catch: a member failed, or did before its replay)."""
        findings: list[Finding] = []
        for batch_id, name, outcome, written, failed_now, failed_ever in self.sql(
            """SELECT b.id, b.name, b.outcome,
                      (SELECT array_agg(m.via || ':' || m.step) FROM outbox_message m
                       WHERE m.key = b.name AND m.via LIKE 'batch_%%'),
                      EXISTS (SELECT 1 FROM outbox_message m WHERE m.batch_id = b.id AND m.state = 'failed'),
                      EXISTS (SELECT 1 FROM outbox_message m WHERE m.batch_id = b.id
                              AND (m.state = 'failed' OR m.history @> '[{"from": "failed"}]'))
               FROM outbox_batch b ORDER BY b.id"""
        ):
            expected = {"then": ["batch_then:done"], "catch": ["batch_catch:undo"]}.get(outcome)
            if outcome is None:
                findings.append(Finding("batch never finished", f"batch {batch_id} ({name})", []))
            elif (written or []) != expected:
                findings.append(
                    Finding("batch rows", f"batch {batch_id} ({name}) ended {outcome}, wrote {written}", [])
                )
            elif (outcome == "then" and failed_now) or (outcome == "catch" and not failed_ever):
                findings.append(
                    Finding(
                        "batch outcome", f"batch {batch_id} ({name}) ended {outcome} against its members", []
                    )
                )
        return findings

    @property
    def refused_connections(self) -> int:
        """How often PostgreSQL refused a component a connection (a server shared with other test
        runs may be full): rows may then legitimately still be moving when quiescence ends."""
        return sum("too many clients" in text for _, text, _ in self.events)

    # -- the report ------------------------------------------------------------------------------------

    def explain(self, findings: list[Finding]) -> str:
        lines = []
        row_ids = sorted({r for f in findings for r in f.row_ids})
        for row_id in row_ids[:6]:
            lines.append(f"--- row {row_id}")
            for r in self.sql(
                "SELECT state, destination, ordering_key, attempts, releases, "
                "round(extract(epoch FROM available_at - now())::numeric, 1), dispatched_at IS NOT NULL, "
                "priority, fairness_key, batch_id FROM outbox_message WHERE id = %s",
                (row_id,),
            ):
                lines.append(
                    f"  now: {r[0]} on {r[1]}, ordering key {r[2]}, attempts {r[3]}, releases {r[4]}, "
                    f"due in {r[5]} s, dispatched {r[6]}, priority {r[7]}, fairness {r[8]}, batch {r[9]}"
                )
            for holder, state, error in self.sql(
                f"SELECT e.id, e.state, e.last_error FROM outbox_message m JOIN outbox_message e "
                f"ON e.ordering_key = m.ordering_key AND e.id < m.id "
                f"WHERE m.id = %s AND e.state NOT IN ('sent', 'cancelled') AND {HOLDING_SQL} ORDER BY e.id",
                (row_id,),
            ):
                lines.append(f"  held back by row {holder} of its ordering key ({state}: {error})")
            for r in self.sql(
                "SELECT attempt, started_at, finished_at, outcome, http_status, claim_token "
                "FROM outbox_attempt WHERE message_id = %s ORDER BY id",
                (row_id,),
            ):
                claim = self.claims.get(r[5], {})
                lines.append(
                    f"  attempt {r[0]}: {r[3]} (http {r[4]}) by {claim.get('worker', '?')}"
                    f" clock {claim.get('offset', 0):+.1f} s, claim took {claim.get('waited', 0):.2f} s"
                )
            for (history,) in self.sql("SELECT history FROM outbox_message WHERE id = %s", (row_id,)):
                for h in history or []:
                    lines.append(f"  history: {h}")
            for t, text, rid in self.events:
                if rid == row_id:
                    lines.append(f"  {t:7.2f}s {text}")
        lines.append("--- the whole schedule")
        lines += [f"  {t:7.2f}s {text}" for t, text, _ in self.events]
        return "\n".join(lines[:600])

    def close(self) -> None:
        self._stop.set()
        self._heart.join(5.0)
        self.step_unblock(all_=True)
        # The runbook: the provider is back, the operator resumes every paused destination (once
        # the pauses under way have committed).
        for thread in self.side_threads:
            thread.join(5.0)
        for destination in c.DESTINATIONS:
            c.operator_resume(self.operator_engine, destination.name)
            c.operator_limit(self.operator_engine, destination.name, None)
        for run in self.runs:
            run.release()
        if self.relay_run is not None:
            self.relay_run.release()
        for thread in [r.thread for r in self.runs] + [*self.job_threads.values(), *self.side_threads]:
            if thread.ident is not None:
                thread.join(5.0)
        for proc in self.procs:
            proc.stop()
        for forwarder in self.forwarders.values():
            forwarder.close()
        with contextlib.suppress(Exception):
            self.reconciler.close()
        if self.relay is not None:
            with contextlib.suppress(Exception):
                self.relay.close()
        with contextlib.suppress(Exception):
            delete_namespace(self.redis, self.namespace)
        self.redis.close()
        self.engine.dispose()
        self.operator_engine.dispose()
        if self._sql_conn is not None:
            self._sql_conn.close()
