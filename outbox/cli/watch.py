"""``outbox status --watch``: the status again every interval, until Ctrl-C (exit 0) or ``--count``.

On a terminal it is a live table (rich, from the demo extra, when installed; else the screen is
cleared and the table printed again). Anywhere else nothing is redrawn: each refresh is printed
after the previous one (a table with its time, or with ``--json`` one JSON document per line), so
a pipe or a log file reads like a series of ``outbox status`` runs.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import exits
from .output import out
from .render import render

if TYPE_CHECKING:
    from ..ops.inspect import StatusReport

#: Home and clear: the redraw of a terminal without rich.
_CLEAR = "\x1b[H\x1b[2J"

# Looked up at each call, so that a test can make the wait instant or interrupt it.
_sleep = time.sleep


def watch(take: Callable[[], StatusReport], *, interval: float, count: int | None, as_json: bool) -> int:
    """Print ``take()`` every ``interval`` seconds, ``count`` times (None: until Ctrl-C)."""
    try:
        if sys.stdout.isatty() and not as_json:
            try:
                import rich  # noqa: F401
            except ImportError:
                _plain(take, interval, count, as_json=False, redraw=True)
            else:
                _live(take, interval, count)
        else:
            _plain(take, interval, count, as_json=as_json, redraw=False)
    except KeyboardInterrupt:
        # Ctrl-C is how a watch ends: not an error.
        pass
    return exits.OK


def _refreshes(count: int | None) -> range | Any:
    import itertools

    return range(count) if count is not None else itertools.count()


def _title(report: StatusReport, interval: float) -> str:
    at = report.generated_at.isoformat(sep=" ", timespec="seconds")
    return f"outbox status at {at} (every {interval:g} s; Ctrl-C to stop)"


def _plain(
    take: Callable[[], StatusReport], interval: float, count: int | None, *, as_json: bool, redraw: bool
) -> None:
    from ..ops.values import json_default

    for n in _refreshes(count):
        if n:
            _sleep(interval)
        report = take()
        if as_json:
            out(json.dumps(report.to_dict(), ensure_ascii=False, default=json_default))
        elif redraw:
            out(f"{_CLEAR}{_title(report, interval)}\n\n{render(report)}")
        else:
            out(f"{_title(report, interval)}\n\n{render(report)}\n")


def _live(take: Callable[[], StatusReport], interval: float, count: int | None) -> None:
    from rich.live import Live

    with Live(auto_refresh=False) as live:
        for n in _refreshes(count):
            if n:
                _sleep(interval)
            live.update(_table(take(), interval), refresh=True)


def _table(report: StatusReport, interval: float) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from .. import states
    from ..ops.values import age

    attention = (states.UNKNOWN, states.FAILED)
    table = Table(title=_title(report, interval), title_justify="left")
    table.add_column("destination", no_wrap=True)
    for s in states.ALL:
        # The two states that wait for a person stand out.
        table.add_column(s, justify="right", style="bold red" if s in attention else None)
    table.add_column("total", justify="right")
    table.add_column("oldest pending", justify="right")
    for d, c in report.counts.items():
        oldest = age(report.oldest_pending_age[d]) or "-"
        table.add_row(d, *(str(c[s]) for s in states.ALL), str(sum(c.values())), oldest)
    totals = report.totals()
    table.add_row(
        "TOTAL",
        *(str(totals[s]) for s in states.ALL),
        str(report.total),
        age(report.oldest_pending_age_seconds) or "-",
        style="bold",
        end_section=True,
    )
    gaps = [Text(n.describe(), style="yellow") for n in report.no_consumer]
    if not report.counts:
        return Group(Text(_title(report, interval)), Text("no outbox rows"), *gaps)
    return Group(table, *gaps)
