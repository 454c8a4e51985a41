"""Log lines as ``time level logger message key=value…``, with the ``extra=`` fields appended.

Values that look like secrets are redacted: payloads and idempotency keys never reach a log, and
the whole line (message, exception text, every field) goes through the rules of
:mod:`outbox.sanitize` that also guard what is stored: a card number is masked to its last four
digits, a field named like a credential is ``***``. Business keys are logged by design.
"""

from __future__ import annotations

import functools
import logging
import re

from .sanitize import is_secret_name, redact_text

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_SECRET = re.compile(r"(authorization|idempotency[-_]key|password|secret|token|payload)", re.I)


@functools.lru_cache(maxsize=1024)
def _is_secret(name: str) -> bool:
    # Cached: field names repeat on every line, and the search was a fifth of a delivery's log line.
    return _SECRET.search(name) is not None or is_secret_name(name)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (a driver's own error for a wrapped one), for a
    one-line report; the exception's type name when the message is empty."""
    message = str(getattr(exc, "orig", None) or exc).strip()
    return redact_text(message.splitlines()[0]) if message else type(exc).__name__


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("***" if _is_secret(k) else v) for k, v in headers.items()}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = []
        for name, value in record.__dict__.items():
            if name in _STANDARD or name.startswith("_"):
                continue
            extras.append(f"{name}=***" if _is_secret(name) else f"{name}={value}")
        # A driver's error can echo a statement's parameters, a handler's exception the
        # provider's answer: the same masking as at rest, on the finished line.
        return redact_text(f"{base} {' '.join(extras)}" if extras else base)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Dramatiq logs every consumer restart at INFO; ours are the lines that matter.
    logging.getLogger("dramatiq").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))
