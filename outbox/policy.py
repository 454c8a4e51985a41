"""Outcome classification and retry policy: what a handler's result means for the row.

Pure functions, no I/O: the consumer and the reconciler ask, the storage layer applies.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from . import provider_headers
from .exceptions import AmbiguousError, PermanentError, RetryableError
from .handlers import Confirmed, Handler
from .sanitize import clean_text

logger = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    SENT = "sent"
    RETRY = "retry"  # certainly not taken effect: pending again, or failed when exhausted
    FAILED = "failed"
    UNKNOWN = "unknown"


#: 4xx answers that do not mean "never": timeout, conflict, too early, too many requests.
_NOT_PERMANENT_4XX = frozenset({408, 409, 425, 429})
#: Answers where the provider says it did not process the request.
_NOT_PROCESSED = provider_headers.NOT_PROCESSED

_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    error: str | None = None
    http_status: int | None = None
    ref: str | None = None
    response: dict[str, Any] | None = None
    #: A 429/503 answer's ``Retry-After``, in seconds: the retry is due no earlier.
    retry_after_seconds: float | None = None
    #: The provider did not take the request (a connect error, 429, 503): what a destination's
    #: breaker counts (outbox.breaker). Never true of an ambiguous outcome.
    not_processed: bool = False


def _retry_after_of(exc: BaseException, destination: str) -> float | None:
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.HTTPStatusError):
            return provider_headers.retry_after_seconds(cause.response, destination=destination)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return None


def _not_processed(exc: BaseException, last_status: int | None) -> bool:
    """Whether the provider certainly did not take the request: it could not be reached, or
    it answered 429/503 (in the exception's chain, or as the call's last answer when the
    handler raised its own error). Not a pool timeout (ours) nor a handler's own retry."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.HTTPStatusError):
            return cause.response.status_code in _NOT_PROCESSED
        if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout):
            return True
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return last_status in _NOT_PROCESSED


#: A URL inside an error text: its scheme, userinfo, authority, and the path/query/fragment after.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?:[^\s/?#@]*@)?(?P<authority>[^\s/?#]*)[^\s]*")
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: How long the cause of an unreached provider may be: a hint for on-call, not a transcript.
_MAX_CAUSE_CHARS = 200


def _unreached_cause(exc: httpx.TransportError) -> str:
    """`` (host:port: OS error)`` of a request that did not reach the provider: where it went and
    why it got no further, so that on-call tells a refused port from a DNS failure or a TLS
    refusal. Nothing of the URL but its host and port (its path, query and userinfo can carry
    credentials or payload values); credentials and card numbers in the error masked; bounded.
    Empty when neither is known. Never raises: it is part of classifying the outcome."""
    try:
        where = ""
        with contextlib.suppress(RuntimeError):  # no request attached: a handler's own error
            url = exc.request.url
            port = url.port or _DEFAULT_PORTS.get(url.scheme)
            host = f"[{url.host}]" if ":" in url.host else url.host
            where = f"{host}:{port}" if port else host
        # Cut before the search: the pattern is linear only on text of bounded length.
        why = " ".join(_URL_IN_TEXT.sub(r"\g<authority>", _os_error_text(exc)[:1000]).split())
        text = ": ".join(part for part in (where, why) if part)
        return f" ({clean_text(text, max_chars=_MAX_CAUSE_CHARS)})" if text else ""
    except Exception:
        logger.exception("the cause of %s could not be described", type(exc).__name__)
        return ""


