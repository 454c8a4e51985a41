"""The package's layers (pyproject.toml, [tool.importlinter]; docs/architecture.md): arrows point
down, every module is placed in a layer, no import cycle at any depth. Checked by the real tool,
and each contract is shown to break on the import it forbids."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from importlinter.configuration import configure
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = {
    c["id"]: c
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
}
TYPES = {"layers": LayersContract, "acyclic_siblings": AcyclicSiblingsContract}


def contract(contract_id: str):
    configure()
    raw = CONTRACTS[contract_id]
    # import-linter reads its options as INI text: booleans as "True".
    options = {
        k: str(v) if isinstance(v, bool) else v for k, v in raw.items() if k not in ("id", "name", "type")
    }
    return TYPES[raw["type"]](
        name=raw["name"], session_options={"root_packages": ["outbox"]}, contract_options=options
    )


@pytest.fixture
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("outbox", cache_dir=None)


def test_lint_imports_keeps_every_contract() -> None:
    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert tool is not None, "import-linter is not installed (make installs the dev set)"
    run = subprocess.run([tool, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in run.stdout, run.stdout


def test_the_contracts_hold_on_the_package_as_it_is(graph) -> None:
    for contract_id in CONTRACTS:
        assert contract(contract_id).check(graph, verbose=False).kept, contract_id


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("outbox.handlers", "outbox.breaker"),  # a rule reaching up into a destination's SQL
        ("outbox.store.delivery", "outbox.consumer"),  # the store reaching up into a service
        ("outbox.ops.repair", "outbox.cli.render"),  # data reaching up into its rendering
        ("outbox.settlement", "outbox.reconciler.jobs.resolve_unknown"),  # the library into a job
        ("outbox.metrics", "outbox.ops.ordering"),  # observability into the operator's faces
    ],
)
def test_an_import_pointing_up_breaks_the_layers(graph, importer: str, imported: str) -> None:
    graph.add_import(importer=importer, imported=imported)
    assert not contract("layers").check(graph, verbose=False).kept


def test_a_module_in_no_layer_breaks_the_layers(graph) -> None:
    graph.add_module("outbox.somewhere_new")
    assert not contract("layers").check(graph, verbose=False).kept


def test_a_store_module_importing_another_callers_breaks_the_store_contract(graph) -> None:
    graph.add_import(importer="outbox.store.operator", imported="outbox.store.recovery")
    assert not contract("store").check(graph, verbose=False).kept


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("outbox.cli.limits", "outbox.cli.pauses"),  # one command reaching into another
        ("outbox.cli.common", "outbox.cli.operator"),  # the shared helpers into a command
        ("outbox.cli.render", "outbox.cli.output"),  # rendering into where it is printed
    ],
)
def test_an_import_across_the_clis_commands_breaks_the_cli_contract(
    graph, importer: str, imported: str
) -> None:
    graph.add_import(importer=importer, imported=imported)
    assert not contract("cli").check(graph, verbose=False).kept


@pytest.mark.parametrize(
    ("contract_id", "importer", "imported"),
    [
        ("dashboard", "outbox.dashboard.queries", "outbox.dashboard.app"),  # SQL into the pages
        ("dashboard", "outbox.dashboard.chart", "outbox.dashboard.security"),  # two parts of a page
        ("ops", "outbox.ops.inspect", "outbox.ops.actions"),  # reading into acting
        ("ops", "outbox.ops.values", "outbox.ops.ordering"),  # the values into a report
    ],
)
def test_an_import_pointing_up_inside_a_face_breaks_its_contract(
    graph, contract_id: str, importer: str, imported: str
) -> None:
    graph.add_import(importer=importer, imported=imported)
    assert not contract(contract_id).check(graph, verbose=False).kept


def test_a_job_importing_the_scheduler_breaks_the_reconciler_contract(graph) -> None:
    graph.add_import(importer="outbox.reconciler.jobs.purge", imported="outbox.reconciler.scheduler")
    assert not contract("reconciler").check(graph, verbose=False).kept


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("outbox.ops.values", "outbox.ops.inspect"),  # inside a package
        ("outbox.reconciler.jobs.common", "outbox.reconciler.jobs.redispatch"),  # two levels down
    ],
)
def test_an_import_cycle_breaks_the_acyclic_contract(graph, importer: str, imported: str) -> None:
    graph.add_import(importer=importer, imported=imported)
    assert not contract("acyclic").check(graph, verbose=False).kept


def test_every_report_of_ops_has_a_text_form() -> None:
    import outbox.ops.actions
    import outbox.ops.audit
    import outbox.ops.batches
    import outbox.ops.inspect
    import outbox.ops.progress
    import outbox.ops.repair
    from outbox.cli.render import _FORMS

    modules = [
        outbox.ops.actions,
        outbox.ops.audit,
        outbox.ops.batches,
        outbox.ops.inspect,
        outbox.ops.progress,
        outbox.ops.repair,
    ]
    for name in _FORMS:
        assert any(isinstance(getattr(m, name, None), type) for m in modules), name
