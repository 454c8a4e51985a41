"""Every write of ``outbox_message`` lives in ``outbox/transitions.py``: a reviewer checks the
guarded statements in one place. A statement that writes the table anywhere else in the product
packages fails here, with where it is."""

from __future__ import annotations

import re
from pathlib import Path

import outbox
from outbox import states, transitions

ROOT = Path(outbox.__file__).resolve().parent.parent
PRODUCT = ("outbox", "relay", "reconciler")
WRITES = re.compile(
    r"\b(UPDATE\s+outbox_message|INSERT\s+INTO\s+outbox_message|DELETE\s+FROM\s+outbox_message"
    r"|TRUNCATE\s+(TABLE\s+)?outbox_message)\b",
    re.IGNORECASE,
)
HOME = ROOT / "outbox" / "transitions.py"
# Test tooling that empties the tables between a user's tests: no state move.
EMPTIES_FOR_TESTS = ROOT / "outbox" / "testing" / "databases.py"


def product_sources() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def test_the_pattern_finds_writes() -> None:
    # The grep below is only as good as its pattern: it must see each kind of write.
    for sql in (
        "UPDATE outbox_message SET",
        "update  outbox_message m",
        "INSERT INTO outbox_message (key)",
        "DELETE FROM outbox_message WHERE",
        "TRUNCATE outbox_message",
    ):
        assert WRITES.search(sql), sql
    assert not WRITES.search("SELECT * FROM outbox_message")
    assert not WRITES.search("UPDATE outbox_attempt SET")


def test_only_transitions_writes_outbox_message() -> None:
    sources = product_sources()
    assert HOME in sources and len(sources) > 20
    elsewhere = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path in sources
        if path != HOME
        for text in [path.read_text()]
        for m in WRITES.finditer(text)
        if not (path == EMPTIES_FOR_TESTS and m.group(0).upper().startswith("TRUNCATE"))
    ]
    assert elsewhere == [], "writes of outbox_message outside outbox/transitions.py:\n" + "\n".join(elsewhere)
    assert len(WRITES.findall(HOME.read_text())) >= 20


def test_every_move_is_named_in_the_state_table() -> None:
    # The state table (outbox.states) names the function behind each move: each name is a
    # function of outbox.transitions, and each move there is named in the table.
    named = set(re.findall(r"``([a-z_]+)``", states.__doc__ or "")) - set(states.ALL)
    named -= {"available_at", "provider_ref", "outbox_message"}
    missing = {name for name in named if not callable(getattr(transitions, name, None))}
    assert missing == set()
    moves = {
        name
        for name, value in vars(transitions).items()
        if not name.startswith("_")
        and callable(value)
        and not isinstance(value, type)
        and getattr(value, "__module__", "") == transitions.__name__
    }
    # Async twins share their sync move's statement; elapse is for tests (no state changes).
    assert (
        moves - {"insert_async", "cancel_by_key_async", "insert_batch_async", "insert_member_async", "elapse"}
        == named
    )
    listed = set(re.findall(r":func:`([a-z_]+)`", transitions.__doc__ or ""))
    assert (
        moves - {"insert_async", "cancel_by_key_async", "insert_batch_async", "insert_member_async"} == listed
    )
