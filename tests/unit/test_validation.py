"""Input rules of ``outbox.write`` / ``outbox.cancel``, checked before anything reaches the database.

The target passed to ``write`` here is an object that fails the test if it is touched at all: a
rejected call must raise ``InvalidMessage`` without using it, and an accepted call gets past
validation and touches it (``Touched``).
"""

from __future__ import annotations

import importlib
import json
import math
import re
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

import outbox
from outbox.settings import DEFAULT_MAX_PAYLOAD_BYTES
from outbox.validation import MAX_KEY_STEP_CHARS, encode_payload

write_module = importlib.import_module("outbox.writing")

KIB_256 = 256 * 1024


class Touched(Exception):
    """The write got past validation and tried to use its Session/Connection."""


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise Touched(name)


GOOD: dict[str, Any] = {
    "key": "order:42",
    "step": "charge",
    "destination": "payments.charge",
    "payload": {"amount_cents": 1000, "currency": "EUR"},
}


def call_write(**changes: Any) -> None:
    outbox.write(Untouchable(), **{**GOOD, **changes})  # type: ignore[arg-type]


def rejected(match: str, **changes: Any) -> outbox.InvalidMessage:
    with pytest.raises(outbox.InvalidMessage, match=match) as info:
        call_write(**changes)
    assert isinstance(info.value, outbox.OutboxError)
    return info.value


def accepted(**changes: Any) -> None:
    with pytest.raises(Touched):
        call_write(**changes)


def sized_payload(size: int, char: str = "x") -> dict[str, str]:
    """A payload whose compact UTF-8 JSON encoding is exactly ``size`` bytes."""
    overhead = len(b'{"d":""}')
    per_char = len(char.encode("utf-8"))
    assert (size - overhead) % per_char == 0
    payload = {"d": char * ((size - overhead) // per_char)}
    assert len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()) == size
    return payload


def test_good_message_passes_validation() -> None:
    accepted()


def test_exceptions_hierarchy() -> None:
    assert issubclass(outbox.InvalidMessage, outbox.OutboxError)
    assert issubclass(outbox.KeyConflict, outbox.OutboxError)
    assert issubclass(outbox.NotMigrated, outbox.OutboxError)


# -- payload -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [[1, 2], "text", None, 42, (("a", 1),), b"{}"],
    ids=["list", "str", "none", "int", "tuple", "bytes"],
)
def test_payload_must_be_a_dict(payload: Any) -> None:
    rejected(r"payload must be a JSON object \(a dict\), not " + type(payload).__name__, payload=payload)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"at": datetime.now(UTC)}, r"payload\['at'\] is a datetime, which is not a JSON value"),
        ({"on": date(2024, 1, 1)}, r"payload\['on'\] is a date"),
        ({"tags": {"a", "b"}}, r"payload\['tags'\] is a set"),
        ({"amount": Decimal("10.00")}, r"payload\['amount'\] is a Decimal"),
        ({"pair": (1, 2)}, r"payload\['pair'\] is a tuple"),
        ({"id": uuid.uuid4()}, r"payload\['id'\] is a UUID"),
        ({"raw": b"abc"}, r"payload\['raw'\] is a bytes"),
        ({"x": math.nan}, r"payload\['x'\] is nan; JSON has no NaN or Infinity"),
        ({"x": math.inf}, r"payload\['x'\] is inf; JSON has no NaN or Infinity"),
        ({"x": -math.inf}, r"payload\['x'\] is -inf; JSON has no NaN or Infinity"),
        ({1: "one"}, r"payload has a non-string key 1"),
        ({None: "none"}, r"payload has a non-string key None"),
        # nested, in dicts and lists: the path names where the problem is
        ({"a": {"b": {"c": datetime.now(UTC)}}}, r"payload\['a'\]\['b'\]\['c'\] is a datetime"),
        ({"items": [1, {"at": {1, 2}}]}, r"payload\['items'\]\[1\]\['at'\] is a set"),
        ({"a": [0.5, float("nan")]}, r"payload\['a'\]\[1\] is nan"),
        ({"a": {"b": [Decimal(1)]}}, r"payload\['a'\]\['b'\]\[0\] is a Decimal"),
        ({"a": {2: "x"}}, r"payload\['a'\] has a non-string key 2"),
        ({"a": [{(1, 2): "x"}]}, r"payload\['a'\]\[0\] has a non-string key \(1, 2\)"),
        ({"a": "nul\x00byte"}, r"payload\['a'\] contains a NUL character"),
        ({"a\x00": 1}, r"key 'a\\x00' contains a NUL character"),
        ({"a": "\ud800"}, r"lone surrogate"),
    ],
)
def test_payload_values_must_be_strict_json(payload: dict[Any, Any], match: str) -> None:
    rejected(match, payload=payload)


