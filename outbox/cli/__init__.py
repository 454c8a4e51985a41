"""The ``outbox`` console script: one parser, built from the table of ``outbox.cli.registry``.

Only the command asked for is imported (its arguments and its run function), so ``outbox
--help`` and ``outbox status`` start without loading what other commands need. Every error ends
as one line (one JSON document with ``--json``) and an exit code of ``outbox.cli.exits``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn, cast

from . import exits, flags
from .common import UsageError, json_refusal, resolve_module, usage_error
from .output import fail, report_error
from .registry import BY_NAME, COMMANDS, GROUPS, Command, load

__all__ = ["main"]

DESCRIPTION = (
    "Transactional outbox relay: rows written in your transaction are published to "
    "Dramatiq on Redis, delivered at most once per claim, and reconciled when the "
    "outcome is unknown. Settings come from OUTBOX_* environment variables; flags win. "
    "Exit codes: 0 done, 1 refused or check failed, 2 usage or configuration, 3 PostgreSQL "
    "or Redis unreachable (docs/cli.md)."
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as the error document when ``--json`` was asked for."""

    json_errors = False
    #: The command whose ``--help`` a usage error points to (``status``), once known.
    hint: str | None = None

    def error(self, message: str) -> NoReturn:
        # One line, as every other error: argparse's usage block above it buried the message.
        if _Parser.json_errors:
            fail(f"{self.prog}: {message}", exits.CONFIG, as_json=True)
        else:
            command = self.prog.removeprefix("outbox").strip() or _Parser.hint
            usage_error(command, message, as_json=False)
        self.exit(exits.CONFIG)


class _VersionAction(argparse.Action):
    # Read only when asked: importlib.metadata costs start-up time on every other command.
    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        import outbox

        print(f"outbox {outbox.__version__}")
        parser.exit()


def _selected(argv: Sequence[str]) -> tuple[Command | None, int]:
    """The subcommand named in argv (skipping the global flags and their values), if any, and
    its position."""
    skip = False
    for position, token in enumerate(argv):
        if skip:
            skip = False
        elif token in flags.WITH_VALUE:
            skip = True
        elif not token.startswith("-"):
            return BY_NAME.get(token), position
    return None, len(argv)


def build_parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the subcommands named in ``only`` get their arguments (importing their
    modules); the others have their one-line help. ``None``: every subcommand, complete."""
    parser = _Parser(
        prog="outbox",
        description=textwrap.fill(DESCRIPTION, 100),
        epilog=command_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    flags.add_global(parser)
    flags.add_shared(parser, flags.ALL)
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="one of the commands below; `outbox COMMAND --help` says more"
    )
    sub.required = True
    for command in COMMANDS:
        # No help= here: the grouped list of the epilog is the one list of commands.
        p = sub.add_parser(command.name, description=command.help)
        if only is None or command.name in only:
            flags.add_global(p, from_environment=command.environment)
            flags.add_shared(p, command.flags)
            if flags.JSON not in command.flags:
                # Taken only to be refused in the words every command uses (json_refusal).
                p.add_argument(
                    "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
                )
            cast(Callable[[argparse.ArgumentParser], None], load(command.arguments))(p)
    return parser


def command_list() -> str:
    """The commands by group, one line each, as ``outbox`` and ``outbox --help`` print them."""
    width = max(len(c.name) for c in COMMANDS) + 2
    blocks = []
    for title, names in GROUPS:
        lines = [f"  {name.ljust(width)}{BY_NAME[name].help}" for name in names]
        blocks.append(f"{title}:\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def _reject_misplaced(parser: argparse.ArgumentParser, leading: Sequence[str], command: Command) -> None:
    # A shared flag given before a subcommand that does not take it would be silently ignored.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command.name]
    for token in leading:
        option = token.split("=", 1)[0]
        if option.startswith("--") and option not in sub._option_string_actions:
            if option in parser._option_string_actions and option not in ("--log-level", "--version"):
                parser.error(f"{option} does not apply to `outbox {command.name}`")


def _unknown_command(argv: Sequence[str], position: int) -> str | None:
    """The line for a command word that names no command (with the nearest names), if any."""
    if position >= len(argv):
        return None
    import difflib

    word = argv[position]
    near = difflib.get_close_matches(word, BY_NAME, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'`outbox {n}`' for n in near)}?" if near else ""
    return f"unknown command {word!r}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected, position = _selected(argv)
    _Parser.json_errors = "--json" in argv
    _Parser.hint = selected.name if selected else None
    if selected is None and not {"-h", "--help", "--version"} & set(argv):
        unknown = _unknown_command(argv, position)
        if unknown is not None:
            return usage_error(None, unknown, as_json=_Parser.json_errors)
        # Bare `outbox` (or only global flags): the command list, as --help prints it, and exit 2:
        # no command ran, so a script whose command word went missing does not pass.
        parser = build_parser([])
        print(
            f"{parser.format_usage()}\n{command_list()}\n\n"
            "`outbox --help` adds the flags every command shares; `outbox COMMAND --help` a command's own."
        )
        return exits.CONFIG
    parser = build_parser([selected.name] if selected else [])
    args = parser.parse_args(argv)
    command = BY_NAME[args.command]
    _reject_misplaced(parser, argv[:position], command)
    if flags.JSON not in command.flags and getattr(args, "json", False):
        return usage_error(command.name, json_refusal(command.name), as_json=True)
    try:
        resolve_module(args, command.name)
        environ: dict[str, str] | None = None if command.environment else {}
        flags.defaults(args, environ)
        from .. import settings
        from ..logs import configure

        configure(args.log_level, environ)
        cfg = settings.from_env(
            environ,
            database_url=args.database_url,
            redis_url=args.redis_url,
            namespace=args.namespace,
            metrics_port=args.metrics_port,
        )
        run = cast(Callable[[argparse.Namespace, settings.Settings], int], load(command.run))
        return int(run(args, cfg))
    except UsageError as exc:
        return usage_error(command.name, str(exc), as_json=bool(getattr(args, "json", False)))
    except KeyboardInterrupt:
        # The services stop on SIGINT through their own handlers; this is an operator command
        # cut short, whose open transaction, if any, rolled back with the connection.
        return fail("interrupted", exits.INTERRUPTED, as_json=bool(getattr(args, "json", False)))
    except Exception as exc:
        return report_error(exc, as_json=bool(getattr(args, "json", False)))
