"""``outbox demo``, the run: servers, processes, chaos and progress, then the audit.

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
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from sqlalchemy import Engine, text

from outbox.cli.render import render

from .. import settings, states
from ..exceptions import ConfigError
from ..testing.embedded import free_port
from .base import (
    DEMO_NAMESPACE,
    DESTINATION,
    EXIT_INTERRUPTED,
    FAST_ENV,
    KEY_PREFIX,
    ORDERS_TABLE,
    STOP_GRACE_SECONDS,
    TICK_SECONDS,
    WORKER_KILL_EVERY_SECONDS,
    WORKERS,
    DemoFailed,
    Options,
)
from .chain import run_chain_phase
from .chaos import Chaos, ChaosPlan, Counters
from .display import Display, Progress, make_display
from .processes import (
    Child,
    Supervisor,
    kill_leftovers,
    start_provider,
    start_reconciler,
    start_relay,
    start_shop,
    start_shop_setup,
    start_worker,
    wait_for_provider,
    wait_for_setup,
    wait_until_started,
)
from .report import (
    DemoAudit,
    RunScope,
    breaker_state,
    breaker_totals,
    final_audit,
    floors,
    ops_audit,
    orders_written,
    state_counts,
)
from .servers import make_engine, migrate, require_embedded, start_servers


def _options(args: argparse.Namespace) -> Options:
    namespace = args.namespace or DEMO_NAMESPACE
    return Options(
        orders=args.orders,
        rate=args.rate,
        chaos=not args.no_chaos,
        timeout_seconds=args.timeout,
        seed=args.seed,
        namespace=namespace,
        # The command line only: OUTBOX_DATABASE_URL and OUTBOX_REDIS_URL are your application's.
        database_url=args.database_url,
        redis_url=args.redis_url,
        keep_logs=args.keep_logs,
        plain=args.plain,
        outage_seconds=args.outage,
        chain=not args.no_chain,
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
        self.chaos: Chaos | None = None
        self.counters = Counters()

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
        self.display.text(
            f"outbox demo: {opts.orders} orders at {opts.rate:g}/s → relay → {WORKERS} workers → "
            "payment provider simulator (no deduplication), reconciler watching"
        )
        self.display.text(f"working directory {self.workdir} (process logs in {self.log_dir})")
        # The provider needs neither server: it starts first, and every Python process after
        # it starts at once, since on a small machine their imports are most of the wait.
        provider_url = f"http://127.0.0.1:{free_port()}"
        provider_ready = self.workdir / "provider.url"
        sup = self.supervisor = Supervisor(self.log_dir, self._child_env(provider_url))
        provider = start_provider(sup, provider_url, opts.seed, provider_ready)
        servers = start_servers(
            stack, self.workdir / "servers", opts.database_url, opts.redis_url, opts.namespace
        )
        self.display.text(servers.describe(opts.namespace))
        sup.env.update(OUTBOX_DATABASE_URL=servers.database_url, OUTBOX_REDIS_URL=servers.redis_url)
        engine = make_engine(stack, servers.database_url)
        migrated = migrate(engine)
        if migrated:
            self.display.text(migrated)

        setup = start_shop_setup(sup)
        relay = start_relay(sup)
        workers = [start_worker(sup, i + 1) for i in range(WORKERS)]
        reconciler = start_reconciler(sup)
        wait_for_provider(provider, provider_url, provider_ready)
        wait_for_setup(setup)
        with engine.connect() as conn:
            order_floor, message_floor = floors(conn, ORDERS_TABLE)
            started_at: datetime = conn.execute(text("SELECT now()")).scalar_one()
        scope = RunScope(ORDERS_TABLE, KEY_PREFIX, DESTINATION, order_floor, message_floor, started_at)
        markers = [
            (relay, "relay started"),
            *((w, "outbox worker started") for w in workers),
            (reconciler, "reconciler started"),
        ]
        wait_until_started(markers)
        self.display.text(
            "started: "
            + ", ".join(f"{c.name} (pid {c.pid})" for c, _ in markers)
            + f" after {self.elapsed():.1f} s"
        )
        plan = ChaosPlan.for_run(opts.orders, opts.rate, opts.chaos, opts.outage_seconds)
        if opts.chaos:
            outage = (
                f", the provider down (503) from {plan.outage_at:.1f} s to {plan.outage_end:.1f} s"
                if plan.outage_at is not None and plan.outage_end is not None
                else ""
            )
            self.display.text(
                f"chaos: a worker SIGKILLed every {WORKER_KILL_EVERY_SECONDS:g} s "
                f"({len(plan.worker_kills)} times), the relay SIGKILLed at {plan.relay_kill:.1f} s, "
                f"Redis flushed at {plan.redis_flush:.1f} s{outage} (counted from the first order)"
            )
        else:
            self.display.text("chaos: off")
        self.chaos = Chaos(
            sup, servers, opts.namespace, self.display, self.elapsed, self.counters, provider_url
        )

        shop = start_shop(sup, opts.orders, opts.rate, opts.seed)
        with httpx.Client(base_url=provider_url, timeout=5.0) as provider_client:
            timed_out = self._watch(engine, scope, provider_client, shop, plan)
            # Frozen before counting: nothing moves while the audit reads.
            sup.stop([c for c in sup.children if c.role != "provider"], STOP_GRACE_SECONDS)
            result = self._audit(engine, scope, provider_client, timed_out)
            if not (result.ok and opts.chain):
                return 0 if result.ok else 1
            chain = run_chain_phase(sup, engine, provider_client, self.display.text, started_at)
        if not chain.ok:
            self.display.text("FAIL (chain):")
            for problem in chain.problems:
                self.display.text(f"  - {problem}")
        return 0 if chain.ok else 1

    def _child_env(self, provider_url: str) -> dict[str, str]:
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
            PYTHONUNBUFFERED="1",
        )
        return env

    # -- watching ----------------------------------------------------------------------------------

    def _progress(self, engine: Engine, scope: RunScope, provider: httpx.Client, phase: str) -> Progress:
        with engine.connect() as conn:
            written = orders_written(conn, scope)
            by_state = state_counts(conn, scope)
        stats: dict[str, Any] = {}
        with contextlib.suppress(httpx.HTTPError):
            stats = provider.get("/_stats").raise_for_status().json()
        c = self.counters
        with engine.connect() as conn:
            breaker = breaker_state(conn, DESTINATION)
        return Progress(
            breaker=breaker,
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
    ) -> bool:
        """Inject the chaos and show progress until every row is terminal; True on timeout."""
        sup, chaos = self.supervisor, self.chaos
        assert sup is not None and chaos is not None
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
                chaos.step(plan, time.monotonic() - first_order)
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
        if c.outages:
            with engine.connect() as conn:
                trips, probes = breaker_totals(conn, DESTINATION)
            self.display.text(
                f"provider outage: {c.outage_seconds:.1f} s of 503s; {c.outage_calls} call(s) reached it "
                f"meanwhile (without the breaker every waiting row would have spent its attempts "
                f"on them); breaker tripped {trips}x, {probes} probe(s); rows failed: "
                f"{result.by_state.get(states.FAILED, 0)}"
            )
        self.display.text("\n" + render(report))
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
    """The ``outbox demo`` command: exit 0 only on a clean audit. ``cfg`` is not read: the
    environment's settings are your application's, never the demo's."""
    options = _options(args)
    require_embedded(options.database_url, options.redis_url)
    return Demo(options, make_display(plain=options.plain)).run()
