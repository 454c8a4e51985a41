"""Issue 9 class 6: destination names Dramatiq's Redis broker would misread are refused, by one
rule (``outbox.validation.destination_problem``) at ``write`` and at ``@handler``.

The rule is checked against Dramatiq itself: every refused name is one that Dramatiq's own
functions read as a derived name (never consumed), or whose keys collide with the keys derived
from another name; accepted names derive keys that never collide.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from dramatiq.common import dq_name, q_name, xq_name

import outbox
from outbox import handlers as handlers_module
from outbox.validation import destination_problem

REFUSED = {
    "payments.DQ": "'.DQ'",
    "payments.XQ": "'.XQ'",
    "payments.msgs": "'.msgs'",
    "payments.DQ.msgs": "'.msgs'",
    "__heartbeats__": "'__heartbeats__'",
    "__acks__.0f3b.payments": "'__acks__'",
}
ACCEPTED = ["payments", "payments.charge", "payments.dq", "payments.DQx", "msgs", "a.msgs2", "_acks", "XQ"]


def derived_keys(queue: str) -> dict[str, str]:
    """Every Redis key (after ``namespace:``) Dramatiq's dispatch.lua touches for ``queue``, by
    its type; the worker's ack sets are "__acks__.<worker>.<queue>"."""
    canonical = queue[:-3] if queue.endswith(".DQ") else queue
    return {
        queue: "list",
        f"{queue}.msgs": "hash",
        dq_name(queue): "list",
        f"{dq_name(queue)}.msgs": "hash",
        xq_name(canonical): "zset",
        f"{xq_name(canonical)}.msgs": "hash",
    }


class Touched(Exception):
    pass


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise Touched(name)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_write_refuses_a_name_the_broker_misreads_with_the_reason(name: str) -> None:
    with pytest.raises(outbox.InvalidMessage) as error:
        outbox.write(Untouchable(), key="order:1", step="charge", destination=name, payload={})  # type: ignore[arg-type]
    assert REFUSED[name] in str(error.value) and "Dramatiq" in str(error.value)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_handler_refuses_a_name_the_broker_misreads_with_the_reason(name: str) -> None:
    try:
        with pytest.raises(outbox.ConfigError) as error:
            outbox.handler(name)(lambda d: None)
        assert REFUSED[name] in str(error.value) and "Dramatiq" in str(error.value)
        assert name not in handlers_module.registry()
    finally:
        handlers_module.clear_registry()


@pytest.mark.parametrize("name", ACCEPTED)
def test_names_with_those_letters_elsewhere_are_accepted(name: str) -> None:
    assert destination_problem(name) is None
    with pytest.raises(Touched):
        outbox.write(Untouchable(), key="order:1", step="charge", destination=name, payload={})  # type: ignore[arg-type]


def test_each_refused_name_is_misread_by_dramatiq_or_collides() -> None:
    """Not a list we made up: Dramatiq's worker consumes a queue only if ``q_name(queue)`` is in
    its whitelist (we always pass one), and two destinations whose keys coincide with different
    types make Redis answer WRONGTYPE."""
    for name in REFUSED:
        if name.startswith("__"):
            continue  # Dramatiq's own keys: __heartbeats__ (zset), __acks__.* (sets)
        never_consumed = q_name(name) != name
        base = name.rsplit(".", 1)[0]
        clash = {
            k: (derived_keys(name)[k], t)
            for k, t in derived_keys(base).items()
            if k in derived_keys(name) and derived_keys(name)[k] != t
        }
        assert never_consumed or clash, name


def test_accepted_names_never_share_a_key() -> None:
    names = ["payments", "payments.charge", "payments.charge.v2", "a", "a.b", "a.dq", "msgs", "x.msgs2"]
    assert all(destination_problem(n) is None for n in names)
    for a, b in itertools.combinations(names, 2):
        assert not set(derived_keys(a)) & set(derived_keys(b)), (a, b)
        assert q_name(a) == a
