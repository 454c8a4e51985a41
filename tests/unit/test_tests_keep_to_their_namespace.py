"""The test suite runs on a Redis of yours when OUTBOX_TEST_REDIS_URL names one, and the README
promises it removes only its own (`outboxtest:`) keys there: no test may empty the whole
database. Two tests simulated a Redis flush with FLUSHDB and took a user's keys with them; a
lost queue is the namespace deleted (outbox.transport.delete_namespace), as the demo's chaos does
on a Redis it does not own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMPTIES_A_DATABASE = re.compile(r"\b(flushdb|flushall)\s*\(|[\"']\s*(FLUSHDB|FLUSHALL)\b", re.IGNORECASE)


def test_the_pattern_finds_a_flush() -> None:
    for code in (
        "redis_client.flushdb()",
        "client.FLUSHALL( )",
        'execute_command("FLUSHDB")',
        "r.flushall(asynchronous=True)",
    ):
        assert EMPTIES_A_DATABASE.search(code), code
    assert not EMPTIES_A_DATABASE.search("delete_namespace(client, namespace)")


def test_no_test_empties_the_redis_database_it_is_given() -> None:
    found = [
        f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if EMPTIES_A_DATABASE.search(line)
    ]
    assert found == [], "\n".join(found)
