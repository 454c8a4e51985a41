"""A module of the application named on the command line is found in the working directory, as
uvicorn and Dramatiq find it, and that directory never comes before what is installed."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from outbox.alerts import load_alert_hook
from outbox.exceptions import ConfigError
from outbox.handlers import isolated_registry, load_module
from outbox.usermodules import import_user_module


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An application directory, the working directory, not on sys.path (as under a console
    script); sys.path is restored after the test. The modules' names are unique to the test."""
    directory = tmp_path / "app"
    directory.mkdir()
    monkeypatch.chdir(directory)
    here = str(directory)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != here])
    return directory


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def test_a_module_in_the_working_directory_is_imported(app: Path) -> None:
    name = unique("probe")
    (app / f"{name}.py").write_text("VALUE = 'from the app'\n")
    assert import_user_module(name).VALUE == "from the app"
    assert sys.path[-1] == str(app)
    import_user_module(name)
    assert sys.path.count(str(app)) == 1


def test_the_working_directory_comes_after_what_is_installed(app: Path, tmp_path: Path) -> None:
    name = unique("shadowed")
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / f"{name}.py").write_text("VALUE = 'installed'\n")
    (app / f"{name}.py").write_text("VALUE = 'from the app'\n")
    sys.path.insert(0, str(installed))
    assert import_user_module(name).VALUE == "installed"


def test_a_handler_package_in_the_working_directory_loads(app: Path) -> None:
    package = unique("myapp")
    (app / package).mkdir()
    (app / package / "handlers.py").write_text(
        "import outbox\n\n\n"
        f"@outbox.handler({package + '.charge'!r})\n"
        "def charge(d):\n"
        "    return outbox.Confirmed(ref='x')\n"
    )
    with isolated_registry():
        assert list(load_module(f"{package}.handlers")) == [f"{package}.charge"]


def test_a_missing_handler_module_says_where_it_is_looked_for(app: Path) -> None:
    with pytest.raises(ConfigError, match="run the command from the directory that holds it"):
        load_module(unique("nowhere") + ".handlers")


def test_an_alert_hook_in_the_working_directory_loads(app: Path) -> None:
    name = unique("hooks")
    (app / f"{name}.py").write_text("def page(alert):\n    pass\n")
    hook = load_alert_hook(f"{name}:page")
    assert hook.__module__ == name and hook.__name__ == "page"
