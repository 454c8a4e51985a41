"""The overview's last-hour chart, laid out here and drawn as server-side SVG by the template:
one bar per minute at its place in the hour (a minute with nothing confirmed is a gap, not a
missing slot), a time axis every 15 minutes and a count axis (rows a minute) on round numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from .queries import LastHour, Minute

#: The SVG's user units: a 600-wide plot, 10 a minute, with room for the axes' labels.
LEFT, TOP, PLOT_WIDTH, PLOT_HEIGHT, RIGHT, BOTTOM = 52, 8, 600, 100, 16, 34
WIDTH = LEFT + PLOT_WIDTH + RIGHT
HEIGHT = TOP + PLOT_HEIGHT + BOTTOM
MINUTES = 60
#: Minutes between two labels of the time axis.
TIME_STEP = 15


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    height: float
    minute: Minute


@dataclass(frozen=True)
class Tick:
    #: Where on its axis (x for time, y for counts), in the SVG's units.
    at: float
    label: str


@dataclass(frozen=True)
class Chart:
    bars: list[Bar]
    time_ticks: list[Tick]
    count_ticks: list[Tick]
    #: The count at the top of the plot.
    top_count: float
    #: The time zone of the time axis's labels (the database session's).
    zone: str
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    top: int = TOP
    plot_width: int = PLOT_WIDTH
    plot_height: int = PLOT_HEIGHT

    @property
    def bottom(self) -> int:
        return self.top + self.plot_height

    @property
    def right(self) -> int:
        return self.left + self.plot_width


def count_scale(peak: float) -> tuple[float, list[float]]:
    """The top of the count axis and its ticks: steps of 1, 2 or 5 times a power of ten (at
    least 1 row), at most four of them, the top the first step at or above ``peak``."""
    wanted = max(peak, 1.0) / 4
    power = 10 ** math.floor(math.log10(wanted))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= wanted)
    step = max(step, 1.0)
    steps = max(1, math.ceil(max(peak, 1.0) / step - 1e-9))
    return steps * step, [i * step for i in range(steps + 1)]


def _count_label(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"


def last_hour(hour: LastHour) -> Chart | None:
    """The chart of ``hour``; None when nothing was confirmed in it (or its start is unknown)."""
    if not hour.minutes or hour.start is None:
        return None
    start = hour.start
    top_count, counts = count_scale(hour.peak)
    slot = PLOT_WIDTH / MINUTES
    bars = []
    for m in hour.minutes:
        offset = round((m.minute - start).total_seconds() / 60)
        if not 0 <= offset < MINUTES:
            continue
        height = round(m.settled / top_count * PLOT_HEIGHT, 1)
        bars.append(Bar(LEFT + offset * slot + 1, TOP + PLOT_HEIGHT - height, height, m))
    time_ticks = [
        Tick(LEFT + k * slot, (start + timedelta(minutes=k)).strftime("%H:%M"))
        for k in range(0, MINUTES + 1, TIME_STEP)
    ]
    count_ticks = [Tick(TOP + PLOT_HEIGHT - c / top_count * PLOT_HEIGHT, _count_label(c)) for c in counts]
    return Chart(bars, time_ticks, count_ticks, top_count, start.tzname() or "")
