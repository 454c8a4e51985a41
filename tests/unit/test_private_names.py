"""No module of the product uses another module's private names (a leading underscore): what
two modules share is public in one of them, so a reader can trust that a `_name` is used only
where it is defined. Checked on the source with the AST, including `module._name` through an
imported module, and shown to catch each form."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "relay", "reconciler")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _ours(module: str | None, level: int = 0) -> bool:
    """A module of the product (a relative import, or under one of its packages), not the
    standard library's or a dependency's: their private names are their business."""
    return level > 0 or (module or "").split(".")[0] in PACKAGES


def violations(source: str, where: str = "<source>") -> list[str]:
    """Each use of another product module's private name in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    modules: set[str] = set()  # names bound to imported modules in this file
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _ours(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if not _ours(node.module, node.level):
                continue
            if node.module and any(_private(part) for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import …")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {node.module or '.'} import {alias.name}")
                # `from . import operator` binds a module; `from .x import y` may bind either,
                # and an attribute's private name through it is still someone else's.
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def product_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_uses_another_modules_private_names() -> None:
    found = [v for path in product_files() for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "private names used outside their module:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from .operator import _connection\n",
        "from outbox.cli.operator import describe, _describe as d\n",
        "from .jobs._common import x\n",
        "import outbox._internal\n",
        "from . import operator\noperator._connection()\n",
        "import outbox.cli.operator as op\nop._describe\n",
    ],
)
def test_each_form_is_caught(source: str) -> None:
    assert violations(source) != []


def test_own_and_dunder_names_pass() -> None:
    source = (
        "from __future__ import annotations\nimport argparse\nfrom typing import _T\n"
        "_x = 1\nprint(_x, argparse.__name__, argparse._SubParsersAction, self._y)\n"
    )
    assert violations(source) == []
