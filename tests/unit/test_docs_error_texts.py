"""The documentation's handlers never put a provider's body or a payload value in an error text:
users copy them, and an error text is stored as ``last_error``, shown and logged, while a
provider's answer often echoes the request (docs/handlers.md, "What is stored")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# An outbox error raised with text taken from the provider's answer or the payload.
_ERROR_CALL = re.compile(r"\b(?:PermanentError|RetryableError|AmbiguousError)\(([^\n]*)")
_ECHOING = re.compile(r"\.text\b|\.content\b|\.json\(\)|\bd\.payload\b|\.reason_phrase\b")


def sources() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.md"))
    found += sorted((ROOT / "outbox" / "demo").glob("*.py"))
    return [p for p in found if "__pycache__" not in p.parts]


def test_no_documented_handler_stores_the_providers_body_or_a_payload_value():
    offending = []
    for path in sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for call in _ERROR_CALL.finditer(line):
                if _ECHOING.search(call.group(1)):
                    offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offending == [], "\n".join(offending)


def test_the_check_finds_what_it_looks_for():
    for line in (
        'raise PermanentError(f"refused: {r.text[:200]}")',
        "raise PermanentError(f\"card declined: {r.json().get('error')}\")",
        "raise PermanentError(f\"recipient refused: {d.payload['to']}\") from exc",
        "raise RetryableError(response.text)",
    ):
        call = _ERROR_CALL.search(line)
        assert call is not None and _ECHOING.search(call.group(1)), line
    assert not _ECHOING.search(_ERROR_CALL.search('raise PermanentError(f"HTTP {r.status_code}")').group(1))
