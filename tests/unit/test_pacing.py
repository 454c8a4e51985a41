"""The worker's side of a per-second limit (outbox.limits): how far ahead a claim may book its
call's start, how long a held delivery waits before its next try, and that a call never starts
before its booked start."""

from __future__ import annotations

import time

import pytest

import outbox
from outbox import consumer, limits


@pytest.fixture(autouse=True)
def _no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("outbox.handlers._registry", {})


def test_a_claim_books_at_most_a_second_ahead_or_a_quarter_of_the_room_to_start() -> None:
    roomy = outbox.handler("a.roomy", time_limit=10)(lambda d: None)
    assert roomy.pace_ahead_seconds == 1.0
    tight = outbox.handler("a.tight", time_limit=2, lease_seconds=3)(lambda d: None)
    # Room to start: 3 - 2 - 0.5 (the start margin) = 0.5 s; a quarter of it.
    assert tight.pace_ahead_seconds == 0.125
    assert not roomy.declares_limits
    paced = outbox.handler("a.paced", max_calls_per_second=0.5)(lambda d: None)
    assert paced.declares_limits and paced.max_calls_per_second == 0.5


def test_a_held_delivery_waits_for_the_next_bookable_start_but_not_past_the_hold() -> None:
    assert limits.rebook_seconds(None, 1.0) == 0.0
    assert limits.rebook_seconds(0.4, 1.0) == 0.0
    assert limits.rebook_seconds(3.0, 1.0) == pytest.approx(2.0)
    held = consumer._Hold(1, "a.paced", "0.5 calls/s")
    first = held.next_pause(at_least=2.0)
    assert first is not None and 1.6 <= first <= 2.4
    # A slow rate's next start minutes away: the pause ends with the hold, which then gives up.
    slow = consumer._Hold(2, "a.slow", "0.001 calls/s")
    pause = slow.next_pause(at_least=900.0)
    assert pause is not None and pause <= consumer.HOLD_MAX_SECONDS
    slow.since = time.monotonic() - consumer.HOLD_MAX_SECONDS
    assert slow.next_pause(at_least=900.0) is None


def test_the_call_asked_for_carries_its_booked_start() -> None:
    asked = consumer._CallAsked(handler=None, claimed=None, sent_at=1.0, not_before=2.5)  # type: ignore[arg-type]
    assert asked.not_before == 2.5 and asked.sent_at == 1.0
    assert consumer._limits_text(3, 0.5) == "3 calls in flight and 0.5 calls/s"
    assert consumer._limits_text(None, None) == "its limits"
