"""constraints.txt pins every dependency exactly, and every install path uses it: a new release of
Dramatiq (whose internals the worker relies on) changes nothing until the file does."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin"
            found[_canonical(name)] = pinned
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for spec in [
        *project["dependencies"],
        *(s for x in ("embedded", "demo", "otel", "dev") for s in project["optional-dependencies"][x]),
    ]:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0)  # type: ignore[union-attr]
        if name != "outbox-relay":
            names.add(_canonical(name))
    return names


def test_every_dependency_is_pinned_exactly():
    missing = requirements() - set(pins())
    assert not missing, f"constraints.txt does not pin {sorted(missing)}: run make constraints"


def test_this_environment_runs_the_pinned_versions():
    for name in ("dramatiq", "sqlalchemy", "psycopg", "redis", "httpx", "apscheduler", "prometheus-client"):
        assert version(name) == pins()[name], f"{name} {version(name)} is installed, {pins()[name]} pinned"


def test_every_install_uses_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install" in line and ".[" in line]
    assert installs and all(
        "-c constraints.txt" in line for line in installs if "venv-constraints" not in line
    )
    assert 'pip install -c constraints.txt ".[dashboard]"' in (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md constraints.txt" in (ROOT / "Dockerfile").read_text()
