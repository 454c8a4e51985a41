"""The relay's INFO lines under a stream of small batches (issue 17): one line per take cost
about 7% of its CPU at 300 one-row commits a second, so takes inside a window are summed up."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter

import pytest

from outbox.relay.relay import GroupResult, _PublishLog


def batch(rows: int, destination: str = "payments.charge") -> GroupResult:
    return GroupResult(published=rows, by_destination=Counter({destination: rows}))


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_first_batch_after_a_quiet_spell_is_logged_at_once_and_the_rest_summed(caplog):
    caplog.set_level(logging.DEBUG, logger="outbox.relay.relay")
    log = _PublishLog(every_seconds=60)
    log.published(batch(3))
    assert info_lines(caplog) == ["relay published 3 rows"]
    for rows in (1, 2, 4):
        log.published(batch(rows, "mail.send" if rows == 2 else "payments.charge"))
    log.tick()  # the window has not ended: nothing more at INFO
    assert info_lines(caplog) == ["relay published 3 rows"]
    assert sum("relay published" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 3
    log.flush()  # the relay stops
    lines = info_lines(caplog)
    assert lines[0] == "relay published 3 rows"
    assert re.fullmatch(r"relay published 7 rows in 3 batches in the last \d+\.\d s", lines[1]), lines
    summary = next(r for r in caplog.records if r.getMessage() == lines[1])
    assert summary.by_destination == {"payments.charge": 5, "mail.send": 2}
    # Every row is in exactly one INFO line (what tests and operators add up).
    assert sum(int(n) for n in re.findall(r"relay published (\d+) rows", "\n".join(lines))) == 10
    log.flush()
    assert len(info_lines(caplog)) == 2, "a second flush with nothing new logs nothing"


def test_a_window_that_ended_is_summed_up_while_idle_and_the_next_batch_logged_at_once(caplog):
    caplog.set_level(logging.INFO, logger="outbox.relay.relay")
    log = _PublishLog(every_seconds=0.05)
    log.published(batch(1))
    log.published(batch(1))
    log.published(batch(1))
    assert info_lines(caplog) == ["relay published 1 rows"]
    time.sleep(0.06)
    log.tick()
    assert info_lines(caplog)[1].startswith("relay published 2 rows in 2 batches")
    time.sleep(0.06)
    log.published(batch(5))
    assert info_lines(caplog)[2] == "relay published 5 rows"
