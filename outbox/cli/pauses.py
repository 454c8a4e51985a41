"""``outbox pause D`` and ``outbox resume D`` (outbox.pauses holds the statements)."""

from __future__ import annotations

import argparse
from datetime import datetime

from .. import settings
from ..exceptions import ConfigError
from . import exits
from .common import UsageError, checked_destination, connection, describe, warn_if_unknown
from .output import err, out, print_json


def pause_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        Pause a destination: from the next claim on, no worker claims its rows (the claim
        statement reads the pause, on the database's clock). Messages a worker takes meanwhile
        are acknowledged without a claim and their rows wait `dispatched`, attempts untouched;
        rows already in flight finish. Nothing is failed or lost. The reconciler re-queues the
        waiting rows at its first run after the pause ends (outbox resume D, or --until).
        Lookups of unknown rows go on. Pausing a paused destination replaces its --until and
        --reason. Shown by outbox status and doctor, and in the metrics
        (outbox_destination_paused).

        outbox pause payments.charge --reason "provider incident INC-42"
        outbox pause payments.charge --reason "maintenance window" --until 30m
        outbox pause payments.charge --reason "…" --until 2026-12-01T18:00:00+00:00
        """,
    )
    p.add_argument("destination", help="the destination (queue) to pause")
    p.add_argument(
        "--until",
        metavar="WHEN",
        help="end the pause by itself: a duration from now (90s, 30m, 2h, 1d) or an ISO 8601 time "
        "with its offset; default: until outbox resume",
    )
    p.add_argument(
        "--reason",
        help="why (required): shown by outbox status and doctor and in the alert (card numbers masked)",
    )
    p.add_argument("--by", help="who (default: $USER or the login name)")


def resume_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        """
        End a destination's pause, and close its circuit breaker if it is open: workers claim
        its rows again at once; the rows that waited `dispatched` are re-queued by the
        reconciler's next run (OUTBOX_RECONCILE_INTERVAL) and published by the relay. A provider
        still down trips the breaker again. Exit 1 when the destination was neither paused nor
        held by its breaker.

        outbox resume payments.charge
        """,
    )
    p.add_argument("destination", help="the destination (queue) to resume")
    p.add_argument("--by", help="who (default: $USER or the login name)")


def _until(raw: str | None) -> tuple[datetime | None, float | None]:
    if raw is None:
        return None, None
    try:
        at = datetime.fromisoformat(raw)
    except ValueError:
        seconds = settings.parse_seconds(raw, "--until")
        if seconds <= 0:
            raise ConfigError(f"--until={raw!r} must be a positive duration") from None
        return None, seconds
    if at.tzinfo is None:
        raise ConfigError(f"--until={raw!r} has no UTC offset (e.g. {raw}+00:00)")
    return at, None


def pause(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.actions import default_actor
    from ..pauses import pause as pause_destination

    destination = checked_destination(args.destination)
    if not (args.reason or "").strip():
        raise UsageError("--reason is required: it is shown to whoever finds the destination paused")
    until, for_seconds = _until(args.until)
    with connection(cfg, write=True) as conn:
        done = pause_destination(
            conn,
            destination,
            by=args.by or default_actor(),
            reason=args.reason,
            until=until,
            for_seconds=for_seconds,
        )
        warning = warn_if_unknown(conn, destination, "paused anyway: a pause")
    if args.json:
        return print_json({**done.to_dict(), "warning": warning})
    ends = f"until {done.until:%Y-%m-%d %H:%M:%S %Z}" if done.until else "until outbox resume"
    out(f"paused {done.destination} {ends} (since {done.since:%Y-%m-%d %H:%M:%S %Z}): {done.reason}")
    return exits.OK


def resume(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..ops.actions import default_actor
    from ..pauses import resume as resume_destination

    destination = checked_destination(args.destination)
    with connection(cfg, write=True) as conn:
        done = resume_destination(conn, destination, by=args.by or default_actor())
    if done.pause is None and not done.breaker_closed:
        problem = f"{destination} is not paused and its breaker is not open"
        if args.json:
            body = {"destination": destination, "resumed": False, "breaker_closed": False}
            return print_json(body, error=problem, exit_code=exits.FAILED)
        err(problem)
        return exits.FAILED
    if args.json:
        body = done.pause.to_dict() if done.pause else {"destination": destination}
        return print_json({**body, "resumed": done.pause is not None, "breaker_closed": done.breaker_closed})
    if done.pause is not None:
        since = f"{done.pause.since:%Y-%m-%d %H:%M:%S %Z}"
        out(f"resumed {destination} (paused since {since} by {done.pause.by}: {done.pause.reason})")
    if done.breaker_closed:
        out(f"closed the breaker of {destination} (it opens again if the provider still refuses)")
    out("its waiting rows are re-queued by the reconciler's next run")
    return exits.OK
