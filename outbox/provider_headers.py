"""What the outbox reads from a provider's answer headers, read so that nothing a provider sends
can raise.

These parsers run inside ``Delivery.http``'s response hook and in the classification of what a
handler raised: an exception out of them would turn a certain "not processed" (a 503) into
``unknown``. A value that cannot be read is treated as absent, and a warning says so once per
process, destination and header (a provider sending it on every answer must not flood the log).
"""

from __future__ import annotations

import email.utils
import logging
import re
import threading
from datetime import UTC, datetime

import httpx

from .sanitize import clean_text

logger = logging.getLogger(__name__)

#: Answers where the provider says it did not process the request.
NOT_PROCESSED = frozenset({429, 503})

#: The longest ``Retry-After`` honoured: a provider's "come back in a year" (or a typo in its
#: date) must not park a row for good. A retry later than this waits this long.
MAX_RETRY_AFTER_SECONDS = 86400.0

#: RFC 9110 delay-seconds: ASCII digits only. ``str.isdigit()`` is no test: it accepts ``١٢``
#: (which ``float()`` reads) and ``²`` (which ``float()`` refuses).
_DELAY_SECONDS = re.compile(r"[0-9]+")
#: Past this many digits the delay is over the cap whatever they say (and int() of a huge string
#: is refused by Python's integer string limit).
_MAX_DELAY_DIGITS = 12
#: How much of a malformed value the warning shows.
_SHOWN_CHARS = 60

_warned: set[tuple[str | None, str]] = set()
_warned_lock = threading.Lock()


def delay_seconds(raw: str) -> float | None:
    """``raw`` as RFC 9110 delay-seconds (surrounding whitespace ignored), at most
    :data:`MAX_RETRY_AFTER_SECONDS`, or None."""
    text = raw.strip()
    if _DELAY_SECONDS.fullmatch(text) is None:
        return None
    if len(text.lstrip("0")) > _MAX_DELAY_DIGITS:
        return MAX_RETRY_AFTER_SECONDS
    return min(float(int(text)), MAX_RETRY_AFTER_SECONDS)


def http_date(raw: str) -> datetime | None:
    """``raw`` as an HTTP date with a known offset (RFC 9110 IMF-fixdate, and the obsolete forms
    ``email.utils`` reads), or None: a date without a zone (``-0000``) says no instant."""
    try:
        at = email.utils.parsedate_to_datetime(raw)
    except Exception:
        # Arbitrary text reaches a stdlib parser that raises ValueError, TypeError, IndexError and
        # OverflowError (a year past the C int) depending on the shape: all mean "not a date".
        return None
    if at is None or at.tzinfo is None:
        return None
    return at


def retry_after_seconds(response: httpx.Response, *, destination: str | None = None) -> float | None:
    """The wait a 429 or 503 answer asks for in its ``Retry-After`` header (RFC 9110: seconds, or
    an HTTP date), at most :data:`MAX_RETRY_AFTER_SECONDS`; None when there is none, it cannot
    be read (warned about once per ``destination``), or the status is another. A date is
    measured against the answer's own ``Date`` header (the provider's clock; ours may be
    skewed), else against this machine's clock; the wait is then applied on the database's
    clock, like every delay. Never raises."""
    try:
        if response.status_code not in NOT_PROCESSED:
            return None
        raw = response.headers.get("Retry-After", "")
        if not raw.strip():
            return None
        seconds = delay_seconds(raw)
        if seconds is None:
            at = http_date(raw)
            if at is None:
                _malformed(destination, "Retry-After", raw)
                return None
            base = datetime.now(UTC)
            said_raw = response.headers.get("Date", "")
            if said_raw.strip():
                said = http_date(said_raw)
                if said is None:
                    _malformed(destination, "Date", said_raw)
                else:
                    base = said
            seconds = (at - base).total_seconds()
        return min(max(0.0, seconds), MAX_RETRY_AFTER_SECONDS)
    except Exception:
        # Each step above is total; this is the promise kept should one of them not be.
        logger.exception(
            "Retry-After of %s could not be read; treated as absent", destination or "a provider"
        )
        return None


def _malformed(destination: str | None, header: str, raw: str) -> None:
    with _warned_lock:
        if (destination, header) in _warned:
            return
        _warned.add((destination, header))
    shown = clean_text(ascii(raw[:_SHOWN_CHARS]) + ("…" if len(raw) > _SHOWN_CHARS else ""))
    logger.warning(
        "%s answered a %s header that cannot be read, %s; treated as absent (said once per process)",
        destination or "a provider",
        header,
        shown,
        extra={"destination": destination, "header": header},
    )
