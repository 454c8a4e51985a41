"""``outbox batch show ID|NAME`` and ``outbox batch watch ID|NAME``: flags in, ``outbox.ops.batches``
out. ``watch`` is a progress bar on a terminal (rich, from the demo extra, when installed), one
line per refresh anywhere else, until the batch is finished, ``--count`` refreshes, or Ctrl-C."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import settings
from ..exceptions import ConfigError
from . import exits
from .common import UsageError, connection, describe
from .flags import positive_int
from .output import out, print_json
from .render import render

if TYPE_CHECKING:
    from ..ops.batches import BatchReport

# Looked up at each call, so that a test can make the wait instant.
_sleep = time.sleep


def _interval(value: str) -> float:
    seconds = settings.parse_seconds(value, "--interval")
    if seconds <= 0:
        raise ConfigError(f"--interval must be more than 0, got {value!r}")
    return seconds


def arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        A batch (outbox.batch): rows written in one transaction as a group; once every member
        is sent, failed or cancelled, the reconciler writes its `then` row (none failed) or its
        `catch` row (any failed), exactly once.

          show ID|NAME     its members by group (sent, failed, unknown, waiting, cancelled) of
                           the total, and how it ended (or that it is open)
          watch ID|NAME    the same as a progress bar (one line per refresh off a terminal),
                           every --interval (default 2s), until the batch is finished, --count
                           refreshes, or Ctrl-C

        outbox batch show import:2026-12-01
        outbox batch watch 42 --interval 5s

        A batch is named by its id or its name (a name of digits only reads as an id). Exit 0;
        `watch` exits 1 when the batch finished with `catch` (a member failed); 1 for no such
        batch.

        A finished batch whose members are all purged loses its then/catch payloads at
        OUTBOX_RETENTION after its finish (show still tells how it ended) and is deleted at
        OUTBOX_LEDGER_HORIZON; then show finds no such batch and the name is free (a new
        batch, new calls). Until then outbox.batch with that name and the same then/catch
        steps returns the old batch, with other steps raises BatchConflict (docs/chains.md).
        """,
    )
    p.add_argument("action", choices=("show", "watch"), help="show once, or watch until it is finished")
    p.add_argument("batch", metavar="ID|NAME", help="the batch's id or name")
    p.add_argument("--interval", default="2s", metavar="S", help="watch: time between refreshes (default 2s)")
    p.add_argument("--count", type=positive_int("--count"), metavar="N", help="watch: stop after N refreshes")


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.batches import batch_report

    target = args.batch.strip()
    # ASCII digits only ("²".isdigit() is true too), and within a bigint: else it is a name.
    as_id = target.isascii() and target.isdigit() and int(target) < 2**63
    lookup: dict[str, Any] = {"batch_id": int(target)} if as_id else {"name": args.batch}
    if args.action == "show" and (args.count is not None or args.interval != "2s"):
        raise UsageError("--interval and --count go with watch")
    interval = _interval(args.interval)

    def take() -> BatchReport:
        with connection(cfg) as conn:
            return batch_report(conn, **lookup)

    if args.action == "show":
        report = take()
        if args.json:
            return print_json(report.to_dict())
        out(render(report))
        return exits.OK
    return watch(take, interval=interval, count=args.count, as_json=args.json)


def watch(take: Callable[[], BatchReport], *, interval: float, count: int | None, as_json: bool) -> int:
    """Refresh until the batch is finished (exit 1 if it ended with ``catch``), ``count``
    refreshes, or Ctrl-C (exit 0)."""
    last: BatchReport | None = None
    try:
        if sys.stdout.isatty() and not as_json:
            try:
                import rich  # noqa: F401
            except ImportError:
                last = _lines(take, interval, count, as_json=False)
            else:
                last = _bar(take, interval, count)
        else:
            last = _lines(take, interval, count, as_json=as_json)
    except KeyboardInterrupt:
        pass
    return exits.FAILED if last is not None and last.outcome == "catch" else exits.OK


def _refreshes(count: int | None) -> Any:
    import itertools

    return range(count) if count is not None else itertools.count()


def _lines(
    take: Callable[[], BatchReport], interval: float, count: int | None, *, as_json: bool
) -> BatchReport | None:
    from ..ops.values import json_default

    report = None
    for n in _refreshes(count):
        if n:
            _sleep(interval)
        report = take()
        out(
            json.dumps(report.to_dict(), ensure_ascii=False, default=json_default)
            if as_json
            else report.line()
        )
        if report.finished:
            break
    return report


def _bar(take: Callable[[], BatchReport], interval: float, count: int | None) -> BatchReport | None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..ops.values import printable

    report = None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, TextColumn("{task.fields[detail]}"), auto_refresh=False) as progress:
        task = None
        for n in _refreshes(count):
            if n:
                _sleep(interval)
            report = take()
            c = report.counts
            detail = (
                f"[green]{c['sent']} sent[/] [red]{c['failed']} failed[/] [yellow]{c['unknown']} unknown[/] "
                f"{c['waiting']} waiting {c['cancelled']} cancelled"
            )
            if task is None:
                task = progress.add_task(
                    f"batch {printable(report.name)}", total=report.total or 1, detail=detail
                )
            progress.update(task, completed=report.done if report.total else 1, detail=detail, refresh=True)
            if report.finished:
                break
    if report is not None and report.finished:
        out(report.ending())
    return report
