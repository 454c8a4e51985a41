"""Product code says why it is the way it is, not which issue, development stop or attack
brought it: that history lives in docs/decisions/ (README.md there says what goes where). A
comment, docstring, help text or SQL string that names one fails here, with where it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import outbox

ROOT = Path(outbox.__file__).resolve().parent.parent
PRODUCT = ("outbox", "relay", "reconciler", "migrations")
SUFFIXES = {".py", ".mako", ".html", ".css"}

#: Each a way the history used to be written. "issue" alone is the demo's invoice being issued,
#: so a number must follow; a finding is a letter and a digit as an attack's report labels them.
HISTORY = re.compile(
    r"\bissues?\s*#?\d+"  # issue 17, Issue 13 part 3, issues 9
    r"|\bstop\s+\d+\b"  # stop 4
    r"|\battack\s+(?:on|finding)\b"  # attack on issue 15, attack finding F6
    r"|\b(?:first|second|third)\s+attack\b"  # second attack, B5
    r"|\bfindings?\s+[A-F]\d\b"  # finding F3
    r"|[(,;]\s*[A-F]\d(?:\s*,\s*[A-F]\d)*\)",  # (A4), (..., B5)
    re.IGNORECASE,
)


def product_files() -> list[Path]:
    # rglob does not follow the links outbox/relay, outbox/reconciler and outbox/migrations.
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*") if p.suffix in SUFFIXES)


def history_in(text: str) -> list[tuple[int, str]]:
    return [(text[: m.start()].count("\n") + 1, m.group(0)) for m in HISTORY.finditer(text)]


def test_product_code_names_no_issue_stop_or_attack() -> None:
    files = product_files()
    assert len(files) > 100, "the product's sources were not found"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what!r}"
        for path in files
        for line, what in history_in(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "product code names its history; say why in the present tense and move the story to "
        "docs/decisions/:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "# about 40 µs of a worker's CPU each (issue 17).",
        '"""The circuit breaker (Issue 13 part 3)."""',
        "-- it (outbox.ordering; attack on issue 15, A3).",
        "# migration 0007 (attack finding F6)",
        "# (second attack, B5).",
        "and once purged they are not in the table to be seen (A4).",
        "# review of this stop 4 change",
        "# see issue #32",
    ],
)
def test_the_history_patterns_catch_what_was_there(text: str) -> None:
    assert history_in(text), text


@pytest.mark.parametrize(
    "text",
    [
        "CHAIN_ISSUE = 'demo.invoicing.issue'",
        "a worker is SIGKILLed right after its commit of the first invoice's issue, before the ack",
        "DEFAULT_ORDERS = 300  # stops when 300 are confirmed",
        "the attack surface of a cookie",
        "the hex digest (0xA1) and F1(x) stay",
    ],
)
def test_the_history_patterns_pass_ordinary_words(text: str) -> None:
    assert not history_in(text), text
