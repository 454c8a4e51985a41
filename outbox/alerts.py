"""What the reconciler tells a human: rows that failed, and rows whose outcome stays unknown.

An alert hook is any ``Callable[[AlertRow], None]``. The default one logs at ERROR; a deploy
plugs its own (pager, chat) with ``outbox reconcile --alert-hook module:function`` or
``OUTBOX_ALERT_HOOK=module:function``. An ``AlertRow`` never carries the payload: alerts end up
in chat rooms and tickets, and payloads hold customer data.

Nor does it carry what a provider or a handler said: a row's ``last_error`` and its attempts'
errors are their text, which often echoes the request, hence payload values. An alert keeps the
outbox's own words (the state, the attempts, the last HTTP status, a passed deadline) and names
the command that shows the rest (``outbox show ID``, where access is the database's). Every
reason is sanitised (:func:`outbox.sanitize.clean_text`) and cut to :data:`MAX_REASON_CHARS`
characters, whoever builds the ``AlertRow``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from outbox import sanitize
from outbox.exceptions import ConfigError
from outbox.usermodules import import_user_module

logger = logging.getLogger(__name__)

#: Environment variable naming the alert hook; read by ``reconciler.cli`` (flags win over it).
ALERT_HOOK_ENV = "OUTBOX_ALERT_HOOK"

#: The longest ``AlertRow.reason``, in characters.
MAX_REASON_CHARS = 500

#: What an alert says in place of a provider's or a handler's text.
WITHHELD = "its error text is withheld from alerts (it may echo the payload)"


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
    #: Why, in the outbox's words: the state, the attempts, the last HTTP status, for ``unknown``
    #: rows how long they have waited; never the provider's text (the module's docstring).
    #: Sanitised and at most :data:`MAX_REASON_CHARS` characters.
    reason: str
    #: Seconds since the row was written (``created_at``): how long the business operation has
    #: been waiting for its effect.
    age: float
    #: The HTTP status of the row's last answered attempt, when there was one.
    http_status: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", sanitize.clean_text(self.reason, max_chars=MAX_REASON_CHARS))


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
            "http_status": row.http_status,
            "age_seconds": round(row.age, 1),
            "_shown": ("state", "reason"),
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
        module = import_user_module(module_name)
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
