"""Log lines as ``time level logger message key=value…``, with the ``extra=`` fields appended
in logfmt: a value with a space, a quote, an ``=`` or a control character is double-quoted, with
``\\``, ``\"`` and newlines escaped, so that every line splits back into its fields. A field the
message already shows (``name=`` in its text, or named in the record's ``_shown``) is not
appended a second time. With ``OUTBOX_LOG_FORMAT=json`` each line is one JSON object instead:
``time``, ``level``, ``logger``, ``message``, every ``extra=`` field (those the message shows
included), and ``exception`` when there is one.

What is logged: business keys and steps, by design (operators search by them; a key carries no
secret, docs/handlers.md). Never a payload; a field named like a payload, a credential or an
idempotency key is ``***`` (headers: :func:`redact_headers`); a provider's text at most
:data:`MAX_PROVIDER_TEXT_CHARS` characters. The whole line (message, exception text, every
field) goes through the rules of :mod:`outbox.sanitize` that also guard what is stored: a card
number is masked to its last four digits, a field named like a credential or a payload is ``***``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from datetime import UTC, datetime
from typing import Any

from .sanitize import clean_text, is_secret_name, redact_text

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
LOG_FORMAT_ENV = "OUTBOX_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
_NEEDS_QUOTES = re.compile(r'[\s"=\\]|[\x00-\x1f\x7f]')
_SECRET = re.compile(r"(authorization|idempotency[-_]key|password|secret|token|payload)", re.I)


@functools.lru_cache(maxsize=1024)
def _is_secret(name: str) -> bool:
    # Cached: field names repeat on every line, and the search was a fifth of a delivery's log line.
    return _SECRET.search(name) is not None or is_secret_name(name)


#: The most of a provider's or a handler's text (an error, a lookup's failure) a log line of the
#: worker or the reconciler carries, in characters: such a text often echoes the request, and
#: the row keeps a longer copy (sanitize.MAX_ERROR_CHARS) for ``outbox show``.
MAX_PROVIDER_TEXT_CHARS = 200


def provider_text(text: object) -> str:
    """A provider's or a handler's text as a log line carries it: storable, card numbers and
    credentials masked, at most :data:`MAX_PROVIDER_TEXT_CHARS` characters."""
    return clean_text(text, max_chars=MAX_PROVIDER_TEXT_CHARS)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (a driver's own error for a wrapped one), for a
    one-line report; the exception's type name when the message is empty."""
    message = str(getattr(exc, "orig", None) or exc).strip()
    return redact_text(message.splitlines()[0]) if message else type(exc).__name__


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("***" if _is_secret(k) else v) for k, v in headers.items()}


def logfmt_value(value: Any) -> str:
    """A value as logfmt writes it: bare when it is one plain token, else quoted and escaped."""
    text = str(value)
    if text and not _NEEDS_QUOTES.search(text):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        name: ("***" if _is_secret(name) else value)
        for name, value in record.__dict__.items()
        if name not in _STANDARD and not name.startswith("_")
    }


#: How a message names a field in words ("outbox row 42", "destination mail.send", "breaker of
#: mail.send"): such a field is not repeated on a text line. A row's key and step together
#: ("outbox order:42:charge") are the other such words (see KeyValueFormatter).
_IN_WORDS = {
    "outbox_id": ("row ",),
    "destination": ("destination ", "of ", "on "),
    "queue": ("queue ",),
    "message_id": ("message ",),
    "pid": ("process ",),
    "attempt": ("attempt ",),
    "outbox_run": ("-> ",),
    "job": ("job ",),
    "outbox_batch": ("batch ",),
    "exit_code": ("with ",),
    # An exception's type name, wherever the message names it ("failed (OperationalError)").
    "error": ("",),
}


def _has_word(message: str, word: str) -> bool:
    """Whether ``word`` is in ``message`` as a whole (not inside a longer name, number or key:
    "row 4" is not in "row 42", "order:4" not in "order:4:charge")."""
    at = message.find(word)
    end = len(word)
    while at != -1:
        before = message[at - 1] if at else " "
        after = message[at + end : at + end + 2]
        joined_before = before.isalnum() or before in "_.:-/="
        joined_after = bool(after) and (
            after[0].isalnum() or after[0] == "_" or (after[0] in ".:-/" and after[1:2].isalnum())
        )
        if not joined_before and not joined_after:
            return True
        at = message.find(word, at + 1)
    return False


def _shows(message: str, name: str, value: Any) -> bool:
    """Whether ``message`` carries the field already: ``name=…``, or in words (:data:`_IN_WORDS`)."""
    if _has_word_start(message, name + "="):
        return True
    return any(_has_word(message, words + str(value)) for words in _IN_WORDS.get(name, ()))


