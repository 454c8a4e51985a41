"""``outbox limit [D] [--in-flight N] [--per-second R] --reason R | --clear`` (outbox.limits holds the
rules)."""

from __future__ import annotations

import argparse

from .. import settings
from . import exits
from .common import UsageError, checked_destination, connection, describe, warn_if_unknown
from .output import err, out, print_json


def arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Cap a destination's calls over every worker process on every machine, from the next
        claim on. --in-flight N: at most N calls under way at once (the database's claim trigger
        counts the destination's rows in_flight under a lock). --per-second R: call starts
        spaced 1/R seconds apart (R may be fractional: 0.5 is one call every 2 s); each claim
        books its start, at most a second ahead. A worker holds a delivery a limit refuses, its
        message not acked, and claims it once the limit lets it; no attempt is spent. Calls
        already under way finish. The operator's limits override what the handlers declare
        (@outbox.handler(..., max_in_flight=N, max_calls_per_second=R)); setting one kind keeps
        the other; --clear ends both. Without a limit or --clear: the limits that hold, with the
        calls in flight now and the rows waiting.

        outbox limit payments.charge --per-second 50 --reason "provider allows 50 requests/s"
        outbox limit payments.charge --in-flight 10 --reason "provider allows 10 connections"
        outbox limit payments.charge --clear
        outbox limit
        """,
    )
    p.add_argument("destination", nargs="?", help="the destination (queue); none: list every limit")
    p.add_argument("--in-flight", type=int, metavar="N", help="at most N calls at once (1 or more)")
    p.add_argument(
        "--per-second", type=float, metavar="R", help="at most R calls a second, starts spaced 1/R s apart"
    )
    p.add_argument("--clear", action="store_true", help="end the operator's limits (both kinds)")
    p.add_argument("--reason", help="why (required with a limit): shown by outbox limit and status")
    p.add_argument("--by", help="who (default: $USER or the login name)")


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..limits import clear_limit, limits, set_limit
    from ..ops.actions import default_actor

    setting = args.in_flight is not None or args.per_second is not None
    if args.clear and setting:
        raise UsageError("--clear or a limit (--in-flight N, --per-second R), not both")
    if args.destination is None:
        if setting or args.clear:
            raise UsageError("which destination? outbox limit D --per-second R --reason R")
        with connection(cfg) as conn:
            found = limits(conn)
        if args.json:
            return print_json({"limits": [lim.to_dict() for lim in found]})
        if not found:
            out("no destination has a limit")
        for lim in found:
            out(lim.describe())
        return exits.OK
    destination = checked_destination(args.destination)
    if args.clear:
        with connection(cfg, write=True) as conn:
            cleared = clear_limit(conn, destination, by=args.by or default_actor())
            left = limits(conn, destination)
        body = {
            "destination": destination,
            "cleared": cleared,
            "holds": left[0].holds if left else None,
            "holds_per_second": left[0].holds_per_second if left else None,
        }
        if not cleared:
            problem = f"{destination} has no operator's limit"
            if args.json:
                return print_json(body, error=problem, exit_code=exits.FAILED)
            err(problem)
            return exits.FAILED
        if args.json:
            return print_json(body)
        after = f"what its handlers declare holds: {left[0].describe()}" if left else "no limit holds now"
        out(f"cleared the limits of {destination}: {after}")
        return exits.OK
    if not setting:
        with connection(cfg) as conn:
            found = limits(conn, destination)
        if args.json:
            return print_json({"limits": [lim.to_dict() for lim in found]})
        out(found[0].describe() if found else f"{destination} has no limit")
        return exits.OK
    if not (args.reason or "").strip():
        raise UsageError("--reason is required: it is shown to whoever finds the destination limited")
    with connection(cfg, write=True) as conn:
        by = args.by or default_actor()
        done = set_limit(
            conn, destination, in_flight=args.in_flight, per_second=args.per_second, by=by, reason=args.reason
        )
        warning = warn_if_unknown(conn, destination, "limited anyway: a limit")
    if args.json:
        return print_json({**done.to_dict(), "warning": warning})
    out(f"limited {done.describe()}")
    return exits.OK
