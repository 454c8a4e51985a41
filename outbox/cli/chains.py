"""``outbox chains`` and ``outbox repair``: flags in, ``outbox.ops.repair`` (and ``.progress``) out."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

from .. import settings
from ..ops.values import printable
from . import exits
from .common import UsageError, add_module, by_and_reason, connection, describe
from .flags import duration, positive_int
from .output import err, out, print_json
from .render import render

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from ..ops.repair import StalledReport


def _selection(p: argparse.ArgumentParser, *, with_limit: bool = True) -> None:
    from ..ops.repair import DEFAULT_STALLED_LIMIT

    p.add_argument("--destination", help="only keys stopped at a step of this destination")
    p.add_argument(
        "--older-than",
        type=duration("--older-than"),
        metavar="T",
        help="only steps in their state for T or more: 90s, 15m, 2h, 0 for all (default 15m)",
    )
    if with_limit:
        p.add_argument(
            "--limit",
            type=positive_int("--limit"),
            help=f"at most this many keys, the longest stopped first (default {DEFAULT_STALLED_LIMIT})",
        )


def chains_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Without --stalled: the chains under way, one line each, the longest waiting first: the
        key, its first step still waiting (pending, dispatched, in flight), for how long, and how
        many of its steps are done (sent or cancelled) of those written; then how many keys
        `outbox chains --stalled` lists. A chain shows once a step of it was written by another's
        @then or @on_failure (at its first step it looks like a lone row). Read-only.

        --stalled: the keys whose work stopped: for each, the first step, in the order they were
        written, that is failed, unknown, waiting (pending, dispatched, in flight) or confirmed
        without its next steps, and has been so for --older-than or more (default 15m; 0 lists
        everything stopped now). The longest stopped first; `chained` says whether a step of the
        key was written by another's @then or @on_failure (the database cannot tell a lone step
        from a chain's first one: that is the handler module's). Read-only.

        outbox chains                                             chains under way
        outbox chains --stalled                                   stopped for 15 minutes or more
        outbox chains --stalled --older-than 0 --destination accounting.post
        outbox show invoice:7                                     every step of one key
        outbox repair myapp.handlers invoice:7                    its repair plan

        Exit 0 (with or without keys listed).
        """,
    )
    p.add_argument("--stalled", action="store_true", help="list the keys whose work stopped")
    _selection(p)


def _stalled(conn: Connection, args: argparse.Namespace) -> StalledReport:
    from ..ops.repair import DEFAULT_STALLED_AFTER_SECONDS, DEFAULT_STALLED_LIMIT, stalled

    return stalled(
        conn,
        destination=args.destination,
        older_than_seconds=DEFAULT_STALLED_AFTER_SECONDS if args.older_than is None else args.older_than,
        limit=DEFAULT_STALLED_LIMIT if args.limit is None else args.limit,
    )


