"""The operator commands: flags in, ``outbox.ops`` data out, printed as text or one JSON
document (``outbox.cli.output``). The logic lives in ``outbox.ops``; nothing here touches SQL."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import settings, states
from ..exceptions import ConfigError
from . import exits
from .common import UsageError, add_module, by_and_reason, connection, describe, parse_id
from .output import err, out, print_json
from .render import render

if TYPE_CHECKING:
    from ..ops.doctor import Check
    from ..ops.inspect import StatusReport


# status


def status_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Counts of outbox rows by destination and state, the unknown and failed counts, the total,
        and the oldest pending age: how long the longest-waiting *due* pending row has been due
        (rows waiting out a retry backoff are not late). A growing oldest pending age means no
        relay is publishing. Then one line per destination with rows waiting (pending or
        dispatched) and no live worker serving its queue, from the workers' heartbeats:
        "no consumer for D since T, K rows waiting" (JSON: no_consumer). Read-only.

        --watch refreshes it every --interval (default 2s) until Ctrl-C (exit 0): a live table
        on a terminal (with rich installed, the demo extra; else the screen is redrawn), one
        table per refresh when stdout is not a terminal, one JSON document per line with
        --json. --count N stops after N refreshes.
        """,
    )
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C (exit 0)")
    p.add_argument(
        "--interval",
        metavar="S",
        help=f"with --watch: seconds between refreshes, or 30s, 1m (default {WATCH_INTERVAL})",
    )
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")


#: The default --interval of `status --watch`.
WATCH_INTERVAL = "2s"


