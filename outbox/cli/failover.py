"""``outbox failover``: show or accept the database identity (``outbox.failover``)."""

from __future__ import annotations

import argparse
import getpass

from .. import settings
from ..exceptions import ConfigError
from . import exits

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


def run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    if args.accept and not (args.reason and args.reason.strip()):
        raise ConfigError("--accept needs --reason: what was checked, for the next reader")
    from ..db import connect_raw
    from ..failover import _SHOW, Identity, _differs, accept, read_identity

    with connect_raw(cfg.require_database_url(), autocommit=True) as conn:
        if args.accept:
            current, previous = accept(conn, reason=args.reason.strip(), by=args.by or getpass.getuser())
            print(f"accepted: {current.describe()}")
            if previous is not None:
                print(f"previously recorded: {previous.describe()}")
            return exits.OK
        current, problems = read_identity(conn)
        row = conn.execute(_SHOW).fetchone()
    print(f"server:   {current.describe()}")
    for problem in problems:
        print(f"  cannot read {problem}")
    if row is None:
        print("recorded: nothing yet (the first relay, worker or reconciler records it)")
        return exits.OK
    recorded = Identity(row[0], row[1])
    print(f"recorded: {recorded.describe()} at {row[2]:%Y-%m-%d %H:%M:%S%z} by {row[3]} ({row[4]})")
    changes = _differs(recorded, current)
    if changes:
        print(f"DIFFERENT: {'; '.join(changes)} — relay, workers and reconciler are stopped")
        print("check the provider (runbook: After a failover), then: outbox failover --accept --reason …")
        return exits.FAILED
    print("same history: nothing to do")
    return exits.OK
