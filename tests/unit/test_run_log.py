"""The INFO lines under a stream of events. The worker's: a line per sent run was about 5% of an
async worker's CPU, so sent and pending runs are DEBUG lines and every run is counted into one
INFO line every 10 s (outbox.logs.Window), while every run that needs a look (failed, unknown,
released, superseded) keeps its WARNING line. The relay's: the first batch after a quiet spell
at INFO, the rest summed (outbox.logs.Tally)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable

from outbox.consumer import _sum_runs
from outbox.logs import Tally, Window


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


def test_the_sum_line_names_sent_retried_and_failed_always_and_the_rest_when_they_happened(caplog):
    caplog.set_level(logging.INFO, logger="outbox.consumer")
    counts = Counter(
        {
            ("sent", "payments.charge"): 7,
            ("pending", "payments.charge"): 1,
            ("sent", "mail"): 2,
            ("unknown", "mail"): 1,
        }
    )
    _sum_runs(counts, 10.04)
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == "delivered: sent=9 retried=1 failed=0 unknown=1 in the last 10.0 s"
    assert (record.sent, record.retried, record.failed, record.unknown) == (9, 1, 0, 1)
    assert record.runs == 11 and record.seconds == 10.0
    assert record.by_destination == {"payments.charge": 8, "mail": 3}
    assert not hasattr(record, "released"), "a result that did not happen is not named"


def test_a_window_counts_every_event_and_sums_them_once_it_has_ended():
    sums: list[tuple[Counter[Hashable], float]] = []
    window = Window(lambda counts, seconds: sums.append((counts, seconds)), every_seconds=0.05)
    window.tick()
    assert sums == [], "nothing counted: no line"
    for what in ("sent", "sent", "failed"):
        window.count(what)
    window.tick()
    assert sums == [], "the window has not ended"
    time.sleep(0.06)
    window.tick()
    [(counts, seconds)] = sums
    assert counts == Counter({"sent": 2, "failed": 1}) and seconds >= 0.05
    window.count("pending")
    window.flush()
    assert sums[1][0] == Counter({"pending": 1})
    window.flush()
    time.sleep(0.06)
    window.tick()
    assert len(sums) == 2, "a window with nothing new sums nothing"


def test_threads_counting_into_a_window_lose_no_event():
    sums: list[Counter[Hashable]] = []
    window = Window(lambda counts, seconds: sums.append(counts), every_seconds=0.001)
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            window.tick()

    ticker = threading.Thread(target=tick)
    ticker.start()
    threads = [threading.Thread(target=lambda: [window.count("sent") for _ in range(5000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    ticker.join()
    window.flush()
    assert sum(c["sent"] for c in sums) == 40000
    assert len(sums) > 1, "the ticker summed windows while the threads counted"
