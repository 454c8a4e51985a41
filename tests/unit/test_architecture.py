"""docs/architecture.md answers "where is …?" with a module and a name: each answer must name a
real module holding that name, so the map cannot drift from the code unnoticed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
ANSWER = re.compile(r"^\| (?P<question>[^|]+\?) \| `(?P<module>[\w.]+)` \| `(?P<name>\w+)` \|$", re.M)


def answers() -> list[tuple[str, str, str]]:
    text = PAGE.read_text()
    section = text[text.index("## Where is …?") :]
    section = section[: section.index("\n## ", 1)]
    return [(m["question"], m["module"], m["name"]) for m in ANSWER.finditer(section)]


def test_the_page_answers_the_questions_a_reader_asks_first() -> None:
    questions = {q for q, _, _ in answers()}
    for asked in (
        "Where is the claim?",
        "Where is the take?",
        "Where is a lookup's answer settled?",
        "Where is a call's outcome recorded?",
    ):
        assert asked in questions
    assert sum(q.startswith("Who writes `outbox_destination`") for q in questions) >= 3


@pytest.mark.parametrize(("question", "module", "name"), answers())
def test_each_answer_names_a_real_thing(question: str, module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{question} {module}.{name}"


def test_every_word_of_the_glossary_points_at_the_code() -> None:
    text = PAGE.read_text()
    words = text[text.index("## Words") : text.index("## Where is …?")]
    for word in ("take", "group", "claim", "attempt", "outcome", "move", "settle", "hold", "batch"):
        assert re.search(rf"^\| {word} \|", words, re.M), word
    for dotted in re.findall(r"`(outbox(?:\.\w+)+)`", words):
        assert resolves(dotted), dotted


def resolves(dotted: str) -> bool:
    """``dotted`` names a module, or an attribute path inside one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False
