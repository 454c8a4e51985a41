"""Finding F3: card numbers in the forms the sanitiser used to miss never reach the database."""

from __future__ import annotations

import json
import re

import pytest

from outbox import sanitize

PAN = "4111111111111111"


def digits(text: str) -> str:
    return re.sub(r"[^0-9]", "", text)


RESPONSES = {
    # httpx's r.json() gives a float for 4111111111111111.0 and for 4.111111111111111e15
    "as a JSON float": {"source": {"number": json.loads("4111111111111111.0")}},
    "as an exponent float": {"source": {"number": json.loads("4.111111111111111e15")}},
    "as an object key": {"cards": {PAN: {"status": "ok"}}},
    "as an integer key": {"cards": {4111111111111111: "ok"}},
    "with dots": {"display": "4111.1111.1111.1111"},
    "with no-break spaces": {"display": "4111\u00a01111\u00a01111\u00a01111"},
    "with double spaces": {"display": "4111  1111  1111  1111"},
    "with slashes and spaces": {"display": "4111 / 1111 / 1111 / 1111"},
    "next to other digits": {"display": "order 42 4111 1111 1111 1111 12/25"},
    "in a list": {"seen": ["x", "4111-1111-1111-1111"]},
}


@pytest.mark.parametrize("name", list(RESPONSES))
def test_no_card_number_at_rest(name: str) -> None:
    stored = sanitize.encode_response(RESPONSES[name]) or ""
    assert PAN not in digits(stored), f"{name}: stored {stored!r}"
    assert "****1111" in stored


@pytest.mark.parametrize(
    "text",
    [
        "card 4111.1111.1111.1111 declined",
        "card 4111\u20091111\u20091111\u20091111 declined",
        "card 4111 - 1111 - 1111 - 1111 declined",
        "cards 4111111111111111,5555555555554444",
    ],
)
def test_error_text_with_a_separated_card_number(text: str) -> None:
    stored = sanitize.clean_text(text)
    assert PAN not in digits(stored), stored
    assert "[card ****1111]" in stored


@pytest.mark.parametrize(
    "value",
    [
        "2024-01-15T12:30:45Z",  # an ISO timestamp: the T ends the run
        "ref ch_1700000000000 at 1700000000.5",
        "amount 4111.11, fee 0.30",
        "4111111111111112",  # fails Luhn
        "order 123456789012",  # 12 digits
        "41111111111111111111",  # 20 digits in one group: no card number has them
    ],
)
def test_what_is_not_a_card_number_stays(value: str) -> None:
    assert sanitize.clean_text(value) == value


def test_numbers_that_are_not_card_numbers_stay_numbers() -> None:
    response = {"amount": 1234.0, "ts": 1700000000000.0, "big": 4111111111111112.0, "fee": 0.3}
    assert json.loads(sanitize.encode_response(response) or "") == response


def test_a_secret_name_key_is_still_hidden_and_a_masked_key_keeps_its_value() -> None:
    stored = json.loads(sanitize.encode_response({"cards": {PAN: {"status": "ok"}}, "pan": 1}) or "")
    assert stored == {"cards": {"[card ****1111]": {"status": "ok"}}, "pan": "***"}


def test_a_long_run_of_digit_groups_is_handled_quickly() -> None:
    text = "1 " * 50_000 + "4111 1111 1111 1111"
    stored = sanitize.clean_text(text, max_chars=10**6)
    assert stored.endswith("[card ****1111]")
