"""Loading the user's handler module for a command, with its failures as one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exceptions import ConfigError, OutboxError

if TYPE_CHECKING:
    from ..handlers import Handler


def load_handlers(module: str) -> dict[str, Handler]:
    """``outbox.handlers.load_module``, with whatever the module raises while importing turned
    into a ConfigError naming the module: a traceback of the user's code is not ours to print."""
    from ..handlers import load_module
    from ..logs import first_line

    try:
        return load_module(module)
    except OutboxError:
        raise
    except Exception as exc:  # the user's module may raise anything while importing
        raise ConfigError(
            f"handler module {module!r} raised {type(exc).__name__} on import: {first_line(exc)}"
        ) from exc
