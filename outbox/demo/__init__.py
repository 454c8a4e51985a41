"""``outbox demo``: the whole pipeline, end to end, with crashes injected, ending in an audit.

Tooling, not product: nothing in ``outbox``, ``relay`` or ``reconciler`` imports it. Its parts:
``arguments`` (the command line, standard library only), ``run`` (the orchestration),
``servers`` (embedded or yours), ``processes`` (the children it starts and stops), ``chaos``
(the faults), ``display`` (progress), ``report`` (the audit), and the shop it drives, shipped
here so that the demo runs from an install: ``shop`` and ``handlers``.

Light on purpose: importing it builds the command without importing the demo.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from .arguments import HELP, add_arguments

if TYPE_CHECKING:
    from .. import settings


def _run(args: argparse.Namespace, cfg: settings.Settings) -> int:
    from .run import run

    return run(args, cfg)


Command = Callable[[argparse.Namespace, "settings.Settings"], int]

#: Plugged into the ``outbox`` console script by ``outbox.cli``.
COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Command]] = [
    ("demo", HELP, add_arguments, _run),
]
