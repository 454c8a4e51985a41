"""Every ``outbox`` subcommand, registered one way: one row of ``COMMANDS``.

A row names the command, its one-line help, the shared flags it takes (``outbox.cli.flags``), and
two dotted paths, ``module:function``: the function adding its own arguments and the function
running it. Both are imported only when that command is the one asked for, so ``outbox --help``
and ``outbox status`` import nothing they do not use.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flags import DATABASE, JSON, METRICS, REDIS


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    #: ``module:function(parser)`` adding the command's own arguments and description.
    arguments: str
    #: ``module:function(args, settings) -> exit code``.
    run: str
    #: Shared flags the command takes (outbox.cli.flags): database, redis (with namespace), json.
    flags: frozenset[str] = frozenset()
    #: Whether OUTBOX_* variables configure it. They are the application's, so the demo, which
    #: runs beside an application, reads none: a variable of theirs must neither move nor stop it.
    environment: bool = True


_SERVICE = frozenset({DATABASE, REDIS, METRICS})
_LOOK = frozenset({DATABASE, JSON})

COMMANDS: tuple[Command, ...] = (
    # Services.
    Command(
        "migrate",
        "apply the packaged migrations (alembic upgrade head)",
        "outbox.cli.services:migrate_arguments",
        "outbox.cli.services:migrate",
        frozenset({DATABASE}),
    ),
    Command(
        "relay",
        "publish committed pending rows to Redis",
        "outbox.cli.services:relay_arguments",
        "outbox.cli.services:relay",
        _SERVICE,
    ),
    Command(
        "worker",
        "run the handlers of MODULE as Dramatiq workers",
        "outbox.cli.services:worker_arguments",
        "outbox.cli.services:worker",
        _SERVICE,
    ),
    Command(
        "reconcile",
        "expire leases, resolve unknown rows, re-queue lost messages, purge, alert",
        "outbox.cli.reconcile:arguments",
        "outbox.cli.reconcile:run",
        _SERVICE,
    ),
    # Operator commands.
    Command(
        "status",
        "counts by destination and state, oldest pending age",
        "outbox.cli.operator:status_arguments",
        "outbox.cli.operator:status",
        _LOOK,
    ),
    Command(
        "show",
        "one row with its attempts and history: show ID, or show KEY STEP",
        "outbox.cli.operator:show_arguments",
        "outbox.cli.operator:show",
        _LOOK,
    ),
    Command(
        "list",
        "list rows by --state, --destination, --key-prefix",
        "outbox.cli.operator:list_arguments",
        "outbox.cli.operator:list_rows",
        _LOOK,
    ),
    Command(
        "failed",
        "list failed rows (outbox list --state failed)",
        "outbox.cli.operator:failed_arguments",
        "outbox.cli.operator:list_rows",
        _LOOK,
    ),
    Command(
        "unknown",
        "list unknown rows (outbox list --state unknown)",
        "outbox.cli.operator:unknown_arguments",
        "outbox.cli.operator:list_rows",
        _LOOK,
    ),
    Command(
        "replay",
        "failed -> pending again: replay ID… or --destination D",
        "outbox.cli.operator:replay_arguments",
        "outbox.cli.operator:replay",
        _LOOK,
    ),
    Command(
        "resolve",
        "settle an unknown row: resolve [MODULE] ID --sent REF | --not-sent | --failed REASON",
        "outbox.cli.operator:resolve_arguments",
        "outbox.cli.operator:resolve",
        _LOOK,
    ),
    Command(
        "cancel",
        "cancel rows no call may have charged: cancel ID… or --destination D (preview, then --yes)",
        "outbox.cli.operator:cancel_arguments",
        "outbox.cli.operator:cancel",
        _LOOK,
    ),
    Command(
        "ordering",
        "blocked ordering keys: since when, by which row, why (ordering [--limit N])",
        "outbox.cli.ordering:ordering_arguments",
        "outbox.cli.ordering:ordering",
        _LOOK,
    ),
    Command(
        "skip",
        "let an ordering key go past its failed head: skip ID --reason R",
        "outbox.cli.ordering:skip_arguments",
        "outbox.cli.ordering:skip",
        _LOOK,
    ),
    Command(
        "chains",
        "chains under way and how many stopped; chains --stalled: the keys whose work stopped",
        "outbox.cli.chains:chains_arguments",
        "outbox.cli.chains:chains",
        _LOOK,
    ),
    Command(
        "repair",
        "resume stopped keys at the first step not confirmed: repair MODULE KEY… | repair MODULE --stalled",
        "outbox.cli.chains:repair_arguments",
        "outbox.cli.chains:repair",
        _LOOK,
    ),
    Command(
        "batch",
        "a batch's progress and how it ended: batch show ID|NAME, batch watch ID|NAME",
        "outbox.cli.batches:arguments",
        "outbox.cli.batches:run",
        _LOOK,
    ),
    Command(
        "pause",
        "stop claims of a destination's rows (outage, incident): pause D --reason R [--until 30m]",
        "outbox.cli.pauses:pause_arguments",
        "outbox.cli.pauses:pause",
        _LOOK,
    ),
    Command(
        "resume",
        "end a destination's pause: resume D",
        "outbox.cli.pauses:resume_arguments",
        "outbox.cli.pauses:resume",
        _LOOK,
    ),
    Command(
        "limit",
        "cap a destination's calls in flight over every worker: limit D --in-flight N --reason R | --clear",
        "outbox.cli.limits:arguments",
        "outbox.cli.limits:run",
        _LOOK,
    ),
    Command(
        "doctor",
        "check the contract's invariants against the database and Redis",
        "outbox.cli.operator:doctor_arguments",
        "outbox.cli.operator:doctor",
        frozenset({DATABASE, REDIS, JSON}),
    ),
    Command(
        "audit",
        "attempts vs confirmed sends per destination; exit 1 on a violation",
        "outbox.cli.operator:audit_arguments",
        "outbox.cli.operator:audit",
        _LOOK,
    ),
    Command(
        "failover",
        "show or accept the database identity (failover detection)",
        "outbox.cli.failover:arguments",
        "outbox.cli.failover:run",
        _LOOK,
    ),
    Command(
        "features",
        "features kept off while older processes run: features | features enable NAME --reason R",
        "outbox.cli.features:arguments",
        "outbox.cli.features:run",
        _LOOK,
    ),
    Command(
        "dashboard",
        "serve the web dashboard (search, lifecycle, replay/resolve with a preview), or --hash-password",
        "outbox.cli.dashboard:arguments",
        "outbox.cli.dashboard:run",
        frozenset({DATABASE}),
    ),
    # Tooling: the demo adds its own URL flags (they default to embedded servers).
    Command(
        "demo",
        "run the whole pipeline with crashes injected, then audit it",
        "outbox.demo.arguments:add_arguments",
        "outbox.demo.run:run",
        environment=False,
    ),
    Command(
        "provider",
        "run the payment provider simulator on 127.0.0.1, to try handlers against",
        "outbox.testing.provider_command:arguments",
        "outbox.testing.provider_command:run",
    ),
)

BY_NAME = {c.name: c for c in COMMANDS}

#: The command list of `outbox` and `outbox --help`: every command once, by what it is for.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("services", ("migrate", "relay", "worker", "reconcile")),
    (
        "looking",
        ("status", "show", "list", "failed", "unknown", "chains", "ordering", "batch", "audit", "doctor"),
    ),
    ("acting", ("replay", "resolve", "cancel", "skip", "repair", "pause", "resume", "limit")),
    ("deploys and failover", ("features", "failover")),
    ("tools", ("dashboard", "demo", "provider")),
)


def load(dotted: str) -> object:
    """``package.module:function`` → the function (imported now)."""
    import importlib

    module, _, attribute = dotted.partition(":")
    return getattr(importlib.import_module(module), attribute)