def test_self_containing_or_absurdly_deep_payload_is_invalid_not_a_crash() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    rejected("nested too deeply", payload=loop)
    deep: dict[str, Any] = {}
    for _ in range(5000):
        deep = {"a": deep}
    rejected("nested too deeply", payload=deep)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"s": "é€😀", "i": -3, "f": 1.5, "b": True, "n": None, "l": [1, [2, {"x": []}]]},
        {"literal": "\\u0000 is six characters, not a NUL"},
        {"big": 2**70},
    ],
)
def test_strict_json_values_are_accepted(payload: dict[str, Any]) -> None:
    accepted(payload=payload)
    assert json.loads(encode_payload(payload, DEFAULT_MAX_PAYLOAD_BYTES)) == payload


def test_default_limit_is_256_kib_encoded() -> None:
    assert DEFAULT_MAX_PAYLOAD_BYTES == KIB_256
    accepted(payload=sized_payload(KIB_256))
    error = rejected(
        r"payload is 262145 bytes encoded, over the limit of 262144 bytes", payload=sized_payload(KIB_256 + 1)
    )
    assert "store large documents elsewhere" in str(error)


def test_limit_counts_utf8_bytes_not_characters() -> None:
    # 2-byte characters: well under 256 Ki characters, over 256 KiB.
    payload = sized_payload(KIB_256 + 2, char="é")
    assert len(json.dumps(payload, ensure_ascii=False)) < KIB_256
    rejected(r"262146 bytes encoded, over the limit of 262144", payload=payload)


def test_custom_max_payload_bytes() -> None:
    accepted(payload=sized_payload(100), max_payload_bytes=100)
    rejected(
        r"payload is 101 bytes encoded, over the limit of 100 bytes",
        payload=sized_payload(101),
        max_payload_bytes=100,
    )
    # A custom limit may also be above the default.
    accepted(payload=sized_payload(KIB_256 + 10), max_payload_bytes=KIB_256 + 10)


def test_default_limit_comes_from_outbox_max_payload_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_module, "_max_payload_bytes", None)
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_BYTES", "64")
    # Unrelated or unparseable OUTBOX_* settings are not write()'s business.
    monkeypatch.setenv("OUTBOX_POLL_INTERVAL", "abc")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql+asyncpg://app@db/app")
    accepted(payload=sized_payload(64))
    rejected(r"over the limit of 64 bytes", payload=sized_payload(65))


# -- key and step --------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["key", "step"])
@pytest.mark.parametrize("value", ["", " ", "\t\n", None, 42, b"order:1"], ids=repr)
def test_key_and_step_must_be_non_empty_strings(field: str, value: Any) -> None:
    rejected(re.escape(f"{field} must be a non-empty string, got {value!r}"), **{field: value})


@pytest.mark.parametrize("field", ["key", "step"])
def test_key_and_step_refuse_nul_and_surrogates(field: str) -> None:
    rejected(rf"{field} contains a NUL character", **{field: "a\x00b"})
    rejected(rf"{field} contains a lone surrogate", **{field: "a\udc80b"})


