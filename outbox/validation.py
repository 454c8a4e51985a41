"""Input rules of ``outbox.write``, checked before anything reaches the database.

Raising here keeps the caller's transaction usable: no statement was sent.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Any

from .exceptions import InvalidMessage

# \Z, not $: "$" also matches before a trailing newline.
DESTINATION_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*\Z")
MAX_KEY_STEP_CHARS = 255
# What an HTTP header value carries byte for byte: visible ASCII, with inner spaces. Leading or
# trailing spaces would be stripped on the wire, so two keys would name one operation.
_HEADER_SAFE_RE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?\Z")


def header_safe(value: str) -> bool:
    """True when ``value`` travels unchanged as an HTTP header value (the Idempotency-Key)."""
    return _HEADER_SAFE_RE.match(value) is not None


def _reject_non_finite(token: str) -> float:
    raise InvalidMessage(f"payload contains {token}, which is not a JSON value")


def _check_text(value: str, where: str) -> None:
    if "\x00" in value:
        raise InvalidMessage(f"{where} contains a NUL character, which PostgreSQL jsonb rejects")


def _check_strict_json(value: Any, path: str) -> None:
    """Only what JSON can carry: dict with str keys, list, str, int, finite float, bool, None.

    ``json.dumps`` alone would accept tuples, NaN and int-like keys, and turn them into something
    else than the caller wrote.
    """
    if isinstance(value, str):
        _check_text(value, f"payload{path}")
        return
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage(f"payload{path} is {value!r}; JSON has no NaN or Infinity")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidMessage(f"payload{path} has a non-string key {k!r}")
            _check_text(k, f"payload{path} key {k!r}")
            _check_strict_json(v, f"{path}[{k!r}]")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_strict_json(v, f"{path}[{i}]")
        return
    raise InvalidMessage(
        f"payload{path} is a {type(value).__name__}, which is not a JSON value "
        "(convert datetimes, decimals, sets and UUIDs to strings or numbers first)"
    )


def encode_payload(payload: Any, max_payload_bytes: int) -> str:
    if not isinstance(payload, dict):
        raise InvalidMessage(f"payload must be a JSON object (a dict), not {type(payload).__name__}")
    try:
        _check_strict_json(payload, "")
    except RecursionError:
        raise InvalidMessage("payload is nested too deeply (or contains itself)") from None
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            f"payload contains {exc.object[exc.start : exc.end]!r}, a lone surrogate, which is not "
            "valid Unicode"
        ) from None
    if size > max_payload_bytes:
        raise InvalidMessage(
            f"payload is {size} bytes encoded, over the limit of {max_payload_bytes} bytes; "
            "store large documents elsewhere and put a reference in the payload"
        )
    return encoded


def check_key_step(key: Any, step: Any, *, new_row: bool = True) -> None:
    """``new_row=False`` (looking a row up, e.g. to cancel it) skips the rules only new rows
    follow, so that a row stored before them can still be named."""
    for name, value in (("key", key), ("step", step)):
        if not isinstance(value, str) or not value.strip():
            raise InvalidMessage(f"{name} must be a non-empty string, got {value!r}")
        if "\x00" in value:
            raise InvalidMessage(f"{name} contains a NUL character")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidMessage(
                    f"{name} contains a lone surrogate, which is not valid Unicode"
                ) from None
    # The Idempotency-Key is f"{key}:{step}": with a ':' allowed in both, ("order:1", "refund:2")
    # and ("order:1:refund", "2") would send one key for two rows, and a deduplicating provider
    # would answer the second with the first's charge (a message silently lost). Keys keep their
    # ':' (order:42); a step without one makes the split unambiguous and leaves every key as it
    # was. The database refuses it too (outbox_message_step_colon_check, migration 0007).
    if new_row and ":" in step:
        raise InvalidMessage(
            f"step {step!r} contains ':': the Idempotency-Key is 'key:step', and a ':' in the step "
            "lets two different rows send the same key; use another separator, e.g. refund-2"
        )
    if not header_safe(f"{key}:{step}"):
        raise InvalidMessage(
            f"'key:step' {key + ':' + step!r} must be printable ASCII (no accents, no control "
            "characters, no leading or trailing space): it is sent as the provider's "
            "Idempotency-Key header, which carries nothing else unchanged; use an ASCII business "
            "key such as order:42"
        )
    if len(key) + 1 + len(step) > MAX_KEY_STEP_CHARS:
        raise InvalidMessage(
            f"'key:step' is {len(key) + 1 + len(step)} characters, over {MAX_KEY_STEP_CHARS} "
            "(it becomes the provider's Idempotency-Key)"
        )


# Dramatiq's Redis broker derives every key of a queue Q from "<namespace>:Q" (see
# dramatiq/brokers/redis/dispatch.lua and dramatiq/common.py): the list "Q", the message hash
# "Q.msgs", the delay queue "Q.DQ" (+ ".msgs"), the dead-letter zset "Q.XQ" (+ ".msgs"), the
# fetched-message sets "__acks__.<worker>.Q" and the zset "__heartbeats__". A destination whose
# own keys are one of those of another destination, or that Dramatiq reads as a derived name,
# is refused. Matching is exact, as Dramatiq's (case-sensitive suffixes).
_BROKER_SUFFIXES: tuple[tuple[str, str], ...] = (
    (
        ".DQ",
        "Dramatiq reads a queue name ending in .DQ as the delay queue of the name before it: a "
        "worker never consumes it as a queue of its own",
    ),
    (
        ".XQ",
        "Dramatiq reads a queue name ending in .XQ as the dead-letter queue of the name before it: "
        "a worker never consumes it, and its list collides with that queue's dead-letter set "
        "(WRONGTYPE)",
    ),
    (
        ".msgs",
        "Dramatiq keeps the messages of queue Q in the Redis hash Q.msgs: this queue's list would "
        "be the message hash of the destination named without .msgs (WRONGTYPE for both)",
    ),
)
_BROKER_PREFIXES: tuple[tuple[str, str], ...] = (
    (
        "__acks__",
        "Dramatiq keeps each worker's fetched messages in the Redis sets __acks__.<worker>.<queue>",
    ),
    ("__heartbeats__", "Dramatiq keeps its workers' heartbeats in the Redis sorted set __heartbeats__"),
)


def destination_problem(destination: Any) -> str | None:
    """Why ``destination`` cannot name a broker queue, or None when it can.

    The one rule behind ``outbox.write`` (InvalidMessage) and ``@outbox.handler`` (ConfigError).
    """
    if not isinstance(destination, str) or not DESTINATION_RE.match(destination):
        return f"destination {destination!r} must match [A-Za-z_][A-Za-z0-9._-]* (it names a broker queue)"
    for suffix, why in _BROKER_SUFFIXES:
        if destination.endswith(suffix):
            return f"destination {destination!r} must not end in {suffix!r}: {why}"
    for prefix, why in _BROKER_PREFIXES:
        if destination.startswith(prefix):
            return f"destination {destination!r} must not start with {prefix!r}: {why}"
    return None


def check_destination(destination: Any) -> None:
    problem = destination_problem(destination)
    if problem is not None:
        raise InvalidMessage(problem)


def check_label(name: str, value: Any, max_length: int) -> None:
    """An optional short text a row is grouped by (``ordering_key``, ``fairness_key``): None, or
    a str of 1 to ``max_length`` printable characters (the schema's CHECK says the same)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidMessage(f"{name} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= max_length:
        raise InvalidMessage(f"{name} must be 1 to {max_length} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidMessage(f"{name} {value!r} holds a control character")


def check_aware(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, datetime):
        raise InvalidMessage(f"{name} must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidMessage(
            f"{name} must be timezone-aware (e.g. datetime.now(timezone.utc)); a naive datetime "
            "would be read in the database server's time zone"
        )
