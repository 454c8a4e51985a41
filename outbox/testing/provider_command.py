"""``outbox provider``: the payment provider simulator (``outbox.testing.provider``) as a command.

Something to point a handler at before a provider's sandbox: the quickstart's handlers charge it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from . import provider

if TYPE_CHECKING:
    from ..settings import Settings


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        f"{provider.DESCRIPTION} It charges nothing real: a stand-in for a payment provider, to try "
        "handlers against (docs/quickstart.md). Prints 'provider listening on URL' once ready."
    )
    provider.add_arguments(parser)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return provider.serve(args)
