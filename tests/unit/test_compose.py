"""docker-compose.yml and the Dockerfile, checked without a Docker engine: every command is one
our parsers accept, every OUTBOX_* variable is one the code reads, every dependency exists and
waits on something that can become true, and Redis is configured not to lose queued messages."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from outbox import cli, settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

ONE_SHOT = {"migrate"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("outbox has no subcommands")


def outbox_services(services: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    return {name: command_of(s) for name, s in services.items() if command_of(s)[:1] == ["outbox"]}


def test_the_pipeline_is_all_there(services):
    assert set(services) >= {
        "postgres",
        "redis",
        "migrate",
        "relay",
        "worker",
        "reconciler",
        "provider",
        "shop",
    }
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert services["redis"]["image"].split(":")[1].startswith("7")


def test_every_outbox_command_is_a_real_subcommand_with_valid_flags(services):
    known = subcommands()
    found = outbox_services(services)
    assert {argv[1] for argv in found.values()} >= {"migrate", "relay", "worker", "reconcile"}
    parser = cli.build_parser()
    for name, argv in found.items():
        assert argv[1] in known, f"service {name}: `outbox {argv[1]}` is not a subcommand ({sorted(known)})"
        try:
            parser.parse_args(argv[1:])
        except SystemExit as exc:  # argparse's way of refusing
            pytest.fail(f"service {name}: `{shlex.join(argv)}` is refused by the CLI ({exc})")


def test_the_processes_run_the_shop_handlers(services):
    assert command_of(services["migrate"])[:2] == ["outbox", "migrate"]
    assert command_of(services["relay"])[:2] == ["outbox", "relay"]
    assert command_of(services["worker"])[:3] == ["outbox", "worker", "examples.shop.handlers"]
    assert command_of(services["reconciler"])[:3] == ["outbox", "reconcile", "examples.shop.handlers"]
    for module in ("examples.shop.handlers", "examples.shop.app"):
        assert importlib.util.find_spec(module) is not None, module


def test_python_modules_exist_and_accept_their_flags(services):
    from examples.shop.app import build_parser as shop_parser
    from outbox.testing.provider import _build_parser as provider_parser

    parsers = {"examples.shop.app": shop_parser(), "outbox.testing.provider": provider_parser()}
    commands = {name: command_of(s) for name, s in services.items() if command_of(s)[:2] == ["python", "-m"]}
    assert {argv[2] for argv in commands.values()} == set(parsers)
    for name, argv in commands.items():
        try:
            parsers[argv[2]].parse_args(argv[3:])
        except SystemExit as exc:
            pytest.fail(f"service {name}: `{shlex.join(argv)}` is refused ({exc})")
    assert "--rate" in commands["shop"]


def documented_reconciler_variables() -> set[str]:
    from outbox.cli import reconcile as reconciler_cli

    return set(re.findall(r"\bOUTBOX_[A-Z_]+\b", reconciler_cli.DESCRIPTION))


def test_every_outbox_variable_is_one_the_code_reads(services):
    allowed = set(settings.ENVIRONMENT) | documented_reconciler_variables()
    referenced = set(re.findall(r"\bOUTBOX_[A-Z_]+\b", COMPOSE.read_text()))
    assert referenced, "the compose file configures nothing through OUTBOX_* variables"
    assert referenced <= allowed, f"unknown variables: {sorted(referenced - allowed)}"
    for name, service in services.items():
        env = {k: v for k, v in environment_of(service).items() if k in settings.ENVIRONMENT}
        try:
            settings.from_env(env)
        except settings.ConfigError as exc:
            pytest.fail(f"service {name}: {exc}")


def test_outbox_processes_are_configured(services):
    for name, argv in outbox_services(services).items():
        env = environment_of(services[name])
        assert "OUTBOX_DATABASE_URL" in env, name
        if argv[1] != "migrate":
            assert "OUTBOX_REDIS_URL" in env, name
            assert env.get("OUTBOX_NAMESPACE", "outbox") != "", name
    # The shop writes its outbox rows into the database the pipeline reads.
    assert (
        environment_of(services["shop"])["OUTBOX_DATABASE_URL"]
        == environment_of(services["relay"])["OUTBOX_DATABASE_URL"]
    )


def test_dependencies_exist_and_can_be_satisfied(services):
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            pytest.fail(f"service {name}: depends_on without conditions starts before the target is ready")
        for target, spec in depends.items():
            assert target in services, f"service {name} depends on missing service {target}"
            condition = spec.get("condition")
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy: no check"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", f"{target} must be one-shot"
            else:
                pytest.fail(f"service {name} -> {target}: condition {condition!r}")
        network = service.get("network_mode", "")
        if network.startswith("service:"):
            target = network.split(":", 1)[1]
            assert target in services and target in depends, f"{name} shares the network of {target}"
    for name in ("relay", "worker", "reconciler", "shop"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for name in ("relay", "worker", "reconciler"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_redis_never_evicts_and_persists_the_queues(services):
    command = " ".join(command_of(services["redis"]))
    assert re.search(r"--maxmemory-policy\s+noeviction\b", command)
    assert re.search(r"--appendonly\s+yes\b", command)


def test_healthchecks(services):
    def check(name: str) -> str:
        test = services[name]["healthcheck"]["test"]
        return " ".join(test) if isinstance(test, list) else test

    # Over TCP: the image's temporary first-start server listens on its socket only.
    assert re.search(r"pg_isready -h 127\.0\.0\.1\b", check("postgres"))
    assert re.search(r"redis-cli\s+ping", check("redis"))
    provider = check("provider")
    port = command_of(services["provider"])[command_of(services["provider"]).index("--port") + 1]
    assert f"http://127.0.0.1:{port}/" in provider
    for name in ("relay", "worker", "reconciler"):
        metrics_port = environment_of(services[name])["OUTBOX_METRICS_PORT"]
        assert f"http://127.0.0.1:{metrics_port}/readyz" in check(name), name


def test_migrate_waits_for_a_database_that_is_still_starting(services):
    command = command_of(services["migrate"])
    assert command[:2] == ["outbox", "migrate"] and "--wait" in command


def test_the_provider_is_reachable_where_the_handlers_look(services):
    command = command_of(services["provider"])
    port = command[command.index("--port") + 1]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "ports" not in services["provider"], "the simulator must not be published to the host"
    for name in ("worker", "reconciler"):
        # Their own network namespaces: a restart of the provider does not cut theirs.
        assert "network_mode" not in services[name], name
        assert environment_of(services[name])["SHOP_PROVIDER_URL"] == f"http://provider:{port}", name


def test_dockerfile_installs_the_project_on_python_311_slim():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert re.search(r"pip install -c constraints\.txt \.(\s|$)", text)
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()}
    for source in re.findall(r"^COPY\s+(?!--)(.+?)\s+\S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: no such file"
            assert path.rstrip("/") not in ignored, f"COPY {path} but .dockerignore excludes it"
    # What the package build needs is copied before `pip install .`.
    install = text.index("pip install -c constraints.txt .")
    for needed in (
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "migrations/",
        "outbox/",
        "relay/",
        "reconciler/",
    ):
        assert needed in text[:install], needed
    # The examples' handler modules are found at run time.
    assert re.search(r"^ENV PYTHONPATH=(\S+)", text, re.MULTILINE)
