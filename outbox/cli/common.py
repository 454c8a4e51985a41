"""What several commands share: the operator's connection, the long help, the ``--by``/``--reason``
pair, row ids, destination names, the user's MODULE argument and the usage error.

Defined once here, under public names, so that no command module reaches into another's private
helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys
import textwrap
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import settings
from ..exceptions import ConfigError

if TYPE_CHECKING:
    from sqlalchemy import Connection


class UsageError(ConfigError):
    """Flags that do not go together, or a missing argument: reported as argparse's errors are,
    naming the command's ``--help`` (exit 2)."""


@contextlib.contextmanager
def connection(cfg: settings.Settings, *, write: bool = False) -> Iterator[Connection]:
    """A connection in one transaction: read-only with one snapshot for looking, committed on
    success for acting."""
    from ..db import make_engine

    engine = make_engine(cfg.require_database_url(), connect_args={"application_name": "outbox ops"})
    try:
        if write:
            with engine.begin() as conn:
                yield conn
        else:
            options = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            with engine.connect().execution_options(**options) as conn, conn.begin():
                yield conn
    finally:
        engine.dispose()


def describe(parser: argparse.ArgumentParser, description: str) -> None:
    """The command's long help, replacing the registry's one line (indentation removed)."""
    parser.description = textwrap.dedent(description).strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def by_and_reason(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", help="why, recorded in the row's history (card numbers masked)")
    parser.add_argument("--by", help="who, recorded in the row's history (default: $USER or the login name)")


def parse_id(raw: str, hint: str) -> int:
    """A row id as typed, else a configuration error ending with ``hint``."""
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{raw!r} is not a row id; {hint}") from None
    if not 1 <= value < 2**63:
        raise ConfigError(f"{raw!r} is not a row id; ids are positive 64-bit integers")
    return value


def checked_destination(raw: str) -> str:
    """A destination name as typed, checked as ``outbox.write`` checks it."""
    from ..exceptions import InvalidMessage
    from ..validation import check_destination

    try:
        check_destination(raw)
    except InvalidMessage as exc:
        raise ConfigError(str(exc)) from exc
    return raw


# MODULE: the user's handler module, the first argument of every command that takes one.

#: Where ``add_module`` keeps the deprecated ``--module`` value, and how MODULE is resolved.
_FLAG_DEST = "module_flag"
_SPEC = "module_spec"


def add_module(
    parser: argparse.ArgumentParser,
    help: str,
    *,
    required: bool,
    then: str = "",
    shift_into: str | None = None,
    shift_unless: str | None = None,
) -> None:
    """MODULE, the first positional argument (optional unless ``required``), and ``--module``, its
    former spelling, still accepted for one release and hidden from the help. ``outbox.cli.main``
    resolves the two (``resolve_module``). ``then``: what follows MODULE in the usage example
    (`` KEY…``); ``shift_into``: the positional list that, in the former spelling, held every
    positional argument (with ``--module M`` the first of them is not MODULE), unless the flag
    ``shift_unless`` is set (it takes no positional argument: one given is MODULE)."""
    # Optional to argparse even when required, so that the former spelling parses: the check is
    # resolve_module's, after it.
    parser.add_argument(
        "module", nargs="?", metavar="MODULE", help=f"{help} (required)" if required else help, default=None
    )
    parser.add_argument("--module", dest=_FLAG_DEST, metavar="MODULE", help=argparse.SUPPRESS)
    parser.set_defaults(**{_SPEC: (required, then, shift_into, shift_unless)})
    if required:
        parser.formatter_class = _showing_module_required(parser.formatter_class)


def _showing_module_required(base: Any) -> Any:
    """``base``, with a required MODULE shown as ``MODULE`` in the usage line, not ``[MODULE]``."""

    class Formatter(base):
        def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
            if action.dest == "module" and action.nargs == "?":
                return "MODULE"
            return str(super()._format_args(action, default_metavar))

    return Formatter


def resolve_module(args: argparse.Namespace, command: str) -> None:
    """Set ``args.module`` from MODULE or the deprecated ``--module`` (one line on stderr); both,
    or neither when it is required, is a usage error. A command without MODULE is left as it is."""
    spec = getattr(args, _SPEC, None)
    if spec is None:
        return
    required, then, shift_into, shift_unless = spec
    flag = getattr(args, _FLAG_DEST, None)
    shift = shift_into is not None and not (shift_unless and getattr(args, shift_unless))
    if flag is not None and shift and args.module is not None:
        # `outbox repair KEY --module M`: KEY was parsed as MODULE.
        setattr(args, shift_into, [args.module, *getattr(args, shift_into)])
        args.module = None
    if flag is not None and args.module is not None:
        raise UsageError(
            f"MODULE given twice ({args.module} and --module {flag}): give it once, as the first argument"
        )
    if flag is not None:
        print(
            f"outbox {command}: --module is deprecated; pass MODULE as the first argument: "
            f"outbox {command} {flag}{then} (--module goes in the next release)",
            file=sys.stderr,
        )
        args.module = flag
    elif args.module is None and required:
        raise UsageError(
            f"MODULE is required, the handler module first: outbox {command} myapp.handlers{then}"
        )


# --json


def json_refusal(command: str) -> str:
    """The one wording of a refused ``--json``, before or after the command's name."""
    return f"--json does not apply to `outbox {command}`: it prints no JSON document"


def usage_line(command: str | None, message: str) -> str:
    """A usage error as one line, naming the help to read (``outbox worker: error: … (outbox
    worker --help)``); ``command`` None: the top level."""
    prog = f"outbox {command}" if command else "outbox"
    return f"{prog}: error: {message} ({prog} --help)"


def usage_error(command: str | None, message: str, *, as_json: bool) -> int:
    """Report a usage error: the one line on stderr, or with ``--json`` the error document (whose
    message is ``message`` alone). Returns the exit code, 2."""
    from . import exits
    from .output import fail

    if as_json:
        return fail(message, exits.CONFIG, as_json=True)
    print(usage_line(command, message), file=sys.stderr)
    return exits.CONFIG


def warn_if_unknown(conn: Any, destination: str, anyway: str) -> str | None:
    """Warn (stderr) when no worker seen in the last day serves ``destination`` and no row of it
    waits, naming the likely one: a typo is paused or limited happily while the real destination
    goes on. ``anyway``: what was done all the same ("paused anyway: a pause"). The warning, or
    None."""
    from ..pauses import known_destinations

    known = known_destinations(conn)
    if not known or destination in known:
        return None
    close = difflib.get_close_matches(destination, sorted(known), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    warning = (
        f"warning: no worker seen in the last day serves {destination} and no row of it waits"
        f"{hint} ({anyway} may come before the destination's first row)"
    )
    from .output import err

    err(warning)
    return warning
