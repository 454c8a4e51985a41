"""The last-hour chart's count axis: round steps (1, 2 or 5 times a power of ten), from 0 to the
first step at or above the peak, at most four steps, whatever the peak."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from outbox.dashboard.chart import count_scale


def test_examples() -> None:
    assert count_scale(12) == (15, [0, 5, 10, 15])
    assert count_scale(300) == (300, [0, 100, 200, 300])
    assert count_scale(1) == (1, [0, 1])
    assert count_scale(1234.5) == (1500, [0, 500, 1000, 1500])


@given(st.floats(min_value=0.0, max_value=1e9, allow_nan=False))
def test_the_top_covers_the_peak_in_at_most_four_round_steps(peak: float) -> None:
    top, ticks = count_scale(peak)
    assert top >= peak and ticks[0] == 0 and ticks[-1] == top
    assert 2 <= len(ticks) <= 5
    step = ticks[1]
    assert step >= 1
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 5)), step
    assert all(math.isclose(b - a, step) for a, b in itertools.pairwise(ticks))
    # Not needlessly tall: one step less would not reach the peak.
    assert top - step < max(peak, 1)