def _os_error_text(exc: BaseException) -> str:
    """The text of the innermost OS error (``[Errno 111] Connection refused``, a resolver's or a
    TLS handshake's error) under ``exc``, else ``exc``'s own text."""
    found = str(exc)
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and str(cause):
            found = str(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return found


def short_error(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_exception(exc: Exception) -> str:
    """An exception as a short text for logs and stored errors: never the full URL (query
    strings carry idempotency keys, and sometimes credentials)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.host}"
    if isinstance(exc, httpx.RequestError):
        try:
            return f"{type(exc).__name__} talking to {exc.request.url.host}"
        except RuntimeError:  # raised by .request when the error carries no request
            return type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


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
        return Outcome.FAILED, short_error(str(exc) or name), None
    if isinstance(exc, RetryableError):
        return Outcome.RETRY, short_error(str(exc) or name), None
    if isinstance(exc, AmbiguousError):
        return Outcome.UNKNOWN, short_error(str(exc) or name), None
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        return classify_status(status), f"HTTP {status} from {exc.request.url.host}", status
    # The request certainly never reached the provider.
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        cause = _unreached_cause(exc)
        return Outcome.RETRY, f"{name}: the request did not reach the provider{cause}", None
    if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
        return Outcome.UNKNOWN, f"{name}: no answer within the time limit", None
    if isinstance(exc, httpx.TransportError):
        return Outcome.UNKNOWN, f"{name}: the connection broke after the request was sent", None
    if type(exc).__name__ == "TimeLimitExceeded":
        return Outcome.UNKNOWN, "the handler hit its time limit", None
    if isinstance(exc, ValueError) and "JSON" in type(exc).__name__ + str(exc):
        return Outcome.UNKNOWN, short_error(f"the provider's answer is not valid JSON ({exc})"), None
    # A bug in the handler: it may have raised before or after the call.
    return Outcome.UNKNOWN, short_error(f"handler raised {name}: {exc}"), None


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


def decide_exception(
    handler: Handler,
    exc: BaseException,
    *,
    last_status: int | None = None,
    last_retry_after: float | None = None,
) -> Decision:
    """``last_status`` is the last status the provider answered through ``d.http`` during the
    call: a permanent refusal keeps it (``outbox show`` prints it), since a handler that checks
    ``r.status_code`` and raises ``PermanentError`` rarely says which status it saw.
    ``last_retry_after`` is that answer's ``Retry-After`` (a 429 or 503): a retry honours it,
    whether the handler raised ``raise_for_status()``'s error or its own."""
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
            outcome, reason = _OVERRIDABLE[override], short_error(f"{type(exc).__name__}: {exc}")
    if outcome is Outcome.FAILED and status is None:
        status = _cause_status(exc)
        if status is None and last_status is not None and 400 <= last_status < 500:
            status = last_status
        if status is not None and f"HTTP {status}" not in reason:
            suffix = f" (HTTP {status})"
            reason = short_error(reason, _MAX_ERROR_CHARS - len(suffix)) + suffix
    retry_after = None
    if outcome is Outcome.RETRY:
        retry_after = _retry_after_of(exc, handler.destination)
        if retry_after is None:
            retry_after = last_retry_after
        if retry_after is not None:
            reason = short_error(f"{reason}; Retry-After {retry_after:g} s")
    return Decision(
        outcome,
        error=reason,
        http_status=status,
        retry_after_seconds=retry_after,
        not_processed=outcome is Outcome.RETRY and _not_processed(exc, last_status),
    )


@dataclass(frozen=True)
class Move:
    """Where a row goes after a decision: its state, and in how long it is due again.

    A delay, never an instant: the statement that applies it adds it to the database's clock
    (one clock for every comparison), and fails a retry that would fall on or after the row's
    deadline there too (see ``outbox.store.delivery``).
    """

    state: str
    delay_seconds: float | None
    error: str | None


def next_state(handler: Handler, decision: Decision, *, attempt: int) -> Move:
    outcome = decision.outcome
    if outcome is Outcome.UNKNOWN and handler.idempotent:
        # The provider deduplicates on our key: repeating the call cannot charge twice.
        outcome = Outcome.RETRY
    if outcome is Outcome.SENT:
        return Move("sent", None, None)
    if outcome is Outcome.FAILED:
        return Move("failed", None, decision.error)
    if outcome is Outcome.UNKNOWN:
        # The provider may still be executing the request we stopped waiting for: a lookup
        # before it lands would find no record and the retry would charge twice. Wait one
        # time_limit before the first lookup.
        return Move("unknown", handler.time_limit, decision.error)
    return retry_or_fail(
        handler, attempt=attempt, error=decision.error, at_least=decision.retry_after_seconds
    )


def retry_or_fail(
    handler: Handler, *, attempt: int, error: str | None, at_least: float | None = None
) -> Move:
    """A retry after the next backoff (or ``at_least`` seconds, the provider's ``Retry-After``,
    when longer), or ``failed`` when no attempt is left. Whether the retry still falls before
    the row's deadline is decided in SQL, on the database's clock: a Retry-After past the
    deadline fails the row then."""
    if attempt >= handler.max_attempts:
        return Move("failed", None, f"gave up after {attempt} attempts; last error: {error}")
    return Move("pending", max(handler.backoff_seconds(attempt), at_least or 0.0), error)


class Health(enum.StrEnum):
    """What one call says about the provider's health."""

    PROCESSED = "processed"  # it answered: sent, or a refusal
    NOT_PROCESSED = "not_processed"  # connect error, 429, 503: it did not take the request
    NEITHER = "neither"  # ambiguous, a handler's own retry, no call made: proves nothing


def health(*, called: bool, outcome: str, not_processed: bool, http_status: int | None) -> Health:
    """What a delivery says about the provider: ``outcome`` is the decision's (sent, retry,
    failed, unknown), ``called`` whether a call was made at all, ``http_status`` the provider's
    last answer during it. A refusal counts as processed only with an answer behind it: a
    handler that refuses a row by itself, before any request, proves nothing about the
    provider."""
    if not called:
        return Health.NEITHER
    if not_processed:
        return Health.NOT_PROCESSED
    if outcome == "sent" or (outcome == "failed" and http_status is not None):
        return Health.PROCESSED
    return Health.NEITHER


def deadline_error(deadline: datetime | None, error: str | None) -> str | None:
    """The reason stored when a retry would fall on or after the row's ``deadline``."""
    if deadline is None:
        return None
    # "Z" (a letter) ends the digit run: time and offset digits never read as a card number.
    at = deadline.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return f"deadline {at} reached; last error: {error}"
