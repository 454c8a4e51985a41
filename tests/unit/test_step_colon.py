"""A step holds no ':' (attack finding F6): the Idempotency-Key is ``key:step``, and a ':' in
the step would let ("order:1", "refund:2") and ("order:1:refund", "2") send one key."""

from __future__ import annotations

import pytest

from outbox.exceptions import InvalidMessage
from outbox.handlers import idempotency_key
from outbox.validation import check_key_step


@pytest.mark.parametrize("step", ["refund:2", ":charge", "charge:", ":"])
def test_a_new_row_with_a_colon_in_its_step_is_refused(step: str) -> None:
    with pytest.raises(InvalidMessage, match="contains ':'"):
        check_key_step("order:1", step)


def test_keys_keep_their_colons_and_the_split_is_unambiguous() -> None:
    check_key_step("order:1:refund", "2")
    check_key_step("order:1", "refund-2")
    assert idempotency_key("order:1:refund", "2") == "order:1:refund:2"
    # The step is what follows the last ':', so two rows never share a key.
    assert idempotency_key("order:1", "refund-2").rpartition(":") == ("order:1", ":", "refund-2")


def test_an_old_row_can_still_be_named() -> None:
    check_key_step("order:1", "refund:2", new_row=False)
