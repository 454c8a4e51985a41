"""``outbox ordering`` (the blocked ordering keys) and ``outbox skip`` (let a key go past its
failed head): flags in, ``outbox.ops.ordering`` / ``outbox.ops.actions`` out."""

from __future__ import annotations

import argparse

from .. import settings
from ..ops.values import printable
from .common import by_and_reason, connection, describe, parse_id
from .flags import positive_int
from .output import out, print_json
from .render import format_table, short


def ordering_arguments(p: argparse.ArgumentParser) -> None:
    from ..ops.ordering import DEFAULT_BLOCKED_LIMIT

    describe(
        p,
        """
        The blocked ordering keys (rows written with ordering_key=): keys whose head,
        the first row that holds the rest back, has rows waiting behind it and is not simply next
        in line. One line a key, the longest blocked first: since when, by which row, and why:

          failed     outbox replay ID (the key goes on with it), or outbox skip ID --reason R
                     (the rows behind it go without it; it stays failed)
          unknown    its call may have taken effect: the reconciler's lookup settles it, or
                     outbox resolve ID; never skipped
          in_flight  a call under way, or a worker died: the reconciler expires its lease
          pending    claimed before, waiting for its retry

        Read-only. Exit 0 (with or without keys listed).
        """,
    )
    p.add_argument(
        "--limit",
        type=positive_int("--limit"),
        default=DEFAULT_BLOCKED_LIMIT,
        help=f"at most this many keys (default {DEFAULT_BLOCKED_LIMIT})",
    )


def ordering(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.ordering import blocked_keys

    with connection(cfg) as conn:
        report = blocked_keys(conn, limit=args.limit)
    if args.json:
        return print_json(report.to_dict())
    if not report.keys:
        out("no ordering key is blocked")
        return 0
    rows = [
        [
            printable(k.ordering_key),
            k.since.isoformat(timespec="seconds") if k.since else "?",
            str(k.id),
            printable(f"{k.key}:{k.step}"),
            k.state,
            str(k.waiting),
            short(printable(k.reason), 90),
        ]
        for k in report.keys
    ]
    out(format_table(["ordering key", "blocked since", "row", "key:step", "state", "waiting", "why"], rows))
    more = report.matching - len(report.keys)
    out(f"{report.matching} ordering key(s) blocked" + (f" ({more} more: --limit)" if more > 0 else ""))
    return 0


def skip_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Let the rows of a failed row's ordering key behind it go without it. The row stays
        failed (outbox replay can still run it, with --force: it would come after rows written
        after it). Only a failed row with an ordering key: an unknown or in-flight head
        may have taken effect, and is settled (outbox resolve), never skipped. One guarded
        UPDATE; --reason is required, who and why go into the row's history; the relay is woken
        at once. Exit 1 when the row is not a failed, unskipped head.
        """,
    )
    p.add_argument("id", metavar="ID", help="the failed row's id (outbox ordering lists them)")
    by_and_reason(p)


def skip(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.actions import skip as skip_row

    row_id = parse_id(args.id, "skip takes one row id")
    with connection(cfg, write=True) as conn:
        result = skip_row(conn, row_id, by=args.by, reason=args.reason)
    if args.json:
        return print_json(result.to_dict())
    out(result.message)
    return 0
