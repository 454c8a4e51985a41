"""SIGTERM/SIGINT as a stop event for the long-running processes (relay, worker, reconciler).

The first signal sets the event: the loops finish the work in hand and exit 0. A process that
can stop at once and stay safe (the worker: a row it holds is one a crash would leave, resolved
by its lease and the reconciler) sets :attr:`Stop.force`: the same signal again calls it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Stop(threading.Event):
    """Set by the first SIGTERM/SIGINT; ``signal_name`` names it. ``announces``: the process says
    itself what it stops (the worker's line), so the signal's own line is not logged. ``force``:
    called with the signal's name when the same signal comes again (it does not return: the
    process exits)."""

    def __init__(self) -> None:
        super().__init__()
        self.signal_name: str | None = None
        self.announces = False
        self.force: Callable[[str], None] | None = None


def stop_event_on_signals() -> Stop:
    """SIGTERM/SIGINT set an event: the loops finish the batch in hand and exit 0."""
    stop = Stop()

    def handle(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # The same signal again: a second Ctrl-C, or an orchestrator's second SIGTERM. Not
            # another kind: a supervisor's SIGTERM reaches its children after the terminal's
            # SIGINT did, and must not force them out.
            if stop.force is not None and name == stop.signal_name:
                stop.force(name)
            else:
                logger.info(
                    "received %s, still stopping after the work in hand", name, extra={"signal": name}
                )
            return
        stop.signal_name = name
        if not stop.announces:
            logger.info("received %s, stopping after the work in hand", name, extra={"signal": name})
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop
