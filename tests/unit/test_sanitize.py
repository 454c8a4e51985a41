"""outbox.sanitize's rules (issue 9 classes 5 and 11) and the log formatter that shares them."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from outbox import sanitize
from outbox.logs import KeyValueFormatter, first_line
from outbox.validation import header_safe

PAN = "4111111111111111"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"card {PAN} declined", "card [card ****1111] declined"),
        ("card 4111-1111-1111-1111", "card [card ****1111]"),
        ("amex 378282246310005", "amex [card ****0005]"),
        ("not luhn 4111111111111112", "not luhn 4111111111111112"),
        ("epoch ms 1764522000000 and 1764522000007", "epoch ms 1764522000000 and 1764522000007"),
        ("order 42, 12 digits 411111111111", "order 42, 12 digits 411111111111"),
        ("part of a longer run 94111111111111111", "part of a longer run 94111111111111111"),
    ],
)
def test_card_numbers_are_masked_and_nothing_else(text: str, expected: str) -> None:
    assert sanitize.redact_text(text) == expected


def test_clean_json_makes_every_value_storable_by_documented_rules() -> None:
    value = {
        "nul": "a\x00b",
        "lone": "x\ud800y",
        "nan": float("nan"),
        "inf": float("-inf"),
        "dec_int": Decimal("12.000"),
        "dec_frac": Decimal("0.1"),
        "dec_exact": Decimal("0.1000000000000000000000001"),
        "dec_nan": Decimal("NaN"),
        "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "day": date(2026, 1, 2),
        "id": uuid.UUID(int=1),
        "raw": b"\x00\x01",
        "set": {2, 1},
        "tuple": (1, "a"),
        1: "int key",
        "num": int(PAN),
        "password": "hunter2",
        "api_key": "sk_live_x",
        "company": "ACME",
        "pan": "x",
        "obj": object(),
    }
    out = sanitize.clean_json(value)
    encoded = json.dumps(out, allow_nan=False)  # strict JSON now
    assert "\\u0000" not in encoded and PAN not in encoded
    assert out["nul"] == "a\ufffdb" and out["lone"] == "x\ufffdy"
    assert (out["nan"], out["inf"]) == ("NaN", "-Infinity")
    assert out["dec_int"] == 12 and isinstance(out["dec_int"], int)
    assert out["dec_frac"] == 0.1
    assert out["dec_exact"] == "0.1000000000000000000000001"
    assert out["dec_nan"] == "NaN"
    assert out["when"] == "2026-01-02T03:04:05+00:00" and out["day"] == "2026-01-02"
    assert out["id"] == str(uuid.UUID(int=1)) and out["raw"] == "<2 bytes>"
    assert out["set"] == [1, 2] and out["tuple"] == [1, "a"] and out["1"] == "int key"
    assert out["num"] == "[card ****1111]"
    assert out["password"] == out["api_key"] == "***"
    assert out["company"] == "ACME" and out["pan"] == "***"
    assert out["obj"] == "<object>"


def test_huge_and_deep_responses_stay_bounded() -> None:
    big = sanitize.encode_response({"blob": "x" * 200_000})
    assert big is not None and len(big) < 2000 and json.loads(big)["truncated"] is True
    deep: dict[str, object] = {}
    node = deep
    for _ in range(100):
        node["n"] = {}
        node = node["n"]  # type: ignore[assignment]
    assert "<nested too deep>" in (sanitize.encode_response(deep) or "")
    assert sanitize.encode_response({"n": 10**5000}) == '{"n":"<integer of 16610 bits>"}'
    assert sanitize.encode_response(None) is None


def test_refs_are_storable_but_never_masked() -> None:
    assert sanitize.clean_ref(f"ch_{PAN}\x00") == f"ch_{PAN}\ufffd"
    assert len(sanitize.clean_ref("r" * 5000)) == sanitize.MAX_REF_CHARS


def test_error_text_is_storable_masked_and_short() -> None:
    text = sanitize.clean_text(f"boom {PAN} \x00" + "y" * 1000)
    assert text.startswith("boom [card ****1111] \ufffd") and len(text) == sanitize.MAX_ERROR_CHARS


def test_log_lines_mask_cards_in_the_message_the_fields_and_the_traceback() -> None:
    try:
        raise ValueError(f"provider said {PAN}")
    except ValueError as exc:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "charge %s failed", (PAN,), (type(exc), exc, None)
        )
        assert first_line(exc) == "provider said [card ****1111]"
    record.reason = f"card {PAN}"
    record.cvv = "123"
    line = KeyValueFormatter().format(record)
    assert PAN not in line
    assert line.count("[card ****1111]") == 3 and "cvv=***" in line


@pytest.mark.parametrize(
    ("value", "safe"),
    [
        ("order:42:charge", True),
        ("order 42:charge", True),
        ("commande:Zoë-42:charge", False),
        ("order:42\n:charge", False),
        ("order:42:charge\t", False),
        (" order:42:charge", False),
        ("order:\x7f42:charge", False),
    ],
)
def test_header_safe(value: str, safe: bool) -> None:
    assert header_safe(value) is safe


def test_a_reference_is_bounded_in_bytes_too() -> None:
    # The provider_ref index takes at most 2704 bytes an entry: a record must never fail on it.
    ref = sanitize.clean_ref("\U0001d11e" * 1000)
    assert len(ref.encode()) <= sanitize.MAX_REF_CHARS and ref == "\U0001d11e" * (sanitize.MAX_REF_CHARS // 4)


def test_credentials_inside_texts_are_masked_and_the_rest_kept() -> None:
    cleaned = sanitize.clean_json(
        {
            "header": "Authorization: Bearer abcdefghijkl",
            "url": "https://shop.example/cb?access_token=abc123&order=42",
            "body": '{"password": "hunter2", "amount": 5}',
            "key": "charged with sk_live_abcdef123",
            "PINCode": "1234",
            "API Key": "x",
            "note": "the bearer of news; amount=100",
        }
    )
    assert cleaned["header"] == "Authorization: ***"
    assert cleaned["url"] == "https://shop.example/cb?access_token=***&order=42"
    assert json.loads(cleaned["body"]) == {"password": "***", "amount": 5}
    assert cleaned["key"] == "charged with ***"
    assert cleaned["PINCode"] == cleaned["API Key"] == "***"
    assert cleaned["note"] == "the bearer of news; amount=100"
    assert (
        sanitize.clean_text("401 for Authorization: Basic dXNlcjpwYXNzd29yZA==")
        == "401 for Authorization: ***"
    )
