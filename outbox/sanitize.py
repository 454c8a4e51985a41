"""What the outbox stores from outside — a provider's reference, its response, a lookup's answer,
error text — made storable and free of card data, by one set of rules.

A provider's answer is evidence that a charge happened: it must always reach the database, so a
value PostgreSQL refuses (``\\u0000`` in ``text`` or ``jsonb``, NaN in ``jsonb``) or Python's
``json`` cannot encode (``Decimal``, ``datetime``, non-string keys) is converted, never allowed to
fail the statement that records ``sent``. The rules (docs/handlers.md, "What is stored"):

- text: NUL becomes U+FFFD, lone surrogates become U+FFFD; 13-19 digits, contiguous or in groups
  joined by up to 3 non-letter characters (spaces of any kind, dashes, dots, slashes…), that
  start with 2-6 and pass the Luhn check are masked to their last four digits
  (``[card ****4242]``); error text is cut to 500 characters;
- JSON: ``Decimal`` → int when integral, else float when that round-trips, else its string;
  ``datetime``/``date``/``time`` → ISO 8601; ``UUID`` → str; NaN/±Infinity → ``"NaN"``,
  ``"Infinity"``, ``"-Infinity"``; tuples, sets → lists; bytes → ``"<N bytes>"``; a non-string
  key → its ``str()``, and every key is masked as text is; any other object → ``"<TypeName>"``;
  an integer, or an integral float, that looks like a card number is masked as text is; a value
  under a secret-like field name (password, secret, token, authorization, api key, cvv/cvc, card
  number, pan, …) → ``"***"``; nesting beyond 32 levels →
  ``"<nested too deep>"``; a whole response over 64 KiB encoded is replaced by
  ``{"truncated": true, "bytes": N, "head": first 1000 characters}``;
- the provider reference: NUL/surrogates replaced and cut to 1000 characters, never masked
  (operators match it with the provider; it is an identifier, not card data).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import re
import uuid
from decimal import Decimal
from typing import Any

MAX_ERROR_CHARS = 500
MAX_REF_CHARS = 1000
MAX_RESPONSE_BYTES = 64 * 1024
MAX_DEPTH = 32
_TRUNCATED_HEAD_CHARS = 1000

REPLACEMENT = "\ufffd"

# Digits joined by short separator runs (spaces of any kind, dashes, dots, slashes…; never
# letters, so an ISO timestamp's "T" or an identifier's prefix ends a run). Within a run, card
# numbers are looked for along the groups' edges (see ``_mask_run``).
_DIGIT_RUN = re.compile(r"[0-9]+(?:[^0-9A-Za-z]{1,3}[0-9]+)*")
_DIGIT_GROUP = re.compile(r"[0-9]+")
#: Card networks' first digits (2-6), which also keeps epoch milliseconds (1…) from being masked.
_PAN_FIRST = frozenset("23456")
_SURROGATES = re.compile(r"[\ud800-\udfff]")

# Names whose value is a credential or card data wherever it appears: a response field, a log
# line's extra field, a payload shown on the dashboard. Short words (pan, cvv, pin, pass, auth)
# only as whole words, or "company" would match; camelCase is split first (cardCvc: card_Cvc).
_SECRET_NAME = re.compile(
    r"(authorization|password|passwd|passphrase|secret|token|credential|bearer|cookie|api[-_ ]?key"
    r"|private[-_ ]?key|card[-_ ]?number|security[-_ ]?code"
    r"|(?:^|[^a-z])(?:pan|cvv2?|cvc2?|pin|pwd|pass|auth|jwt)(?:$|[^a-z]))",
    re.I,
)
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_ACRONYM = re.compile(r"([A-Z]+)([A-Z][a-z])")  # PINCode: PIN_Code
# Values that are credentials whatever their field is called: providers' secret keys, and HTTP
# credentials pasted whole.
_SECRET_VALUE = re.compile(
    r"\s*(?:(?:sk|rk)_(?:live|test)_|whsec_|(?:Bearer|Basic|bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}\s*$)"
)
# Credentials inside a longer text: an HTTP header line or a URL query (name: value, name=value)
# with a secret-looking name, a bearer/basic credential, a provider's secret key. The name and
# the separator stay, the value is masked.
_SECRET_IN_TEXT = re.compile(
    r"(?i)(?P<named>\b(?:authorization|proxy-authorization|cookie|set-cookie|x-api-key|api[-_]?key"
    r"|access[-_]?token|refresh[-_]?token|id[-_]?token|token|password|passwd|pwd|secret|client[-_]?secret"
    r"|jwt|session(?:id)?)\s*[:=]\s*)(?:(?:bearer|basic|token)\s+)?(?:\"[^\"]*\"|'[^']*'|[^\s&;,]+)"
    r"|(?P<scheme>\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]+|\bwhsec_[A-Za-z0-9]+"
)
_SECRET_HINT = re.compile(r"(?i)bearer|basic|sk_|rk_|whsec_|[:=]")


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _mask_run(match: re.Match[str]) -> str:
    """Mask every card number in one run of digit groups: a span of whole groups holding 13-19
    digits that starts with 2-6 and passes the Luhn check, the longest first from the left. A
    number next to other digits ("order 42 4111 1111 1111 1111 12/25") is still found."""
    run = match.group(0)
    if len(run) < 13:
        return run
    groups = [(g.start(), g.end()) for g in _DIGIT_GROUP.finditer(run)]
    out: list[str] = []
    done = 0
    i = 0
    while i < len(groups):
        found = None
        if run[groups[i][0]] in _PAN_FIRST:
            digits = ""
            for j in range(i, len(groups)):
                digits += run[groups[j][0] : groups[j][1]]
                if len(digits) > 19:
                    break
                if len(digits) >= 13 and _luhn_ok(digits):
                    found = (j, digits)
        if found is None:
            i += 1
            continue
        j, digits = found
        out.append(run[done : groups[i][0]])
        out.append(f"[card ****{digits[-4:]}]")
        done = groups[j][1]
        i = j + 1
    if not out:
        return run
    out.append(run[done:])
    return "".join(out)


def redact_text(text: str) -> str:
    """Card numbers masked; everything else unchanged. Cheap when ``text`` has no long digit run."""
    return _DIGIT_RUN.sub(_mask_run, text)


@functools.lru_cache(maxsize=1024)
def is_secret_name(name: str) -> bool:
    """True for a field name whose value must be neither logged nor stored."""
    return _SECRET_NAME.search(_CAMEL.sub(r"\1_\2", _ACRONYM.sub(r"\1_\2", name))) is not None


def _mask_secret(match: re.Match[str]) -> str:
    kept = match.group("named") or match.group("scheme") or ""
    return f"{kept}***"


def redact_credentials(text: str) -> str:
    """Credentials inside a text masked (``Authorization: Bearer …``, ``?access_token=…``,
    ``sk_live_…``); everything else unchanged. Cheap when nothing hints at one."""
    if _SECRET_HINT.search(text) is None:
        return text
    return _SECRET_IN_TEXT.sub(_mask_secret, text)


def is_secret_value(text: str) -> bool:
    """True for a string that is a credential by its form (``sk_live_…``, ``Bearer …``)."""
    return _SECRET_VALUE.match(text) is not None


def _storable_text(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT)
    if not text.isascii():
        text = _SURROGATES.sub(REPLACEMENT, text)
    return text


def clean_text(text: object, *, max_chars: int = MAX_ERROR_CHARS) -> str:
    """Error text as stored (``last_error``, attempt ``error``) and logged: storable, card numbers
    masked, at most ``max_chars`` characters."""
    out = redact_text(redact_credentials(_storable_text(text if isinstance(text, str) else str(text))))
    return out if len(out) <= max_chars else out[: max_chars - 1] + "…"


def clean_optional_text(text: object | None, *, max_chars: int = MAX_ERROR_CHARS) -> str | None:
    return None if text is None else clean_text(text, max_chars=max_chars)


def clean_ref(ref: object) -> str:
    """A provider reference as stored: storable and bounded, never masked. Bounded in UTF-8
    bytes as well as characters: the provider_ref index takes at most 2704 bytes an entry, and
    a record that fails on it would leave a confirmed call unrecorded."""
    out = _storable_text(ref if isinstance(ref, str) else str(ref))[:MAX_REF_CHARS]
    encoded = out.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_REF_CHARS:
        out = encoded[:MAX_REF_CHARS].decode("utf-8", "ignore")
    return out


def _clean_number(value: int | float) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        if value.is_integer() and 1e12 <= abs(value) < 1e19:
            # 4111111111111111.0 in a JSON answer is a card number all the same.
            masked = _clean_number(int(value))
            if isinstance(masked, str):
                return masked
        # As jsonb gives it back (its numbers are decimals): a float written with an exponent
        # (1e+20) reads back as the integer of its digits, and -0.0 as 0.0. What a @then function
        # is given (outbox.chains.as_stored) must equal what a later read of the row gives.
        if value.is_integer() and abs(value) >= 1e16:
            return int(Decimal(repr(value)))
        return value + 0.0 if value == 0 else value
    if value.bit_length() > 4000:
        # Python refuses to print integers past ~4300 digits; no provider means such a number.
        return f"<integer of {value.bit_length()} bits>"
    if 13 <= len(str(abs(value))) <= 19:
        masked = redact_text(str(value))
        if masked != str(value):
            return masked
    return value


def _clean_decimal(value: Decimal) -> Any:
    if not value.is_finite():
        return "NaN" if value.is_nan() else ("Infinity" if value > 0 else "-Infinity")
    if value == value.to_integral_value():
        return _clean_number(int(value))
    as_float = float(value)
    # A number only when the float is worth the same; otherwise the exact digits, as text.
    return as_float if math.isfinite(as_float) and Decimal(repr(as_float)) == value else str(value)


def _clean_value(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if is_secret_value(value):
            return "***"
        stripped = value.lstrip()
        if stripped[:1] in ("{", "[") and len(value) <= MAX_RESPONSE_BYTES and depth < MAX_DEPTH:
            # A JSON document kept as a string (a request body, a webhook): cleaned like one.
            try:
                inner = json.loads(value)
            except (ValueError, RecursionError):
                inner = None
            if isinstance(inner, dict | list):
                return json.dumps(_clean_value(inner, depth + 1), ensure_ascii=False)
        return redact_text(redact_credentials(_storable_text(value)))
    if isinstance(value, int | float):
        return _clean_number(value)
    if depth >= MAX_DEPTH:
        return "<nested too deep>"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            name = _storable_text(k if isinstance(k, str) else str(k))
            secret = is_secret_name(name)
            # A key can be a card number too ({"4111111111111111": {...}}).
            out[redact_text(name)] = "***" if secret else _clean_value(v, depth + 1)
        return out
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [_clean_value(v, depth + 1) for v in items]
    if isinstance(value, Decimal):
        return _clean_decimal(value)
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(bytes(value))} bytes>"
    return f"<{type(value).__name__}>"


def clean_json(value: Any) -> Any:
    """Any Python value → a JSON value PostgreSQL's jsonb accepts, by the module's rules."""
    return _clean_value(value, 0)


def encode_response(response: Any) -> str | None:
    """A provider's response summary as the jsonb text to store; None stays None.

    Never raises for any input: the response rides on the statement that records a confirmed
    charge, and that statement must not fail because of what the provider answered.
    """
    if response is None:
        return None
    try:
        cleaned = clean_json(response)
        encoded = json.dumps(cleaned, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except Exception as exc:  # a summary is not worth losing the record
        return json.dumps({"unstorable_response": type(exc).__name__})
    if len(encoded.encode("utf-8")) > MAX_RESPONSE_BYTES:
        return json.dumps(
            {
                "truncated": True,
                "bytes": len(encoded.encode("utf-8")),
                "head": encoded[:_TRUNCATED_HEAD_CHARS],
            },
            ensure_ascii=False,
        )
    return encoded
