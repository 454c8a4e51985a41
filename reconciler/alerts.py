"""What the reconciler tells a human: rows that failed, and rows whose outcome stays unknown.

An alert hook is any ``Callable[[AlertRow], None]``. The default one logs at ERROR; a deploy
plugs its own (pager, chat) with ``outbox reconcile --alert-hook module:function`` or
``OUTBOX_ALERT_HOOK=module:function``. An ``AlertRow`` never carries the payload: alerts end up
in chat rooms and tickets, and payloads hold customer data.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from outbox.exceptions import ConfigError

logger = logging.getLogger(__name__)

#: Environment variable naming the alert hook; read by ``reconciler.cli`` (flags win over it).
ALERT_HOOK_ENV = "OUTBOX_ALERT_HOOK"


@dataclass(frozen=True)
class AlertRow:
    """One row a human should look at."""

    id: int
    key: str
    step: str
    destination: str
    #: ``failed`` or ``unknown`` for a row, ``chain_broken`` for a sent row whose next steps were
    #: not all written (outbox.chains); ``batch_broken`` for a batch that finished without its
    #: then/catch row (``id`` the batch's, ``key`` its name, ``step`` the row's); ``no_consumer``,
    #: ``paused`` or ``breaker_open`` for a destination (then ``id``/``key`` name its oldest
    #: waiting row: 0 and "" when none waits).
    state: str
    #: Why: the row's ``last_error`` (for ``unknown`` rows, prefixed with how long it has waited).
    reason: str
    #: Seconds since the row was written (``created_at``): how long the business operation has
    #: been waiting for its effect.
    age: float


AlertHook = Callable[[AlertRow], None]


def log_alert(row: AlertRow) -> None:
    """The default hook: one ERROR line naming the row, never its payload."""
    logger.error(
        "outbox %s:%s on %s is %s: %s",
        row.key,
        row.step,
        row.destination,
        row.state,
        row.reason,
        extra={
            "outbox_id": row.id,
            "key": row.key,
            "step": row.step,
            "destination": row.destination,
            "state": row.state,
            "reason": row.reason,
            "age_seconds": round(row.age, 1),
        },
    )


def send(hook: AlertHook, alert: AlertRow, *, about: str, extra: dict[str, object]) -> bool:
    """Give ``alert`` to ``hook``; False when the hook raised (logged with its traceback): the
    caller leaves the alert unmarked, so the next run reports it again."""
    try:
        hook(alert)
    except Exception:
        logger.exception("alert hook failed for %s; it will be reported again", about, extra=extra)
        return False
    return True


def load_alert_hook(spec: str | None) -> AlertHook:
    """``"package.module:function"`` → that function; None or empty → :func:`log_alert`."""
    if not spec or not spec.strip():
        return log_alert
    module_name, sep, attribute = spec.strip().partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"alert hook {spec!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import alert hook module {module_name!r}: {exc}") from exc
    target: object = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"alert hook {spec!r}: {module_name} has no attribute {attribute!r}") from None
    if not callable(target):
        raise ConfigError(f"alert hook {spec!r} is not callable")
    hook: AlertHook = target
    return hook
