"""docker-compose.yml's services, run as the file says but outside containers (no engine runs
here): each command with its environment, the addresses swapped for this machine's test servers
and free ports. The healthchecks the file declares must pass (the shop's only once it places
orders), the pipeline must deliver, and the dashboard signs in the user the file names. And
`outbox migrate --wait`, the compose file's answer to a database that is still starting."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port, wait_for

from .support import OwnedPostgres, states

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
COMPOSE_METRICS_PORT = "9400"
COMPOSE_PROVIDER_PORT = "8099"
COMPOSE_DASHBOARD_PORT = "8090"


def command_of(name: str) -> list[str]:
    return [str(c) for c in COMPOSE[name]["command"]]


def healthcheck_of(name: str) -> list[str]:
    test = [str(t) for t in COMPOSE[name]["healthcheck"]["test"]]
    assert test[0] == "CMD", f"{name}: only exec-form healthchecks are run here"
    return test[1:]


def run_argv(argv: list[str]) -> list[str]:
    # `outbox …` and `python …` as the image runs them, with this interpreter.
    if argv[0] == "outbox":
        return [sys.executable, "-m", "outbox", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


@pytest.fixture
def started(tmp_path):
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(run_argv(argv), env=env, stdout=log, stderr=subprocess.STDOUT))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_the_services_start_as_composed_and_their_healthchecks_pass(clean, started, tmp_path):
    provider_port = str(free_port())
    provider_cmd = [
        {"0.0.0.0": "127.0.0.1", COMPOSE_PROVIDER_PORT: provider_port}.get(c, c)
        for c in command_of("provider")
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base["PYTHONPATH"] = str(ROOT)
    started(provider_cmd, base, "provider")
    provider_check = [c.replace(COMPOSE_PROVIDER_PORT, provider_port) for c in healthcheck_of("provider")]
    wait_for(lambda: subprocess.run(run_argv(provider_check), env=base).returncode == 0, 30, "the provider")

    def env_of(name: str, **extra: str) -> dict[str, str]:
        env = {**base, **{str(k): str(v) for k, v in (COMPOSE[name].get("environment") or {}).items()}}
        env.update(
            OUTBOX_DATABASE_URL=clean.database_url,
            OUTBOX_REDIS_URL=clean.redis_url,
            OUTBOX_NAMESPACE=clean.namespace,
            **extra,
        )
        if "SHOP_PROVIDER_URL" in env:
            assert env["SHOP_PROVIDER_URL"] == f"http://provider:{COMPOSE_PROVIDER_PORT}"
            env["SHOP_PROVIDER_URL"] = f"http://127.0.0.1:{provider_port}"
        return env

    migrate = subprocess.run(
        run_argv(command_of("migrate")), env=env_of("migrate"), capture_output=True, timeout=120
    )
    assert migrate.returncode == 0, migrate.stderr

    checks: dict[str, list[str]] = {}
    for name in ("relay", "worker", "reconciler"):
        assert env_of(name)["OUTBOX_METRICS_PORT"] == COMPOSE_METRICS_PORT
        port = str(free_port())
        started(command_of(name), env_of(name, OUTBOX_METRICS_PORT=port), name)
        checks[name] = [c.replace(f":{COMPOSE_METRICS_PORT}/", f":{port}/") for c in healthcheck_of(name)]
    for name, check in checks.items():

        def passes(check: list[str] = check) -> bool:
            return subprocess.run(run_argv(check), env=base, capture_output=True).returncode == 0

        wait_for(passes, 60, f"{name}'s healthcheck (log: {tmp_path / name}.log)", every=0.5)

    def shop_healthy() -> bool:
        return (
            subprocess.run(
                run_argv(healthcheck_of("shop")), env=env_of("shop"), capture_output=True
            ).returncode
            == 0
        )

    # Healthy means placing orders: not before the shop has placed one.
    assert not shop_healthy()
    started(command_of("shop"), env_of("shop"), "shop")
    wait_for(lambda: states(clean).get("sent", 0) >= 3, 60, "the shop's orders to be charged", every=0.5)
    wait_for(shop_healthy, 30, f"the shop's healthcheck (log: {tmp_path / 'shop'}.log)", every=0.5)

    # The dashboard, its users file where the compose file mounts it from, its secret the
    # file's default; plain HTTP, as published.
    dashboard_port = str(free_port())
    dashboard_cmd = [
        {"0.0.0.0": "127.0.0.1", COMPOSE_DASHBOARD_PORT: dashboard_port}.get(c, c)
        for c in command_of("dashboard")
    ]
    assert dashboard_cmd != command_of("dashboard")
    mounts = {v.split(":")[1]: str(ROOT / v.split(":")[0]) for v in COMPOSE["dashboard"]["volumes"]}
    dashboard_env = env_of("dashboard")
    dashboard_env["OUTBOX_DASHBOARD_USERS"] = mounts[dashboard_env["OUTBOX_DASHBOARD_USERS"]]
    dashboard_env["OUTBOX_DASHBOARD_SECRET"] = re.sub(
        r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", dashboard_env["OUTBOX_DASHBOARD_SECRET"]
    )
    started(dashboard_cmd, dashboard_env, "dashboard")
    dashboard_check = [
        c.replace(f":{COMPOSE_DASHBOARD_PORT}/", f":{dashboard_port}/") for c in healthcheck_of("dashboard")
    ]
    wait_for(
        lambda: subprocess.run(run_argv(dashboard_check), env=base, capture_output=True).returncode == 0,
        60,
        f"the dashboard's healthcheck (log: {tmp_path / 'dashboard'}.log)",
        every=0.5,
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{dashboard_port}", follow_redirects=False) as browser:
        page = browser.get("/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert page.status_code == 200 and token
        signed_in = browser.post(
            "/login", data={"user": "admin", "password": "admin", "csrf_token": token[1]}
        )
        assert signed_in.status_code == 303, signed_in.text
        overview = browser.get("/")
        # The shop's charges, seen through the dashboard's session.
        assert overview.status_code == 200 and "payments.charge" in overview.text


def test_migrate_waits_for_a_database_that_is_still_starting(tmp_path):
    pg = OwnedPostgres()
    try:
        pg.stop("fast")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_DATABASE_URL"] = pg.url
        # Without --wait: fails at once, as before.
        at_once = subprocess.run(
            [sys.executable, "-m", "outbox", "migrate"], env=env, capture_output=True, text=True, timeout=60
        )
        assert at_once.returncode == 3 and "cannot reach PostgreSQL" in at_once.stderr
        started_at = time.monotonic()
        waiting = subprocess.Popen(
            [sys.executable, "-m", "outbox", "migrate", "--wait", "60s"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(2)
        assert waiting.poll() is None, "migrate --wait gave up while the database was down"
        pg.start()
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert "migrated from empty" in out and "waiting up to 60 s" in err
        assert time.monotonic() - started_at < 60
    finally:
        pg.close()
