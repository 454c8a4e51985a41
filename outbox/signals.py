"""SIGTERM/SIGINT as a stop event for the long-running processes (relay, worker, reconciler)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)


def stop_event_on_signals() -> threading.Event:
    """SIGTERM/SIGINT set an event: the loops finish the batch in hand and exit 0."""
    stop = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        logger.info("received %s, stopping after the work in hand", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop
