"""Payload models, versions and upgrades (outbox.payloads), without services."""

from __future__ import annotations

from typing import Any, ClassVar

import pydantic
import pytest

import outbox
from outbox import payloads
from outbox.exceptions import ConfigError, InvalidMessage
from outbox.payloads import PayloadInvalid, PayloadTooNew


class ChargeV1(pydantic.BaseModel):
    amount: int


class ChargeV3(pydantic.BaseModel):
    payload_version: ClassVar[int] = 3
    amount_cents: int
    currency: str
    note: str | None = None


def cents(p: dict[str, Any]) -> dict[str, Any]:
    p["amount_cents"] = p.pop("amount") * 100
    return p


def euro(p: dict[str, Any]) -> dict[str, Any]:
    return {**p, "currency": "EUR"}


UPGRADES = {1: cents, 2: euro}


def prepare(payload: dict[str, Any], version: int, model: Any = ChargeV3, upgrades: Any = UPGRADES) -> Any:
    return payloads.prepare(
        destination="payments.charge", model=model, upgrades=upgrades, payload=payload, version=version
    )


def test_an_old_payload_goes_through_each_upgrade_in_turn() -> None:
    done = prepare({"amount": 12}, 1)
    assert done.payload == {"amount_cents": 1200, "currency": "EUR"}
    assert isinstance(done.model, ChargeV3) and done.model.amount_cents == 1200
    assert prepare({"amount_cents": 5, "currency": "SEK"}, 2).payload == {
        "amount_cents": 5,
        "currency": "EUR",
    }
    assert prepare({"amount_cents": 5, "currency": "SEK"}, 3).payload == {
        "amount_cents": 5,
        "currency": "SEK",
    }


def test_an_upgrade_never_changes_the_stored_payload() -> None:
    stored = {"amount": 12}
    prepare(stored, 1)
    assert stored == {"amount": 12}


def test_a_version_without_an_upgrade_is_taken_as_it_is() -> None:
    # Version 2 added an optional field only: no upgrade 1 -> 2 needed.
    class V2(pydantic.BaseModel):
        payload_version: ClassVar[int] = 2
        amount: int
        note: str | None = None

    assert prepare({"amount": 3}, 1, V2, None).model.amount == 3


def test_invalid_names_the_fields_and_not_their_values() -> None:
    with pytest.raises(PayloadInvalid) as info:
        prepare({"amount_cents": "4111111111111111x", "currency": "EUR"}, 3)
    message = str(info.value)
    assert "amount_cents" in message and "ChargeV3" in message and "version 3" in message
    assert "4111111111111111" not in message, "a payload value reached the error"
    assert isinstance(info.value, InvalidMessage) and isinstance(info.value, outbox.OutboxError)
    with pytest.raises(PayloadInvalid, match=r"currency: Field required"):
        prepare({"amount_cents": 1}, 3)


def test_a_renamed_field_is_invalid_for_an_old_payload_without_its_upgrade() -> None:
    with pytest.raises(PayloadInvalid, match=r"version 1, upgraded to 3\) does not match ChargeV3"):
        prepare({"amount": 12}, 1, ChargeV3, {2: euro})


def test_newer_than_the_handler_is_too_new_not_invalid() -> None:
    with pytest.raises(PayloadTooNew, match="newer than this handler's"):
        prepare({"amount_cents": 1, "currency": "EUR"}, 4)
    with pytest.raises(PayloadTooNew):
        prepare({"amount": 1}, 2, ChargeV1, None)


@pytest.mark.parametrize(
    ("upgrade", "expected"),
    [
        (lambda p: p["missing"], r"upgrade 1 -> 2 \(.*\) raised KeyError"),
        (lambda p: [p], r"upgrade 1 -> 2 \(.*\) returned list, expected a dict"),
    ],
)
def test_an_upgrade_that_fails_makes_the_payload_invalid(upgrade: Any, expected: str) -> None:
    with pytest.raises(PayloadInvalid, match=expected):
        prepare({"amount": 1}, 1, None, {1: upgrade})


def test_the_current_version() -> None:
    assert payloads.declared_version(None, None) == 1
    assert payloads.declared_version(ChargeV1, None) == 1
    assert payloads.declared_version(None, {1: cents, 2: euro}) == 3
    assert payloads.declared_version(ChargeV3, {1: cents}) == 3


@pytest.mark.parametrize(
    ("model", "upgrades", "problem"),
    [
        (dict, None, "payload_model must be a pydantic model"),
        (None, [cents], "upgrades must be a dict"),
        (None, {0: cents}, "version 0 is not a whole number >= 1"),
        (None, {True: cents}, "version True is not a whole number"),
        (None, {1: "cents"}, r"upgrades\[1\] is not callable"),
        (ChargeV3, {3: cents}, r"upgrades \[3\] reach past the current payload version 3"),
    ],
)
def test_bad_declarations_are_refused_at_import(model: Any, upgrades: Any, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        outbox.handler("payments.charge", payload_model=model, upgrades=upgrades)(lambda d: None)


def test_a_model_with_a_bad_version_is_refused() -> None:
    class Bad(pydantic.BaseModel):
        payload_version: ClassVar[Any] = "2"
        amount: int

    with pytest.raises(ConfigError, match=r"Bad.payload_version must be a whole number >= 1"):
        outbox.handler("payments.charge", payload_model=Bad)(lambda d: None)


def test_a_handler_reports_its_version() -> None:
    h = outbox.handler("payments.charge", payload_model=ChargeV3, upgrades=UPGRADES)(lambda d: None)
    assert h.payload_version == 3 and h.checks_payloads
    plain = outbox.handler("mail.send")(lambda d: None)
    assert plain.payload_version == 1 and not plain.checks_payloads


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
def test_write_refuses_a_bad_payload_version(bad: Any) -> None:
    if bad is None:
        assert payloads.check_version(7) == 7
        return
    with pytest.raises(InvalidMessage, match="payload_version must be a whole number >= 1"):
        payloads.check_version(bad)
