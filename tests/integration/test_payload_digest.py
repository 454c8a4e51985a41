"""The ledger's payload digest (``outbox_payload_digest``) hashes a payload's text as it is when
no number in it needs its trailing zeros trimmed, and the normal form's text otherwise: the
same digest as the normal form's for every payload (the ledger's existing hashes and the
processes of every release rely on it), now and in what the ledger stored before. Real
PostgreSQL; payloads drawn by hypothesis with the numbers written as a client writes them."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox.settings import libpq_url

#: The digest as migration 0003 defined it: the normal form's text, always.
NORMAL_DIGEST = "sha256(convert_to(outbox_jsonb_normal(CAST(%s AS jsonb))::text, 'UTF8'))"
DIGEST = "outbox_payload_digest(CAST(%s AS jsonb))"
#: Whether the fast path took it (the function's own test on the text).
FAST = r"CAST(%s AS jsonb)::text !~ '\.[0-9]*0([^0-9]|$)'"


# Numbers as JSON texts a client may send: integers, decimals with and without trailing zeros,
# exponents (jsonb prints them without), negative zero.
numbers = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=None).map(lambda d: format(d, "f")),
    st.sampled_from(["10.0", "1.50", "0.0", "-0.0", "1e3", "1.0e1", "1.50E-2", "2.000", "100", "1.05"]),
).filter(lambda t: t not in ("-0", "NaN") and "Infinity" not in t and t != "")
# PostgreSQL's text holds no NUL, and its JSON no lone surrogate.
chars = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))
# Strings that look like the numbers the fast path looks for, and ordinary ones.
strings = st.one_of(
    st.text(chars, max_size=12),
    st.sampled_from(["v1.0", "a.b", "3.50", "1.0 ", "x.0y", "card.4111"]),
).map(json.dumps)


def json_text(leaf: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
            st.dictionaries(st.text(chars, max_size=6), children, max_size=4).map(
                lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
            ),
        ),
        max_leaves=12,
    )


payloads = json_text(st.one_of(numbers, strings, st.sampled_from(["true", "false", "null"])))


@pytest.fixture(scope="module")
def conn(services: Any) -> Any:
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as c:
        yield c


TAKEN: dict[bool, int] = {True: 0, False: 0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=payloads)
def test_the_digest_is_the_normal_forms_for_every_payload(conn: Any, text: str) -> None:
    try:
        json.loads(text)
    except ValueError:
        return  # not JSON (a key repeated is fine; a broken number is hypothesis's, not ours)
    [(fast, ours, normal)] = conn.execute(
        f"SELECT {FAST}, {DIGEST}, {NORMAL_DIGEST}", (text, text, text)
    ).fetchall()
    TAKEN[fast] += 1
    assert ours == normal, text


def test_both_ways_were_taken() -> None:
    # The property above proves nothing about a path no example took.
    assert TAKEN[True] >= 50 and TAKEN[False] >= 50, TAKEN


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ('{"amount": 10}', '{"amount": 10.00}', True),
        ('{"amount": 1.5}', '{"amount": 1.50}', True),
        ('{"amount": 1.05}', '{"amount": 1.5}', False),
        ('{"b": 1, "a": [1e3, "x.0"]}', '{"a": [1000.0, "x.0"], "b": 1.0}', True),
        ('{"v": "1.0"}', '{"v": "1"}', False),
        ('{"v": 100}', '{"v": 1e2}', True),
    ],
)
def test_equal_payloads_have_equal_digests(conn: Any, a: str, b: str, equal: bool) -> None:
    [(da, db, jsonb_equal)] = conn.execute(
        f"SELECT {DIGEST}, {DIGEST}, CAST(%s AS jsonb) = CAST(%s AS jsonb)", (a, b, a, b)
    ).fetchall()
    assert jsonb_equal is equal, "the case itself is wrong"
    assert (da == db) is equal