def status(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.inspect import status as status_of

    if not args.watch:
        if args.interval is not None or args.count is not None:
            raise UsageError("--interval and --count go with --watch")
        with connection(cfg) as conn:
            report = status_of(conn)
        if args.json:
            print_json(report.to_dict())
        else:
            out(render(report))
        return exits.OK
    interval = settings.parse_seconds(args.interval or WATCH_INTERVAL, "--interval")
    if interval <= 0:
        raise ConfigError("--interval must be above 0 seconds")
    if args.count is not None and args.count < 1:
        raise ConfigError("--count must be at least 1")
    from .watch import watch

    def take() -> StatusReport:
        with connection(cfg) as conn:
            return status_of(conn)

    return watch(take, interval=interval, count=args.count, as_json=args.json)


# show


def show_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Every step of a business key (outbox show order:42): one line a step, in the order they
        were written, with its milestones (written, published, first claimed, confirmed with the
        provider's reference; a purged step from the key ledger), and where the key's work
        stopped and why (the first step neither sent nor cancelled). A key made of digits only
        reads as a row id: give its step.

        One outbox row, by id (outbox show 42) or by business key and step
        (outbox show order:42 charge): every column, every attempt (the attempt rows, in claim
        order: #, attempt, claim token, started/finished, outcome, HTTP status, error) and the
        operator history. A replay resets the attempt number, so # counts every claim of the row
        (#1, #2, ...) and a line "-- replay by WHO at T, failed -> pending: REASON" marks where
        each history entry falls between them (JSON: each attempt's number and run, each history
        entry's after_attempt).
        The payload is replaced by its size and top-level keys, since it may hold personal data;
        pass --payload to print it. A key whose row was purged shows its key-ledger entry
        (final state, provider ref, attempts, ambiguous history, payload hash) until the ledger
        horizon. Exit 1 when there is no such row.
        """,
    )
    p.add_argument(
        "target", metavar="ID|KEY", help="the row id, or a business key (every step; with STEP, that row)"
    )
    p.add_argument("step", nargs="?", metavar="STEP", help="the step, with KEY: outbox show order:42 charge")
    p.add_argument(
        "--payload", action="store_true", help="also print the payload (may contain personal data)"
    )


def show(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.step is None and not args.target.strip().isdigit():
        return _show_key(args, cfg)
    if args.step is None:
        lookup: dict[str, Any] = {
            "row_id": parse_id(args.target, "to look a row up by key, give its step too")
        }
    else:
        lookup = {"key": args.target, "step": args.step}
    from ..ops.inspect import show as show_row

    with connection(cfg) as conn:
        detail = show_row(conn, **lookup, payload=args.payload)
    if args.json:
        print_json(detail.to_dict())
    else:
        out(render(detail))
    return exits.OK


def _show_key(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.inspect import key_steps

    with connection(cfg) as conn:
        report = key_steps(conn, args.target)
    if args.json:
        print_json(report.to_dict())
    else:
        out(render(report))
    return exits.OK


# list, and its shortcuts failed / unknown


def _list_arguments(state: str | None, description: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        from ..settings import DEFAULT_LIST_LIMIT

        describe(p, description)
        if state is None:
            p.add_argument(
                "--state",
                action="extend",
                nargs="+",
                metavar="S",
                help=f"only rows in these states (repeatable; default: every state): {', '.join(states.ALL)}",
            )
        p.add_argument("--destination", help="only rows of this destination (exit 1 if no row names it)")
        p.add_argument(
            "--key-prefix", metavar="P", help="only rows whose key starts with P (taken literally)"
        )
        p.add_argument(
            "--limit",
            type=int,
            default=DEFAULT_LIST_LIMIT,
            help=f"at most N rows (default {DEFAULT_LIST_LIMIT})",
        )
        p.set_defaults(list_state=state)

    return add


def list_rows(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.inspect import check_states
    from ..ops.inspect import list_rows as rows_in

    # `outbox failed` is `outbox list --state failed`; a bad state is refused before connecting.
    asked = [args.list_state] if args.list_state else getattr(args, "state", None)
    wanted = check_states(asked or states.ALL)
    with connection(cfg) as conn:
        listed = rows_in(
            conn, wanted, destination=args.destination, key_prefix=args.key_prefix, limit=args.limit
        )
    if args.json:
        print_json(listed.to_dict())
    else:
        out(render(listed))
    return exits.OK


list_arguments = _list_arguments(
    None,
    """
            List rows by state, destination and key prefix, longest in their state first: id, key,
            step, destination, state, attempts, age (time in the state: since it became unknown,
            was claimed, dispatched, failed or settled; a pending row's since it became due) and
            last error. `outbox failed` and `outbox unknown` are `outbox list --state failed` and
            `--state unknown`. Read-only.

            outbox list --state pending dispatched --destination payments.charge
            outbox list --key-prefix order:42 --json
            """,
)
failed_arguments = _list_arguments(
    states.FAILED,
    """
            List failed rows, longest failed first: id, key, step, destination, attempts, age (time
            since it failed) and last error; `outbox list --state failed`. Fix the cause, then
            `outbox replay`. Read-only.
            """,
)
unknown_arguments = _list_arguments(
    states.UNKNOWN,
    """
            List unknown rows (the call may or may not have taken effect), longest unknown first:
            id, key, step, destination, attempts, age (time since it became unknown) and last
            error; `outbox list --state unknown`. Ask the provider, then `outbox resolve`.
            Read-only.
            """,
)


# replay


def replay_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Give failed rows another chance: failed -> pending, attempts reset to 0, due now. Only
        failed rows move (each row is one guarded UPDATE … WHERE state = 'failed'); any other row
        is refused untouched, so a sent row can never be replayed. The replayed row goes through
        the normal claim, like a new one. The claim token and provider reference of the earlier
        attempts are kept, and who/when/why is appended to the row's history. The relay is woken
        with NOTIFY.

        Replay rules: a failed row is also refused, with the reason, when a call for it may have
        taken effect, i.e. one of its attempts (attempt rows) ended
          - confirmed by the provider (sent, superseded:sent), or
          - ambiguous (unknown, lease_expired, superseded:unknown, no outcome recorded, any
            outcome other than retry/failed/released) and was not settled since, by the
            reconciler's lookup finding no record (within the destination's key_ttl) or by
            `outbox resolve ID --not-sent`;
        or when an operator failed it out of unknown (`outbox resolve ID --failed`). Such a row
        is replayed only by naming it alone with --force and --reason (never in bulk), after you
        checked with the provider that a new call cannot charge twice; the force and what it
        overrode are recorded in the row's history.

        Bulk replays (--destination, or several ids) print a preview first: what will be
        replayed, what is refused and why, a plan fingerprint, and the exact command to act.
        Nothing changes without --yes, and --yes needs --plan PLAN, the fingerprint of the
        preview you reviewed: it acts only if a fresh preview still matches it (otherwise
        nothing changes, exit 1), then on those rows and only them, each only if it is still
        the same failure and the rules still allow it.

        outbox replay 42 --reason "card updated"                  replay one row
        outbox replay 41 42 43                                    preview these rows
        outbox replay --destination payments.charge               preview a destination
        outbox replay --destination payments.charge --yes --plan 3f2a9c0d1e4b
        outbox replay 42 --force --reason "provider: no charge for order:42 (ticket 981)"

        Exit 0 after a preview without --yes (nothing changed) and when everything asked for was
        replayed; 1 if any row was refused, changed since the preview, or does not exist (the
        others are replayed), or if --plan no longer matches (nothing changed); 2 for a bulk
        --yes without --plan (nothing changed).
        """,
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="row ids to replay")
    p.add_argument("--destination", help="replay every failed row of this destination instead (previewed)")
    p.add_argument(
        "--yes", action="store_true", help="act on the previewed rows (bulk replays; needs --plan)"
    )
    p.add_argument(
        "--plan",
        metavar="PLAN",
        help="with --yes, required in bulk: act only if the preview's plan fingerprint is still PLAN",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replay one row the replay rules refuse (one ID, with --reason; never in bulk)",
    )
    by_and_reason(p)


def replay(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if bool(args.ids) == bool(args.destination):
        raise UsageError("replay takes row ids or --destination D, not both and not neither")
    ids = [parse_id(raw, "replay takes row ids") for raw in args.ids]
    if args.force and (args.destination or len(set(ids)) != 1):
        raise UsageError("--force replays one row named by its id, never in bulk (not with --destination)")
    if args.force and not (args.reason and args.reason.strip()):
        raise UsageError("--force needs --reason: why replaying this row cannot charge twice")
    if args.plan and not args.yes:
        raise UsageError("--plan checks the preview before acting: give it with --yes")
    bulk = bool(args.destination) or len(set(ids)) > 1
    # A bulk --yes acts on what the operator reviewed, never on a fresh query nobody saw: the
    # preview's fingerprint names that set (like cancel --destination's --max-id).
    if bulk and args.yes and not args.plan:
        raise UsageError(
            "--yes needs the preview's --plan PLAN: run the command without --yes first, review "
            "what it will replay, then run the command it prints"
        )
    act = args.yes or not bulk
    from ..ops.actions import execute_replay, plan_replay

    with connection(cfg, write=act) as conn:
        plan = plan_replay(conn, ids, destination=args.destination, force=args.force)
        stale = bool(args.plan) and args.plan != plan.fingerprint
        results = [] if not act or stale else execute_replay(conn, plan, by=args.by, reason=args.reason)
    refused = [r for r in results if not r.done]
    replayed = len(results) - len(refused)
    named = ["--destination", args.destination] if args.destination else [str(i) for i in ids]
    again = " ".join(["outbox replay", *named])
    code = exits.FAILED if refused or stale else exits.OK
    if args.json:
        problem = None
        if stale:
            problem = (
                f"nothing changed: the rows changed since your preview (plan {args.plan}, "
                f"now {plan.fingerprint})"
            )
        elif refused:
            problem = "; ".join(r.message for r in refused)
        return print_json(
            {
                "destination": args.destination,
                "preview": plan.to_dict() if bulk else None,
                "acted": act and not stale,
                "replayed": replayed,
                "refused": len(refused),
                "results": [r.to_dict() for r in results],
            },
            error=problem,
            exit_code=code,
        )
    else:
        if bulk:
            out(render(plan))
        if not act:
            out(
                f"\nnothing changed: this is a preview. To replay exactly these "
                f"{len(plan.to_replay)} row(s): {again} --yes --plan {plan.fingerprint}"
            )
        elif stale:
            err(
                f"nothing changed: the rows changed since your preview (plan {args.plan}, now "
                f"{plan.fingerprint}); review the preview above and run again"
            )
        else:
            if bulk:
                out("")
            for r in results:
                if r.done:
                    out(r.message + "".join(f" (warning: {w})" for w in r.warnings))
                else:
                    err(r.message)
            if args.destination:
                out(f"replayed {replayed} failed row(s) of {args.destination}")
    return code


# resolve


def resolve_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Settle an unknown row by hand once you have asked the provider (the reconciler does this
        itself when the destination has a lookup). Exactly one of:

          --sent REF       the provider has it: sent, with its reference REF (and, with
                           --response JSON, the provider's answer as a JSON object: stored
                           sanitised as the row's response, and what its @then is given;
                           without it the @then gets response=None)
          --not-sent       the provider certainly has no record of it: back to pending, retried
                           now (attempts kept); the relay is woken with NOTIFY
          --failed REASON  give up: failed, with REASON as last_error (outbox replay can retry it)

        MODULE, the handler module, goes before ID (outbox resolve myapp.handlers 42 --sent REF):
        with --sent, the row's @then steps are written in the same transaction.

        Only an unknown row moves (one guarded UPDATE … WHERE state = 'unknown'); any other row
        is refused untouched with exit 1. Who/when/why is appended to the row's history.
        """,
    )
    add_module(
        p,
        "the handler module (e.g. myapp.handlers), before ID: with --sent, the row's @then steps are "
        "written in the same transaction; without it they are not (outbox repair writes them)",
        required=False,
        then=" ID --sent REF",
    )
    p.add_argument("id", metavar="ID", help="the row id")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--sent", metavar="REF", help="the provider's reference of the effect")
    how.add_argument("--not-sent", action="store_true", help="the call did not take effect: retry it")
    how.add_argument("--failed", metavar="REASON", help="give up with this reason")
    p.add_argument(
        "--response",
        metavar="JSON",
        help="with --sent: the provider's answer, a JSON object (stored sanitised as the row's "
        "response; the @then function is given what is stored)",
    )
    by_and_reason(p)


def _json_object(text: str | None) -> dict[str, Any] | None:
    """--response as given: a JSON object (strict JSON: no NaN or Infinity), else exit 2."""
    if text is None:
        return None

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    def finite(digits: str) -> float:
        # 1e400 parses as infinity, which would be stored as the string "Infinity".
        number = float(digits)
        if not math.isfinite(number):
            raise ValueError(f"{digits[:40]} is out of range")
        return number

    try:
        value = json.loads(text, parse_constant=refuse, parse_float=finite)
    except ValueError as exc:
        raise ConfigError(f"--response is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError("--response is nested too deeply to read") from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f"--response must be a JSON object (the provider's answer), got {type(value).__name__}"
        )
    return value


def resolve(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.module is not None and args.module.strip().isdigit():
        raise UsageError(f"MODULE comes before the row id: outbox resolve myapp.handlers {args.module} …")
    row_id = parse_id(args.id, "resolve takes one row id")
    from ..handlers import load_module
    from ..ops.actions import resolve as resolve_row

    if args.response is not None and args.sent is None:
        raise UsageError("--response goes with --sent: it is the answer of the call the provider has")
    response = _json_object(args.response)
    handlers = load_module(args.module) if args.module else None
    with connection(cfg, write=True) as conn:
        result = resolve_row(
            conn,
            row_id,
            sent_ref=args.sent,
            not_sent=args.not_sent,
            failed_reason=args.failed,
            by=args.by,
            reason=args.reason,
            handlers=handlers,
            response=response,
        )
    if args.json:
        print_json(result.to_dict())
    else:
        out(result.message)
    return exits.OK


# cancel


def cancel_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Cancel rows that will never be sent, e.g. those of a destination no worker serves (a typo:
        `outbox status` and `outbox doctor` say "no consumer for D since T, K rows waiting"), or
        a row the provider already has after a failover lost its claim (see the runbook, "After
        a failover"). Only pending or dispatched rows move, and only when none of their calls
        may have taken effect: never claimed, or every attempt (attempt row) ended safe (retry,
        failed, released) or was settled (a lookup's "not found", resolve --not-sent). A row
        with a call the provider confirmed, or an ambiguous call nobody settled (unknown,
        lease_expired, no outcome; one only forced over with replay --force) is refused: it may
        have been charged. This is wider than the application's outbox.cancel(), which only
        takes rows never claimed. Each row is one guarded UPDATE that re-checks this; the reason
        and who did it are appended to its history, and the reason is its last_error.

        outbox cancel 41 42 --reason "duplicate order"          cancel these rows now
        outbox cancel --destination paymnets.charge --reason "typo in the release of 2 May"
                                                                  preview: what would be
                                                                  cancelled, what is refused
        outbox cancel --destination paymnets.charge --reason "…" --yes --max-id 1234
                                                                  act on the previewed rows (no
                                                                  row written after the preview)

        The messages of cancelled rows stay in Redis until a worker of that queue runs them (an
        empty run); for a typo destination, delete its keys (namespace:D and namespace:D.msgs).
        Exit 1 if any requested row was refused or does not exist (the others are cancelled).
        """,
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="row ids to cancel")
    p.add_argument(
        "--destination", help="every cancellable row of this destination instead (preview, then --yes)"
    )
    p.add_argument("--yes", action="store_true", help="with --destination: cancel, not only preview")
    p.add_argument(
        "--max-id",
        type=int,
        metavar="N",
        help="with --destination: only rows with an id up to N (the preview prints it)",
    )
    by_and_reason(p)


def cancel(args: argparse.Namespace, cfg: settings.Settings) -> int:
    ids = [parse_id(raw, "cancel takes row ids") for raw in args.ids]
    if (args.yes or args.max_id is not None) and not args.destination:
        raise UsageError("--yes and --max-id go with --destination; rows named by id are cancelled directly")
    preview = bool(args.destination) and not args.yes
    from ..ops.actions import cancel_rows

    with connection(cfg, write=not preview) as conn:
        plan = cancel_rows(
            conn,
            ids,
            destination=args.destination,
            reason=args.reason or "",
            by=args.by,
            apply=not preview,
            max_id=args.max_id,
        )
    code = exits.FAILED if plan.applied and plan.refused else exits.OK
    if args.json:
        problem = "; ".join(f"refused: {why}" for _row_id, why in plan.refused) if code else None
        return print_json(plan.to_dict(), error=problem, exit_code=code)
    else:
        verb = "cancelled" if plan.applied else "would cancel"
        out(f"{verb} {len(plan.rows)} row(s){f' of {plan.destination}' if plan.destination else ''}")
        for row_id, key, step, state in plan.rows[:20]:
            out(f"  {row_id}  {key} {step}  ({state})")
        if len(plan.rows) > 20:
            out(f"  … and {len(plan.rows) - 20} more")
        for _row_id, why in plan.refused:
            (out if preview else err)(f"refused: {why}")
        if preview and plan.rows:
            out(
                f"to cancel them: outbox cancel --destination {plan.destination} --reason "
                f"{shlex.quote(args.reason)} --yes --max-id {plan.max_id}"
            )
    return code


# doctor


def doctor_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Check every invariant of the contract against the live database and Redis, one line per
        check (ok / FAIL with what to do / skip when an earlier failure prevents it):

          database      reachable
          schema        at the migration head (else: run `outbox migrate`)
          redis         reachable
          eviction      maxmemory-policy is not allkeys-* when maxmemory is set
          namespace     set, and holding no cache or session keys
          handlers      MODULE imports and its declarations hold (time_limit < lease, backoff > 0,
                        total backoff < key_ttl)                                  [with MODULE]
          destinations  every destination with non-terminal or failed rows has a handler
                                                                                  [with MODULE]
          leases        no in_flight row past its lease by more than a minute (else the
                        reconciler is not running)
          dispatched    no dispatched row older than twice OUTBOX_REDISPATCH_AFTER
          relay         no pending row due for more than a minute (else the relay is not running)
          consumers     every destination with rows waiting (pending, dispatched) has a live worker
                        serving its queue, from the workers' heartbeats in the database; else
                        "no consumer for D since T, K rows waiting"
          clocks        each live process's clock against the database's (from its heartbeat);
                        WARN past OUTBOX_CLOCK_SKEW_WARN (default 2 s)
          failed        WARN (exit status unaffected) when rows are failed: how many, and
                        `outbox failed` to look at them
          unknown       WARN when rows are unknown for longer than OUTBOX_UNKNOWN_ALERT_AFTER
                        (default 1h): how many, and `outbox unknown` to look at them
          purge         this role is superuser or a member of pg_read_all_stats (or pg_monitor);
                        a reconciler on a role without it skips the purge
          retention     no sent/cancelled row older than OUTBOX_RETENTION plus a day (else the
                        purge is not running, skipped for that privilege, or held back by a
                        transaction left open)

        The last line sums it up: "all checks passed", "passed with N warning(s)" when a check
        says WARN, or "N check(s) failed". Exit 0 when no check failed (warnings included), 1
        otherwise.

        With --payloads (and MODULE), before rolling out new workers: only the database, the
        module and every waiting row (pending, dispatched, in_flight, unknown, failed) of a
        handler with a payload_model or upgrades, brought to the handler's version and
        validated as the worker would; exit 1 naming the first rows that do not fit (up to 20)
        and their fields. Redis is not needed.
        """,
    )
    add_module(p, "handler module to check too, e.g. myapp.handlers", required=False)
    p.add_argument(
        "--payloads",
        action="store_true",
        help="only check waiting rows' payloads against MODULE's payload models and upgrades",
    )


def doctor(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.doctor import run_checks, run_payload_checks

    if args.payloads and not args.module:
        raise UsageError("--payloads needs MODULE: the handler module whose payload models to check")
    checks = run_payload_checks(cfg, args.module) if args.payloads else run_checks(cfg, args.module)
    healthy = all(c.ok for c in checks)
    failed = sum(1 for c in checks if c.status == "FAIL")
    code = exits.OK if healthy else exits.FAILED
    if args.json:
        problem = None if healthy else f"{failed} check(s) failed"
        return print_json(
            {"ok": healthy, "checks": [c.to_dict() for c in checks]}, error=problem, exit_code=code
        )
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            out(f"{c.status:<4}  {c.name.ljust(width)}  {c.detail}")
        out(doctor_verdict(checks))
    return code


def doctor_verdict(checks: list[Check]) -> str:
    """The last line of ``outbox doctor``: never "all checks passed" under a WARN line."""
    failed = sum(1 for c in checks if c.status == "FAIL")
    warned = sum(1 for c in checks if c.status == "WARN")
    warnings = f"{warned} warning(s)" if warned else ""
    if failed:
        return f"{failed} check(s) failed" + (f", {warnings}" if warned else "")
    return f"passed with {warnings}" if warned else "all checks passed"


# audit


def audit_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Prove there was no double call. Per destination: messages by state, attempts (attempt
        rows, one per claim) against confirmed calls and sent rows, keys claimed more than once
        (retries, with examples), rows not yet terminal. Violations:

          - a sent row without the provider's reference
          - more than one attempt confirmed by the provider for one message
          - an attempt confirmed by the provider on a row that is not sent

        --since T limits the audit to messages written, claimed or settled since T, an ISO-8601
        timestamp (naive means UTC) or a duration back from now (30m, 24h, 7d). Read-only, one
        snapshot. Exit 0 when there is no violation (an empty database included), 1 otherwise.
        """,
    )
    p.add_argument(
        "--since", metavar="T", help="ISO-8601 timestamp or duration such as 24h or 7d (default: everything)"
    )


def audit(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.audit import audit as audit_of
    from ..ops.audit import parse_since

    since = parse_since(args.since) if args.since else None
    with connection(cfg) as conn:
        report = audit_of(conn, since)
    code = exits.OK if report.ok else exits.FAILED
    if args.json:
        problem = None if report.ok else f"{report.violation_count} violation(s)"
        return print_json(report.to_dict(), error=problem, exit_code=code)
    out(render(report))
    return code