def _has_word_start(message: str, start: str) -> bool:
    at = message.find(start)
    while at != -1:
        if at == 0 or not (message[at - 1].isalnum() or message[at - 1] == "_"):
            return True
        at = message.find(start, at + 1)
    return False


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        # A field the message shows already ("queues=a,b", or "order:42:charge" for key and
        # step, named in ``_shown``) is not repeated: one value a field on a text line. JSON
        # keeps every field as a field.
        message = record.message
        shown = getattr(record, "_shown", ())
        fields = _extras(record)
        key, step = fields.get("key"), fields.get("step")
        if key is not None and step is not None and _has_word(message, f"{key}:{step}"):
            shown = {*shown, "key", "step"}
        extras = " ".join(
            f"{name}={logfmt_value(value)}"
            for name, value in fields.items()
            if name not in shown and not _shows(message, name, value)
        )
        line = f"{base} {extras}" if extras else base
        # A driver's error can echo a statement's parameters, a handler's exception the
        # provider's answer: the same masking as at rest, on the finished line, except our own
        # timestamp ("2026-11-30 21:00:31,123" is a digit run a card check may accept).
        stamp = getattr(record, "asctime", "")
        if stamp and line.startswith(stamp):
            return stamp + redact_text(line[len(stamp) :])
        return redact_text(line)


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log pipelines that parse JSON."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in _extras(record).items():
            entry.setdefault(name, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        # Masked on the finished line, as for text: a value's repr may carry what a field hid.
        # The time is ours and stays as it is ("21:00:31.123+00:00" is a digit run).
        stamp = entry.pop("time")
        rest = redact_text(json.dumps(entry, ensure_ascii=False, default=str))
        return '{"time": ' + json.dumps(stamp) + ", " + rest[1:]


def _formatter(environ: Mapping[str, str] | None = None) -> logging.Formatter:
    chosen = ((os.environ if environ is None else environ).get(LOG_FORMAT_ENV) or "text").strip().lower()
    if chosen not in LOG_FORMATS:
        from .exceptions import ConfigError

        raise ConfigError(f"{LOG_FORMAT_ENV}={chosen!r}: expected one of {', '.join(LOG_FORMATS)}")
    if chosen == "json":
        return JsonFormatter()
    return KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")


def configure(level: str = "INFO", environ: Mapping[str, str] | None = None) -> None:
    """Log to stderr at ``level`` (any case), as text or, with OUTBOX_LOG_FORMAT=json in
    ``environ`` (default: the process's environment), JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(_formatter(environ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Dramatiq logs every consumer restart at INFO; ours are the lines that matter.
    logging.getLogger("dramatiq").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))


class Tally:
    """The INFO lines of a stream of like events (a relay's batches): the first event
    after a quiet spell (none for ``every_seconds``) is for the caller to log at once, at INFO;
    those that follow within the window are counted, and ``summarize(counts, seconds)`` logs
    them as one line when the window ends (at the next event, at a ``tick``) or on ``flush``.
    Shared by threads: ``count`` takes a lock, and ``summarize`` runs outside it."""

    def __init__(
        self,
        summarize: Callable[[Counter[Hashable], float], None],
        every_seconds: float,
    ) -> None:
        self.every_seconds = every_seconds
        self._summarize = summarize
        self._lock = threading.Lock()
        self._since = float("-inf")  # when the current window began
        self._counts: Counter[Hashable] = Counter()

    def count(self, what: Hashable) -> bool:
        """Count one event; True when it is the first after a quiet spell: log it at INFO."""
        return self.add({what: 1})

    def add(self, counts: Mapping[Hashable, int]) -> bool:
        """Count one event made of several counts (a relay's batch: its rows by destination);
        True when it is the first after a quiet spell: log it at INFO, it is not counted."""
        now = time.monotonic()
        with self._lock:
            if now - self._since < self.every_seconds:
                mine = self._counts
                for what, n in counts.items():
                    mine[what] += n
                return False
            ended = self._take(now)
        if ended is not None:
            self._summarize(*ended)
        return True

    def tick(self) -> None:
        """Sum up a window that has ended (called while idle)."""
        now = time.monotonic()
        with self._lock:
            if not self._counts or now - self._since < self.every_seconds:
                return
            ended = self._take(now)
        if ended is not None:
            self._summarize(*ended)

    def flush(self) -> None:
        """Sum up the current window now (the process stops)."""
        with self._lock:
            ended = self._take(time.monotonic())
        if ended is not None:
            self._summarize(*ended)

    def _take(self, now: float) -> tuple[Counter[Hashable], float] | None:
        counts, since = self._counts, self._since
        self._counts, self._since = Counter(), now
        return (counts, now - since) if counts else None


class Window:
    """Counts of a stream of events (a worker's runs, by result and destination), summed up by
    ``summarize(counts, seconds)`` as one line every ``every_seconds``: when a ``tick`` (called
    often, off the events' path) finds the window ended, and on ``flush``. Counting is the whole
    cost of an event: one increment under a lock, shared by threads."""

    def __init__(
        self,
        summarize: Callable[[Counter[Hashable], float], None],
        every_seconds: float,
    ) -> None:
        self.every_seconds = every_seconds
        self._summarize = summarize
        self._lock = threading.Lock()
        self._since = time.monotonic()
        self._counts: Counter[Hashable] = Counter()

    def count(self, what: Hashable) -> None:
        with self._lock:
            self._counts[what] += 1

    def tick(self) -> None:
        """Sum up the window if it has ended; a window with no event is not logged."""
        now = time.monotonic()
        if now - self._since < self.every_seconds:
            return
        with self._lock:
            counts, since = self._counts, self._since
            self._counts, self._since = Counter(), now
        if counts:
            self._summarize(counts, now - since)

    def flush(self) -> None:
        """Sum up the current window now (the process stops)."""
        now = time.monotonic()
        with self._lock:
            counts, since = self._counts, self._since
            self._counts, self._since = Counter(), now
        if counts:
            self._summarize(counts, now - since)
