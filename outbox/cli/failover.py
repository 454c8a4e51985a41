"""``outbox failover``: show or accept the database identity (``outbox.failover``)."""

from __future__ import annotations

import argparse
import getpass
from typing import TYPE_CHECKING, Any

from .. import settings
from . import exits
from .common import UsageError
from .output import out, print_json

if TYPE_CHECKING:
    from ..failover import Identity

_HELP = """
Failover detection. Without options: show the database identity (system identifier, timeline)
the outbox last ran on, the server's current one, and whether the relay, workers and reconciler
are stopped because they differ (exit 0 when they match, 1 when they differ).

After a failover to a standby, or a point-in-time restore, claims committed on the old primary
may be lost: rows the provider already charged can be pending again. Before accepting, check the
provider for every row claimed since the last recorded state (runbook: "After a failover"), then
  outbox failover --accept --reason "promoted standby db2; checked charges since 14:02"
records the current identity, and the stopped processes resume within
OUTBOX_FAILOVER_CHECK_INTERVAL seconds (default 30).
"""


def arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = _HELP
    p.add_argument("--accept", action="store_true", help="record the current identity; processes resume")
    p.add_argument("--reason", help="why accepting is safe (required with --accept; card numbers masked)")
    p.add_argument("--by", help="who accepts (default: the login name)")


def _identity(identity: Identity) -> dict[str, Any]:
    return {"system_identifier": identity.system_identifier, "timeline": identity.timeline}


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.accept and not (args.reason and args.reason.strip()):
        raise UsageError("--accept needs --reason: what was checked, for the next reader")
    from ..db import connect_raw
    from ..failover import SHOW_RECORDED, Identity, accept, differences, read_identity

    with connect_raw(cfg.require_database_url(), autocommit=True) as conn:
        if args.accept:
            current, previous = accept(conn, reason=args.reason.strip(), by=args.by or getpass.getuser())
            if args.json:
                return print_json(
                    {
                        "accepted": _identity(current),
                        "previous": None if previous is None else _identity(previous),
                    }
                )
            out(f"accepted: {current.describe()}")
            if previous is not None:
                out(f"previously recorded: {previous.describe()}")
            return exits.OK
        current, problems = read_identity(conn)
        row = conn.execute(SHOW_RECORDED).fetchone()
    recorded = None if row is None else Identity(row[0], row[1])
    changes = [] if recorded is None else differences(recorded, current)
    code = exits.FAILED if changes else exits.OK
    if args.json:
        data = {
            "server": _identity(current),
            "unreadable": problems,
            "recorded": None
            if recorded is None or row is None
            else {**_identity(recorded), "at": row[2], "by": row[3], "note": row[4]},
            "same": not changes,
            "differences": changes,
        }
        problem = f"database identity changed: {'; '.join(changes)}" if changes else None
        return print_json(data, error=problem, exit_code=code)
    out(f"server:   {current.describe()}")
    for problem in problems:
        out(f"  cannot read {problem}")
    if recorded is None or row is None:
        out("recorded: nothing yet (the first relay, worker or reconciler records it)")
        return exits.OK
    out(f"recorded: {recorded.describe()} at {row[2]:%Y-%m-%d %H:%M:%S%z} by {row[3]} ({row[4]})")
    if changes:
        out(f"DIFFERENT: {'; '.join(changes)} — relay, workers and reconciler are stopped")
        out("check the provider (runbook: After a failover), then: outbox failover --accept --reason …")
        return code
    out("same history: nothing to do")
    return code
