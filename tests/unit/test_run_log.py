"""The worker's INFO lines under a stream of deliveries: a line per sent run was about 5% of an
async worker's CPU, so sent and pending runs are summed (outbox.logs.Tally), while every run
that needs a look (failed, unknown, released, superseded) keeps its WARNING line."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable

from outbox.consumer import _sum_runs
from outbox.logs import Tally


def test_the_first_event_after_a_quiet_spell_is_for_info_and_the_rest_are_summed():
    sums: list[tuple[Counter[Hashable], float]] = []
    tally = Tally(lambda counts, seconds: sums.append((counts, seconds)), every_seconds=60)
    assert tally.count("sent") is True
    assert [tally.count(what) for what in ("sent", "pending", "sent")] == [False, False, False]
    tally.tick()  # the window has not ended
    assert sums == []
    tally.flush()
    [(counts, seconds)] = sums
    assert counts == Counter({"sent": 2, "pending": 1}) and 0 <= seconds < 60
    tally.flush()
    assert len(sums) == 1, "a second flush with nothing new sums nothing"


def test_an_ended_window_is_summed_while_idle_and_at_the_next_event():
    sums: list[Counter[Hashable]] = []
    tally = Tally(lambda counts, seconds: sums.append(counts), every_seconds=0.05)
    assert tally.count("a")
    assert not tally.count("a")
    time.sleep(0.06)
    tally.tick()
    assert sums == [Counter({"a": 1})]
    time.sleep(0.06)
    assert tally.count("b"), "a quiet spell ended: the next event is logged at once"
    assert not tally.count("b")
    time.sleep(0.06)
    assert tally.count("c"), "the window ended: this event starts the next"
    assert sums == [Counter({"a": 1}), Counter({"b": 1})]


def test_threads_counting_at_once_lose_no_event():
    sums: list[Counter[Hashable]] = []
    tally = Tally(lambda counts, seconds: sums.append(counts), every_seconds=0.01)
    firsts = Counter[bool]()
    lock = threading.Lock()

    def count() -> None:
        for _ in range(2000):
            first = tally.count("sent")
            with lock:
                firsts[first] += 1

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.flush()
    # Every event is in exactly one line: its own (a first) or one sum.
    assert firsts[True] + sum(c["sent"] for c in sums) == 16000
    assert firsts[False] == sum(c["sent"] for c in sums)


def test_the_sum_line_names_results_and_destinations(caplog):
    caplog.set_level(logging.INFO, logger="outbox.consumer")
    counts = Counter({("sent", "payments.charge"): 7, ("pending", "payments.charge"): 1, ("sent", "mail"): 2})
    _sum_runs(counts, 10.04)
    [record] = caplog.records
    assert record.getMessage() == "outbox runs in the last 10.0 s: 1 pending, 9 sent"
    assert record.runs == 10
    assert record.by_result == {"sent": 9, "pending": 1}
    assert record.by_destination == {"payments.charge": 8, "mail": 2}
