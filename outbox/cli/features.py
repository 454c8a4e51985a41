"""``outbox features`` and ``outbox features enable NAME`` (outbox.features holds the rules)."""

from __future__ import annotations

import argparse

from .. import settings
from ..exceptions import ConfigError, FeatureRefused
from ..features import DEFAULT_SETTLE_SECONDS
from . import exits
from .common import UsageError, connection
from .output import err, out, print_json

_HELP = """
Features that stay off until no process older than them runs (rolling deploys).

`outbox migrate` changes the schema under running processes, which checked it when they
started. A feature whose rows an older release would mishandle is refused by the database until
it is enabled here; enabling refuses while any live relay, worker or reconciler runs code that
does not know it (each beats with the schema range its code accepts; a beat without one is a
release before ranges), and raises the floor so that such code, restarted, refuses to start.
Rules the database enforces itself (per-key ordering at the claim, an operator's resolve
--failed) need nothing here (docs/production.md, "Rolling deploys").

  outbox features                                   list them, on or off, and what keeps each off
  outbox features enable payload_versions --reason "all workers on 0.30"

Exit 1 when enabling is refused (the live processes are named); 0 when enabled or on already.
"""


def arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = _HELP.strip()
    p.add_argument("action", nargs="?", choices=["list", "enable"], default="list", help="default: list")
    p.add_argument("name", nargs="?", help="the feature to enable")
    p.add_argument("--reason", help="why now (recorded; required with enable)")
    p.add_argument("--by", help="who (default: $USER or the login name)")
    p.add_argument(
        "--settle",
        type=float,
        default=DEFAULT_SETTLE_SECONDS,
        metavar="SECONDS",
        help="wait between raising the floor and the last look for older processes "
        f"(default {DEFAULT_SETTLE_SECONDS:g})",
    )


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from ..features import FEATURES, enable, states
    from ..ops.actions import default_actor

    if args.action == "list":
        if args.name:
            raise UsageError("outbox features lists them all; to turn one on: outbox features enable NAME")
        with connection(cfg) as conn:
            found = states(conn)
        if args.json:
            return print_json({"features": [f.to_dict() for f in found]})
        for state in found:
            f = state.feature
            if state.enabled:
                assert state.enabled_at is not None
                line = f"{f.name}: on since {state.enabled_at:%Y-%m-%d %H:%M:%S %Z} by {state.enabled_by}"
                out(line + (f" ({state.reason})" if state.reason else ""))
                for holdout in state.holdouts:
                    out(f"  WARNING: {holdout} does not know it (started as it was enabled?): stop it")
            else:
                out(f"{f.name}: off (needs code from revision {f.needs_code}: {f.why})")
                for holdout in state.holdouts:
                    out(f"  kept off by {holdout}")
                if not state.holdouts:
                    out(f"  nothing keeps it off: outbox features enable {f.name} --reason …")
        return exits.OK
    if not args.name:
        raise UsageError(f"enable which feature? ({', '.join(sorted(FEATURES))})")
    if not (args.reason or "").strip():
        raise UsageError("--reason is required: why it is safe now, for the next reader")
    from ..db import make_engine

    if args.settle < 0:
        raise ConfigError("--settle must be 0 or more seconds")
    if args.name not in FEATURES:
        raise ConfigError(f"no feature named {args.name!r}; the features are: {', '.join(sorted(FEATURES))}")
    engine = make_engine(cfg.require_database_url(), connect_args={"application_name": "outbox ops"})
    try:
        if not args.json:
            err(
                f"enabling {args.name}: looking for older processes now, and again {args.settle:g} s after "
                "raising the floor (one that started just before shows itself by then)"
            )
        state = enable(
            engine,
            args.name,
            by=args.by or default_actor(),
            reason=args.reason.strip(),
            settle_seconds=args.settle,
        )
    except FeatureRefused as exc:
        if args.json:
            body = {"name": args.name, "enabled": False, "holdouts": exc.processes}
            return print_json(body, error=str(exc), exit_code=exits.FAILED)
        err(str(exc))
        return exits.FAILED
    finally:
        engine.dispose()
    if args.json:
        return print_json(state.to_dict())
    assert state.enabled_at is not None
    out(
        f"{state.feature.name}: on since {state.enabled_at:%Y-%m-%d %H:%M:%S %Z} by {state.enabled_by}; "
        f"code older than revision {state.feature.needs_code} no longer starts on this database"
    )
    return exits.OK