def chains(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if not args.stalled:
        return _under_way(args, cfg)
    with connection(cfg) as conn:
        report = _stalled(conn, args)
    if args.json:
        return print_json(report.to_dict())
    out(render(report))
    return exits.OK


def _under_way(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.progress import chains_under_way
    from ..ops.repair import DEFAULT_STALLED_LIMIT
    from .render import render

    if args.older_than is not None:
        raise UsageError("--older-than goes with --stalled: the chains under way are listed however long")
    limit = DEFAULT_STALLED_LIMIT if args.limit is None else args.limit
    with connection(cfg) as conn:
        report = chains_under_way(conn, destination=args.destination, limit=limit)
    if args.json:
        return print_json(report.to_dict())
    out(render(report))
    return exits.OK


def repair_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Resume keys whose work stopped, at the first step the provider has not confirmed. For
        each key, one step per run (run it again after that step moved):

          confirmed, next steps missing   write them (computed by the step's @then)
          unknown                         ask the provider (lookup): found -> sent, next steps
                                          written, no second call; not found -> re-run once;
                                          without a lookup, re-run only an idempotent destination
          failed, ambiguous               (a call that may have taken effect) ask the provider
                                          first: found -> sent with its next steps; not found
                                          within key_ttl -> re-run; else refused
          failed by an operator           (resolve --failed, e.g. "refunded by hand") refused,
                                          neither continued nor re-run; --force asks the
                                          provider as for an ambiguous failure, on the
                                          operator's --reason
          failed for good                 (a certain answer) refused; --force re-runs it
          failed, compensated             refused (outbox replay ID --force)
          waiting                         nothing: it is under way

        A confirmed step is never re-run. Without --yes this prints the plan and changes
        nothing; with --yes each action re-checks, in its own guarded statement, that the row is
        still what the plan saw, and who (--by) and why (--reason) are appended to the row's
        history. MODULE, the first argument, is required: the next steps and the lookups are the
        handler module's.

        outbox repair myapp.handlers invoice:7                    the plan
        outbox repair myapp.handlers invoice:7 --yes --reason "ledger account added"
        outbox repair myapp.handlers --stalled --older-than 1h --yes
        outbox repair myapp.handlers invoice:7 --force --yes --reason "card updated"

        Exit 0 when every key was repaired or had nothing to repair (or after a plan without
        --yes); 1 if any key was refused, not found, changed since the plan, or its lookup
        failed (the others are repaired).
        """,
    )
    add_module(
        p,
        "the handler module (e.g. myapp.handlers): its @then steps and lookups",
        required=True,
        then=" KEY…",
        shift_into="keys",
        shift_unless="stalled",
    )
    p.add_argument("keys", nargs="*", metavar="KEY", help="business keys to repair")
    p.add_argument("--stalled", action="store_true", help="every key `outbox chains --stalled` lists")
    _selection(p)
    p.add_argument("--yes", action="store_true", help="act on the plan (without it: print the plan only)")
    p.add_argument(
        "--force",
        action="store_true",
        help="re-run a step that failed for good, or overrule an operator's resolve --failed "
        "(one KEY named alone, with --reason)",
    )
    by_and_reason(p)


def repair(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if bool(args.keys) == bool(args.stalled):
        raise UsageError("repair takes keys or --stalled, not both and not neither")
    if args.force and (args.stalled or len(set(args.keys)) != 1):
        raise UsageError(
            "--force re-runs a step that failed for good, or overrules an operator's resolve --failed: "
            "one KEY named alone, never in bulk"
        )
    if args.force and not (args.reason and args.reason.strip()):
        raise UsageError("--force needs --reason: why acting on this failed step is right now")
    if not args.stalled and (args.destination or args.older_than is not None or args.limit is not None):
        raise UsageError(
            "--destination, --older-than and --limit select among --stalled keys; named keys are "
            "repaired as named"
        )
    from ..handlers import load_module
    from ..ops.repair import execute_repair, plan_repair

    handlers = load_module(args.module)
    with connection(cfg) as conn:
        if args.stalled:
            keys = [k["key"] for k in _stalled(conn, args).keys]
        else:
            keys = list(args.keys)
        plan = (
            plan_repair(conn, keys, handlers=handlers, module=args.module, force=args.force) if keys else None
        )
    if plan is None:
        if args.json:
            return print_json({"acted": False, "keys": [], "results": []})
        out("nothing to repair: no key stopped for that long")
        return exits.OK
    results = []
    if args.yes:
        results = execute_repair(
            cfg.require_database_url(),
            plan,
            handlers=handlers,
            module=args.module,
            by=args.by,
            reason=args.reason,
        )
    # The plan's own refusals count too: a plan that can only refuse is not a success.
    failed = [r for r in results if not r.done] if args.yes else []
    refused = [] if args.yes else plan.refused
    code = exits.FAILED if failed or refused else exits.OK
    if args.json:
        problem = (
            "; ".join(
                [f"{r.key}: {r.message}" for r in failed] + [f"{i.key}: refused: {i.detail}" for i in refused]
            )
            or None
        )
        return print_json(
            {**plan.to_dict(), "acted": args.yes, "results": [r.to_dict() for r in results]},
            error=problem,
            exit_code=code,
        )
    out(render(plan))
    if not args.yes:
        for item in plan.refused:
            out(printable(f"{item.key}: refused: {item.detail}"))
        acting = [i.key for i in plan.items if i.acts]
        if not acting:
            out("\nnothing to act on: no key has a step repair can move")
            return code
        again = ["outbox", "repair", args.module, *acting]
        if args.force:
            again += ["--force", "--reason", args.reason]
        out(
            "\nnothing changed: this is the plan. To act on it: "
            + printable(" ".join(shlex.quote(a) for a in again))
            + " --yes"
        )
        return code
    out("")
    for r in results:
        (out if r.done else err)(printable(f"{r.key}: {r.message}"))
    return code
