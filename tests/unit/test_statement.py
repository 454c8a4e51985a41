"""outbox.db.Statement: hot statements converted once to positional parameters (issue 17)."""

from __future__ import annotations

import pytest

from outbox import store
from outbox.db import Statement


def test_named_placeholders_become_numbered_in_order_of_first_use() -> None:
    s = Statement("SELECT %(b)s, %(a)s WHERE x = %(b)s AND y = %(c)s")
    assert s.sql == "SELECT $1, $2 WHERE x = $1 AND y = $3"
    assert s.names == ("b", "a", "c")


@pytest.mark.parametrize("sql", ["SELECT 1", "SELECT %(a)s LIKE 'x%'", "SELECT %s"])
def test_a_statement_it_cannot_convert_exactly_is_refused(sql: str) -> None:
    with pytest.raises(ValueError):
        Statement(sql)


def test_the_claims_are_converted_whole() -> None:
    # The statements are longer than psycopg's 4,096-character parse cache: the reason for this.
    for statement, source in (
        (store.delivery._CLAIM_STATEMENT, store.delivery._CLAIM),
        (store.delivery._CLAIM_IDEMPOTENT_STATEMENT, store.delivery._CLAIM_IDEMPOTENT),
    ):
        assert len(source) > 4096
        assert "%(" not in statement.sql
        assert set(statement.names) >= {"id", "destination", "token", "lease_seconds"}
        assert statement.sql.count("$") >= len(statement.names)
