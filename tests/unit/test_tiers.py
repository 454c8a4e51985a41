"""A run's order: the fast tiers first (unit, integration), then the heavy ones (interleaving,
acceptance, browser, stress, the older release beside this one), whatever order the paths are
given in; every collected test is kept, and within a tier pytest's own order stands. Proved on a
real collection (``pytest --collect-only`` in a subprocess) of one file or directory per tier,
given heaviest first."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Heaviest first, and a directory given as a whole: `pytest tests` collects in name order.
PATHS = [
    "tests/integration/test_previous_release_beside.py",
    "tests/integration/test_ordering_concurrency.py",
    "tests/acceptance/test_dashboard_browser.py",
    "tests/acceptance/test_worker_process.py",
    "tests/interleaving",
    "tests/integration/test_step_colon.py",
    "tests/integration/test_pause.py",
    "tests/unit/test_pacing.py",
]

ORDER = ["unit", "integration", "interleaving", "acceptance", "browser", "stress", "previous_release"]

# Records the items as collected (before the conftest's sort: tryfirst) and as they will run.
RECORDER = """
import json, sys
import pytest

class Recorder:
    collected = []
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        self.collected = [item.nodeid for item in items]
    def pytest_collection_finish(self, session):
        run = [[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in session.items]
        print("RECORDED" + json.dumps({"collected": self.collected, "run": run}))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Recorder()]))
"""


def expected_tier(nodeid: str, markers: list[str]) -> str:
    for heavy in ("previous_release", "stress", "browser", "interleaving"):
        if heavy in markers:
            return heavy
    return nodeid.split("/")[1]


def test_the_fast_tiers_run_first_and_every_test_is_kept():
    done = subprocess.run(
        [sys.executable, "-c", RECORDER, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RECORDED"))[8:])
    collected, run = recorded["collected"], recorded["run"]
    ids = [nodeid for nodeid, _ in run]
    assert sorted(ids) == sorted(collected) and len(set(ids)) == len(ids)
    tiers = [expected_tier(nodeid, markers) for nodeid, markers in run]
    # Every tier is there (a file that lost its marker would fail here), in the order above.
    assert list(dict.fromkeys(tiers)) == ORDER
    # Stress tests of a module run after the module's other tests: the marker outranks the path.
    assert {t for nodeid, t in zip(ids, tiers, strict=True) if "test_ordering_concurrency.py" in nodeid} == {
        "integration",
        "stress",
    }

    # Within a tier, the files run in the order they were collected in (pytest itself may
    # reorder a module's tests around its parametrized fixtures).
    def files(nodeids: list[str]) -> list[str]:
        return list(dict.fromkeys(nodeid.split("::")[0] for nodeid in nodeids))

    for tier in ORDER:
        mine = {nodeid for nodeid, t in zip(ids, tiers, strict=True) if t == tier}
        assert files([n for n in ids if n in mine]) == files([n for n in collected if n in mine]), tier


def test_testpaths_list_the_tier_directories_fastest_first():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    directories = [path.removeprefix("tests/") for path in options["testpaths"]]
    assert directories == [tier for tier in ORDER if (ROOT / "tests" / tier).is_dir()]
    assert {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(
        directories
    ), "a tier directory testpaths does not list"
    # The slowest tests' durations end every run.
    assert "--durations=" in options["addopts"]