def test_key_step_at_most_255_characters() -> None:
    assert MAX_KEY_STEP_CHARS == 255
    step = "charge"
    key_255 = "k" * (255 - 1 - len(step))
    assert len(f"{key_255}:{step}") == 255
    accepted(key=key_255, step=step)
    error = rejected(r"'key:step' is 256 characters, over 255", key=key_255 + "k", step=step)
    assert "Idempotency-Key" in str(error)
    # Multi-byte characters are refused before the length is counted: the Idempotency-Key header
    # carries printable ASCII only (issue 9 class 9).
    rejected("must be printable ASCII", key="é" * 200, step="ü" * 54)


# -- destination ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "destination",
    ["payments.charge", "_private", "A", "mail-v2.send_welcome", "x0.9-_"],
)
def test_good_destinations(destination: str) -> None:
    accepted(destination=destination)


@pytest.mark.parametrize(
    "destination",
    [
        "1payments",
        "payments charge",
        "payments/charge",
        "",
        ".hidden",
        "-dash",
        "pay:ments",
        "café",
        "payments.charge\n",
        "\npayments",
        None,
        42,
    ],
    ids=repr,
)
def test_bad_destinations(destination: Any) -> None:
    error = rejected(r"must match \[A-Za-z_\]\[A-Za-z0-9._-\]\*", destination=destination)
    assert repr(destination) in str(error)
    assert "broker queue" in str(error)


# -- available_at and deadline -------------------------------------------------------------------


@pytest.mark.parametrize("field", ["available_at", "deadline"])
def test_times_must_be_timezone_aware(field: str) -> None:
    rejected(rf"{field} must be timezone-aware", **{field: datetime(2030, 1, 1, 12, 0)})
    rejected(rf"{field} must be timezone-aware", **{field: datetime.now()})


@pytest.mark.parametrize("field", ["available_at", "deadline"])
@pytest.mark.parametrize(
    "value",
    ["2030-01-01T00:00:00+00:00", 1_900_000_000, date(2030, 1, 1), timedelta(minutes=5)],
    ids=lambda v: type(v).__name__,
)
def test_times_must_be_datetimes(field: str, value: Any) -> None:
    rejected(rf"{field} must be a datetime, not {type(value).__name__}", **{field: value})


@pytest.mark.parametrize(
    "when",
    [
        datetime(2030, 1, 1, tzinfo=UTC),
        datetime(2030, 1, 1, tzinfo=timezone(timedelta(hours=-5))),
    ],
)
def test_aware_times_are_accepted(when: datetime) -> None:
    accepted(available_at=when, deadline=when + timedelta(days=1))


# -- cancel and the async twins validate too -----------------------------------------------------


def test_cancel_validates_key_and_step() -> None:
    with pytest.raises(outbox.InvalidMessage, match="key must be a non-empty string"):
        outbox.cancel(Untouchable(), key="", step="charge")  # type: ignore[arg-type]
    with pytest.raises(outbox.InvalidMessage, match="'key:step' is 256 characters"):
        outbox.cancel(Untouchable(), key="k" * 250, step="s" * 5)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_async_twins_validate_before_touching_the_database() -> None:
    target: Any = Untouchable()
    with pytest.raises(outbox.InvalidMessage, match=r"payload\['x'\] is nan"):
        await outbox.write_async(target, **{**GOOD, "payload": {"x": math.nan}})
    with pytest.raises(outbox.InvalidMessage, match="destination"):
        await outbox.write_async(target, **{**GOOD, "destination": "a b"})
    with pytest.raises(outbox.InvalidMessage, match="deadline must be timezone-aware"):
        await outbox.write_async(target, **GOOD, deadline=datetime(2030, 1, 1))
    with pytest.raises(outbox.InvalidMessage, match="step must be a non-empty string"):
        await outbox.cancel_async(target, key="order:1", step=" ")
