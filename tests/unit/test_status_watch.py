"""``outbox status --watch`` without a database: the three ways it draws (rich live table, plain
redraw, one refresh after another) and Ctrl-C as the normal end."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

import pytest

from outbox import states
from outbox.cli import exits, watch
from outbox.ops.inspect import StatusReport


def report() -> StatusReport:
    counts = {"payments.charge": {**dict.fromkeys(states.ALL, 0), states.PENDING: 2, states.FAILED: 1}}
    return StatusReport(datetime(2026, 11, 30, 12, 0, tzinfo=UTC), counts, {"payments.charge": 4.0})


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(watch, "_sleep", slept.append)
    return slept


def test_not_a_terminal_prints_one_refresh_after_another(capsys, waits):
    assert watch.watch(report, interval=1.5, count=2, as_json=False) == exits.OK
    out = capsys.readouterr().out
    assert out.count("outbox status at 2026-11-30 12:00:00+00:00 (every 1.5 s; Ctrl-C to stop)") == 2
    assert "\x1b[" not in out and waits == [1.5]


def test_json_is_one_document_per_line(capsys, waits, monkeypatch):
    # Even on a terminal: a machine reads it.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert watch.watch(report, interval=1, count=3, as_json=True) == exits.OK
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["by_state"]["pending"] for d in docs] == [2, 2, 2]


def test_a_terminal_without_rich_is_redrawn(capsys, waits, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich -> ImportError
    assert watch.watch(report, interval=1, count=2, as_json=False) == exits.OK
    out = capsys.readouterr().out
    assert out.count("\x1b[H\x1b[2J") == 2 and out.count("payments.charge") == 2


def test_a_terminal_with_rich_gets_a_live_table(capsys, waits, monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough for every column unwrapped
    assert watch.watch(report, interval=1, count=2, as_json=False) == exits.OK
    out = capsys.readouterr().out
    assert "payments.charge" in out and "TOTAL" in out and "oldest pending" in out


def test_ctrl_c_ends_the_watch_with_exit_0(capsys, monkeypatch):
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch, "_sleep", interrupt)
    assert watch.watch(report, interval=1, count=None, as_json=False) == exits.OK
    assert capsys.readouterr().out.count("outbox status at ") == 1
