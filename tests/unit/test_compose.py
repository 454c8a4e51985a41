"""docker-compose.yml and the Dockerfile, checked without a Docker engine: every command is one
our parsers accept, every OUTBOX_* variable is one the code reads, every dependency exists and
waits on something that can become true, and Redis is configured not to lose queued messages.
Every image is pinned (version and digest), the project's image is built once and run by every
service of ours, every long-running service has a healthcheck, and the dashboard is served."""

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
from outbox.cli import dashboard as dashboard_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

ONE_SHOT = {"migrate"}

#: The project's image: built by one service, run by every service of ours.
PROJECT_IMAGE = "outbox:local"
#: An exact version and the digest of its multi-platform index.
PINNED = re.compile(r"^[a-z0-9./-]+:\d+\.\d+(\.\d+)?(-[a-z0-9]+)*@sha256:[0-9a-f]{64}$")
DASHBOARD_VARIABLES = {
    dashboard_cli.SECRET_ENV,
    dashboard_cli.USERS_ENV,
    dashboard_cli.INSECURE_ENV,
    dashboard_cli.TRUSTED_PROXIES_ENV,
}


def interpolated(value: str) -> str:
    """Compose's ``${NAME:-default}`` with NAME unset, as on a machine that sets nothing."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


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
        "dashboard",
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
    allowed = set(settings.ENVIRONMENT) | documented_reconciler_variables() | DASHBOARD_VARIABLES
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
        # Migrations and the dashboard work on the database alone.
        if argv[1] not in ("migrate", "dashboard"):
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
    base = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert len(base) == 1 and PINNED.match(base[0]), f"FROM {base}: not an exact version and digest"
    assert re.match(r"python:3\.11\.\d+-slim-", base[0])
    # The dashboard's extra with the package: `outbox dashboard` runs from this image.
    assert re.search(r'pip install -c constraints\.txt "\.\[dashboard\]"(\s|$)', text)
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()}
    for source in re.findall(r"^COPY\s+(?!--)(.+?)\s+\S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: no such file"
            assert path.rstrip("/") not in ignored, f"COPY {path} but .dockerignore excludes it"
    # What the package build needs is copied before `pip install .`.
    install = text.index("pip install -c constraints.txt ")
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


def test_every_image_is_pinned_to_a_version_and_digest(services):
    for name, service in services.items():
        image = service["image"]
        if image == PROJECT_IMAGE:
            continue
        if name in ("postgres", "redis"):
            assert PINNED.match(image), f"{name}: {image} is not an exact version and digest"
        else:
            # The observability profile's images: an exact version at least.
            assert re.search(r":v?\d+\.\d+\.\d+", image), f"{name}: {image} is not an exact version"
    assert services["postgres"]["image"].startswith("postgres:16.")
    assert services["redis"]["image"].startswith("redis:7.")


def test_the_project_image_is_built_once_and_run_by_every_service_of_ours(services):
    builders = [name for name, service in services.items() if "build" in service]
    assert builders == ["migrate"], f"services that build: {builders}"
    build = services["migrate"]["build"]
    assert (build if isinstance(build, str) else build["context"]) in (".", "./")
    ours = {name for name, s in services.items() if command_of(s)[:1] in (["outbox"], ["python"])}
    assert ours >= {"migrate", "relay", "worker", "reconciler", "provider", "shop", "dashboard"}
    for name in ours:
        assert services[name]["image"] == PROJECT_IMAGE, name
    assert {name for name, s in services.items() if s["image"] == PROJECT_IMAGE} == ours


def test_every_long_running_service_has_a_healthcheck(services):
    for name, service in services.items():
        if name in ONE_SHOT:
            continue
        assert "healthcheck" in service, f"{name} runs for good without a healthcheck"
        test = service["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), name


def test_the_shop_is_healthy_while_it_places_orders(services):
    from examples.shop.app import ORDERS_TABLE

    check = services["shop"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    code = check[3]
    compile(code, "shop healthcheck", "exec")
    assert "OUTBOX_DATABASE_URL" in code and "OUTBOX_DATABASE_URL" in environment_of(services["shop"])
    assert re.search(rf"FROM {ORDERS_TABLE}\b", code) and "max(created_at)" in code


def test_the_dashboard_is_served_on_the_hosts_loopback_with_users_and_a_secret(services):
    from outbox.dashboard.security import MIN_SECRET_CHARS, parse_users, verify_password

    service = services["dashboard"]
    command = command_of(service)
    args = cli.build_parser().parse_args(command[1:])
    assert command[:2] == ["outbox", "dashboard"]
    # All interfaces inside the container; published on the host's loopback only.
    assert args.host == "0.0.0.0"
    assert service["ports"] == [f"127.0.0.1:{args.port}:{args.port}"]
    check = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{args.port}/login" in check
    assert importlib.util.find_spec(args.module) is not None
    assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"

    env = {k: interpolated(v) for k, v in environment_of(service).items()}
    assert env["OUTBOX_DATABASE_URL"] == environment_of(services["relay"])["OUTBOX_DATABASE_URL"]
    assert len(env[dashboard_cli.SECRET_ENV]) >= MIN_SECRET_CHARS
    assert "${" + dashboard_cli.SECRET_ENV + ":-" in environment_of(service)[dashboard_cli.SECRET_ENV], (
        "the secret can be set from the environment without editing the file"
    )
    # The users file is mounted read-only from this repository, and parses.
    mounts = {v.split(":")[1]: v.split(":") for v in service["volumes"]}
    source, _, mode = mounts[env[dashboard_cli.USERS_ENV]]
    assert mode == "ro" and (ROOT / source).is_file(), source
    users = parse_users((ROOT / source).read_text(), source=source)
    # The sign-in the compose file's header and docs/production.md give.
    assert users["admin"].role == "operate" and verify_password("admin", users["admin"].password_hash)
    assert "admin / admin" in COMPOSE.read_text()
