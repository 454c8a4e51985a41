"""The progress of ``outbox demo``: a rich ``Live`` panel on a terminal, plain lines otherwise.

Plain lines are also what a pipe or a CI log gets, and what a machine without ``rich`` gets:
a redrawn panel is noise in a file.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from .. import states
from .report import DemoAudit


@dataclass
class Progress:
    elapsed: float = 0.0
    phase: str = "starting"
    orders_target: int = 0
    orders_written: int = 0
    rate: float = 0.0
    by_state: dict[str, int] = field(default_factory=lambda: dict.fromkeys(states.ALL, 0))
    charges: int | None = None
    charged_twice: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    worker_kills: int = 0
    worker_restarts: int = 0
    relay_kills: int = 0
    redis_flushes: int = 0
    chaos: bool = True
    #: The destination's circuit breaker, in words (outbox.demo.report.breaker_state).
    breaker: str = "closed"

    def chaos_line(self) -> str:
        if not self.chaos:
            return "off (--no-chaos)"
        return (
            f"workers SIGKILLed {self.worker_kills}x (restarted {self.worker_restarts}x), "
            f"relay SIGKILLed {self.relay_kills}x, Redis flushed {self.redis_flushes}x"
        )

    def provider_line(self) -> str:
        if self.charges is None:
            return "waiting for the provider"
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none yet"
        return f"charges {self.charges}, keys charged twice {self.charged_twice}; faults injected: {faults}"


class Display(Protocol):
    def __enter__(self) -> Display: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def event(self, message: str) -> None: ...

    def update(self, progress: Progress) -> None: ...

    def audit(self, result: DemoAudit, elapsed_seconds: float) -> None: ...

    def text(self, message: str = "") -> None: ...


class PlainDisplay:
    """One status line every few seconds, and each chaos event as it happens."""

    def __init__(self, every_seconds: float = 2.0) -> None:
        self.every_seconds = every_seconds
        self._last = 0.0

    def __enter__(self) -> PlainDisplay:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.stdout.flush()

    def text(self, message: str = "") -> None:
        print(message, flush=True)

    def event(self, message: str) -> None:
        self.text(f"  * {message}")

    def update(self, progress: Progress) -> None:
        now = time.monotonic()
        if now - self._last < self.every_seconds and progress.phase != "done":
            return
        self._last = now
        shown = " ".join(f"{s} {progress.by_state[s]}" for s in states.ALL if progress.by_state[s])
        charges = "-" if progress.charges is None else str(progress.charges)
        self.text(
            f"[{progress.elapsed:5.1f} s] {progress.phase}: orders {progress.orders_written}/"
            f"{progress.orders_target} | rows: {shown or 'none yet'} | charges {charges}, "
            f"twice {progress.charged_twice} | kills: worker {progress.worker_kills}, "
            f"relay {progress.relay_kills}, flushes {progress.redis_flushes} | breaker {progress.breaker}"
        )

    def audit(self, result: DemoAudit, elapsed_seconds: float) -> None:
        self.text("audit of this run")
        self.text(result.render_plain(elapsed_seconds))


class RichDisplay:
    """A live panel redrawn on each update (no refresh thread: spawns stay on the main thread)."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console()
        self._live: Any = None

    def __enter__(self) -> RichDisplay:
        from rich.live import Live

        self._live = Live(console=self.console, auto_refresh=False, transient=False)
        self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None

    def text(self, message: str = "") -> None:
        # soft_wrap: wide tables (the outbox audit) overflow like print() rather than fold.
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def event(self, message: str) -> None:
        self.console.print(f"  [bold yellow]*[/] {message}", highlight=False)

    def update(self, progress: Progress) -> None:
        if self._live is not None:
            self._live.update(self._render(progress), refresh=True)

    def _render(self, p: Progress) -> Any:
        from rich.panel import Panel
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        target = max(p.orders_target, 1)
        width = 30
        filled = int(width * min(p.orders_written, target) / target)
        grid.add_row(
            "orders written",
            f"[green]{'█' * filled}[/][dim]{'░' * (width - filled)}[/] {p.orders_written}/{p.orders_target}"
            f" at {p.rate:g}/s",
        )
        row_states = Table.grid(padding=(0, 2))
        for _ in states.ALL:
            row_states.add_column(justify="right")
        colour = {
            states.SENT: "green",
            states.UNKNOWN: "magenta",
            states.FAILED: "red",
            states.IN_FLIGHT: "cyan",
        }
        row_states.add_row(*(f"[{colour.get(s, 'white')}]{s}[/]" for s in states.ALL))
        row_states.add_row(*(str(p.by_state[s]) for s in states.ALL))
        grid.add_row("rows by state", row_states)
        grid.add_row("provider", p.provider_line())
        grid.add_row("chaos", p.chaos_line())
        grid.add_row("breaker", p.breaker)
        return Panel(grid, title=f"outbox demo — {p.phase} — {p.elapsed:.1f} s", border_style="blue")

    def audit(self, result: DemoAudit, elapsed_seconds: float) -> None:
        from rich.table import Table

        table = Table(title="audit of this run", title_justify="left")
        table.add_column("check")
        table.add_column("value", justify="right")
        table.add_column("")
        for what, value, note in result.rows_for_table(elapsed_seconds):
            bad = note == "must be 0" and value != "0"
            style = "bold red" if bad else ("green" if note == "must be 0" else "")
            table.add_row(what, f"[{style}]{value}[/]" if style else value, note)
        self.console.print(table)


def make_display(*, plain: bool = False) -> Display:
    """Rich on a terminal when rich is installed; plain lines otherwise."""
    if not plain and sys.stdout.isatty():
        try:
            import rich  # noqa: F401
        except ImportError:
            pass
        else:
            return RichDisplay()
    return PlainDisplay()
