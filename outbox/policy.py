"""Outcome classification and retry policy: what a handler's result means for the row.

Pure functions, no I/O: the consumer and the reconciler ask, the storage layer applies.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from .exceptions import AmbiguousError, PermanentError, RetryableError
from .handlers import Confirmed, Handler

logger = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    SENT = "sent"
    RETRY = "retry"  # certainly not taken effect: pending again, or failed when exhausted
    FAILED = "failed"
    UNKNOWN = "unknown"


#: 4xx answers that do not mean "never": timeout, conflict, too early, too many requests.
_NOT_PERMANENT_4XX = frozenset({408, 409, 425, 429})
#: Answers where the provider says it did not process the request.
_NOT_PROCESSED = frozenset({429, 503})

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    error: str | None = None
    http_status: int | None = None
    ref: str | None = None
    response: dict[str, Any] | None = None


def _short(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def classify_status(status: int) -> Outcome:
    if status in _NOT_PROCESSED:
        return Outcome.RETRY
    if 400 <= status < 500 and status not in _NOT_PERMANENT_4XX:
        return Outcome.FAILED
    return Outcome.UNKNOWN


def classify_exception(exc: BaseException) -> tuple[Outcome, str, int | None]:
    """Default classification of what a handler raised: (outcome, reason, http status)."""
    name = type(exc).__name__
    if isinstance(exc, PermanentError):
        return Outcome.FAILED, _short(str(exc) or name), None
    if isinstance(exc, RetryableError):
        return Outcome.RETRY, _short(str(exc) or name), None
    if isinstance(exc, AmbiguousError):
        return Outcome.UNKNOWN, _short(str(exc) or name), None
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        return classify_status(status), f"HTTP {status} from {exc.request.url.host}", status
    # The request certainly never reached the provider.
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return Outcome.RETRY, f"{name}: the request did not reach the provider", None
    if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
        return Outcome.UNKNOWN, f"{name}: no answer within the time limit", None
    if isinstance(exc, httpx.TransportError):
        return Outcome.UNKNOWN, f"{name}: the connection broke after the request was sent", None
    if type(exc).__name__ == "TimeLimitExceeded":
        return Outcome.UNKNOWN, "the handler hit its time limit", None
    if isinstance(exc, ValueError) and "JSON" in type(exc).__name__ + str(exc):
        return Outcome.UNKNOWN, _short(f"the provider's answer is not valid JSON ({exc})"), None
    # A bug in the handler: it may have raised before or after the call.
    return Outcome.UNKNOWN, _short(f"handler raised {name}: {exc}"), None


def decide_result(result: object) -> Decision:
    if isinstance(result, Confirmed):
        # The provider confirmed: the effect is real whatever its summary holds; the summary is
        # made storable when it is recorded (outbox.sanitize), not dropped here.
        return Decision(Outcome.SENT, ref=result.ref, response=result.response)
    return Decision(
        Outcome.UNKNOWN,
        error=f"handler returned {type(result).__name__}, expected outbox.Confirmed; "
        "the call may have taken effect",
    )


#: What a handler's ``classify=`` may answer; "sent" needs a provider reference, so only a
#: returned ``Confirmed`` can mean sent.
_OVERRIDABLE = {"retry": Outcome.RETRY, "failed": Outcome.FAILED, "unknown": Outcome.UNKNOWN}


def _cause_status(exc: BaseException) -> int | None:
    """The status of an ``HTTPStatusError`` the exception was raised from (``raise ... from``) or
    while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.HTTPStatusError):
            return cause.response.status_code
        # What `raise ... from` names, else what it was raised while handling (unless `from None`).
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return None


def decide_exception(handler: Handler, exc: BaseException, *, last_status: int | None = None) -> Decision:
    """``last_status`` is the last status the provider answered through ``d.http`` during the
    call: a permanent refusal keeps it (``outbox show`` prints it), since a handler that checks
    ``r.status_code`` and raises ``PermanentError`` rarely says which status it saw."""
    outcome, reason, status = classify_exception(exc)
    if handler.classify is not None:
        try:
            override = handler.classify(exc)
        except Exception:
            logger.exception("classify= of %s raised; using the default classification", handler.destination)
            override = None
        if override is not None and override not in _OVERRIDABLE:
            logger.error(
                "classify= of %s answered %r (expected retry, failed, unknown or None); "
                "using the default classification",
                handler.destination,
                override,
            )
        elif override is not None:
            outcome, reason = _OVERRIDABLE[override], _short(f"{type(exc).__name__}: {exc}")
    if outcome is Outcome.FAILED and status is None:
        status = _cause_status(exc)
        if status is None and last_status is not None and 400 <= last_status < 500:
            status = last_status
        if status is not None and f"HTTP {status}" not in reason:
            suffix = f" (HTTP {status})"
            reason = _short(reason, _MAX_ERROR_CHARS - len(suffix)) + suffix
    return Decision(outcome, error=reason, http_status=status)


@dataclass(frozen=True)
class Next:
    """Where a row goes after a decision: its state, and in how long it is due again.

    A delay, never an instant: the statement that applies it adds it to the database's clock
    (one clock for every comparison), and fails a retry that would fall on or after the row's
    deadline there too (see ``outbox.transitions``).
    """

    state: str
    delay_seconds: float | None
    error: str | None


def next_state(handler: Handler, decision: Decision, *, attempt: int) -> Next:
    outcome = decision.outcome
    if outcome is Outcome.UNKNOWN and handler.idempotent:
        # The provider deduplicates on our key: repeating the call cannot charge twice.
        outcome = Outcome.RETRY
    if outcome is Outcome.SENT:
        return Next("sent", None, None)
    if outcome is Outcome.FAILED:
        return Next("failed", None, decision.error)
    if outcome is Outcome.UNKNOWN:
        # The provider may still be executing the request we stopped waiting for: a lookup
        # before it lands would find no record and the retry would charge twice. Wait one
        # time_limit before the first lookup.
        return Next("unknown", handler.time_limit, decision.error)
    return retry_or_fail(handler, attempt=attempt, error=decision.error)


def retry_or_fail(handler: Handler, *, attempt: int, error: str | None) -> Next:
    """A retry after the next backoff, or ``failed`` when no attempt is left. Whether the retry
    still falls before the row's deadline is decided in SQL, on the database's clock."""
    if attempt >= handler.max_attempts:
        return Next("failed", None, f"gave up after {attempt} attempts; last error: {error}")
    return Next("pending", handler.backoff_seconds(attempt), error)


def deadline_error(deadline: datetime | None, error: str | None) -> str | None:
    """The reason stored when a retry would fall on or after the row's ``deadline``."""
    if deadline is None:
        return None
    return f"deadline {deadline.isoformat()} reached; last error: {error}"
