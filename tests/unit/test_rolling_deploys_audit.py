"""Every revision since the floor says, in docs/production.md, what a process of an older release
does with it and what protects the rule (issue 30): the table's first column names each revision
from the floor's to the head, alone or in a range (``0012-0013``, with an en dash)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### Rolling deploys: what an older process does, revision by revision"
#: The code migration 0022's floor lets start knows the revisions up to this one.
FLOOR = 10


def audited_revisions() -> set[int]:
    text = (ROOT / "docs" / "production.md").read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    found: set[int] = set()
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        first = line.split("|")[1]
        for start, end in re.findall(r"\b(\d{4})(?:[\u2013-](\d{4}))?\b", first):
            found.update(range(int(start), int(end or start) + 1))
    return found


def test_every_revision_since_the_floor_is_in_the_audit() -> None:
    versions = Path(str(resources.files("outbox.migrations"))) / "versions"
    head = max(int(p.name[:4]) for p in versions.glob("[0-9][0-9][0-9][0-9]_*.py"))
    missing = sorted(set(range(FLOOR + 1, head + 1)) - audited_revisions())
    assert not missing, (
        f"revisions {missing} are not in docs/production.md's table ({SECTION[4:]}): say what an "
        "older process does with each, and which of (a) database-enforced / (b) gated protects it"
    )


def test_the_audit_reads_ranges() -> None:
    assert {12, 13, 19, 20, 21, 22} <= audited_revisions()
