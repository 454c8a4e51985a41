"""``outbox reconcile`` as operators run it: a real subprocess against the test services."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import psycopg
import pytest
import redis
from helpers import elapse
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.alerts import load_alert_hook, log_alert
from outbox.exceptions import ConfigError
from outbox.settings import libpq_url
from outbox.testing.embedded import embedded_redis

MODULE = "examples.shop.handlers"
DEST = "payments.charge"

HOOK_MODULE = """
import dataclasses, json, os

def record(row):
    with open(os.environ["RECONCILE_HOOK_FILE"], "a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(row)) + "\\n")
"""


def outbox_cmd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def write_rows(engine: Any, n: int) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s,
                key=f"order:{i}",
                step="charge",
                destination=DEST,
                payload={"amount_cents": 1000, "currency": "EUR", "card_number": "4242424242424242"},
            ).id
            for i in range(n)
        ]


def charge_at_provider(provider: Any, key: str) -> str:
    with httpx.Client() as client:
        r = client.post(f"{provider.url}/charges", json={"amount_cents": 1}, headers={"Idempotency-Key": key})
        r.raise_for_status()
        return str(r.json()["id"])


def state_of(services: Any, row_id: int) -> tuple[str, str | None]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        found = conn.execute(
            "SELECT state, provider_ref FROM outbox_message WHERE id = %s", (row_id,)
        ).fetchone()
    assert found is not None
    return found[0], found[1]


def test_reconcile_once_resolves_alerts_prints_counts_and_exits_0(clean, engine, provider, tmp_path):
    unknown_id, failed_id = write_rows(engine, 2)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        claimed = store.delivery.claim(db, row_id=unknown_id, destination=DEST, lease_seconds=30)
        assert claimed is not None
        store.delivery.record(db, row_id=unknown_id, token=claimed.token, state="unknown", outcome="unknown")
        claimed = store.delivery.claim(db, row_id=failed_id, destination=DEST, lease_seconds=30)
        assert claimed is not None
        assert store.delivery.record(
            db, row_id=failed_id, token=claimed.token, state="failed", outcome="failed", error="card declined"
        ).state
    ref = charge_at_provider(provider, "order:0:charge")
    (tmp_path / "reconcile_hook.py").write_text(HOOK_MODULE)
    alerts_file = tmp_path / "alerts.jsonl"
    env = clean.env(
        SHOP_PROVIDER_URL=provider.url,
        OUTBOX_ALERT_HOOK="reconcile_hook:record",
        RECONCILE_HOOK_FILE=str(alerts_file),
    )
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])

    done = outbox_cmd("reconcile", MODULE, "--once", env=env)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "expire_leases",
        "resolve_unknown",
        "redispatch",
        "purge",
        "alerts",
        "no_consumer",
        "held_destinations",
        "chains",
        "batches",
    ]
    assert "resolve_unknown: sent=1" in lines
    assert "alerts: alerts=1" in lines
    assert state_of(clean, unknown_id) == ("sent", ref)
    alerts = [json.loads(line) for line in alerts_file.read_text().splitlines()]
    # The handler's error text may echo the payload: an alert says the outbox's words and where
    # to read the rest.
    assert [(a["id"], a["key"], a["step"], a["state"], a["reason"]) for a in alerts] == [
        (
            failed_id,
            "order:1",
            "charge",
            "failed",
            "failed after 1 attempt(s), last attempt failed; its error text is withheld from alerts"
            f" (it may echo the payload): outbox show {failed_id}",
        )
    ]
    assert "card declined" not in alerts_file.read_text()
    assert "4242" not in alerts_file.read_text()
    assert provider.stats()["charges"] == 1


@pytest.mark.parametrize("variable", ["OUTBOX_DATABASE_URL", "OUTBOX_REDIS_URL"])
def test_reconcile_without_a_service_url_says_which_variable_and_exits_2(services, variable):
    env = services.env()
    env.pop(variable)

    done = outbox_cmd("reconcile", MODULE, "--once", env=env)

    assert done.returncode == 2
    assert done.stdout == ""
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and variable in errors[0], done.stderr


def test_reconcile_rejects_a_bad_interval_and_a_bad_alert_hook(services):
    bad_interval = outbox_cmd("reconcile", MODULE, "--interval", "soon", env=services.env())
    assert bad_interval.returncode == 2 and "--interval" in bad_interval.stderr
    bad_hook = outbox_cmd("reconcile", MODULE, "--once", "--alert-hook", "nocolon", env=services.env())
    assert bad_hook.returncode == 2 and "package.module:function" in bad_hook.stderr


def test_alert_hook_spec_loading():
    assert load_alert_hook(None) is log_alert
    assert load_alert_hook("json:dumps") is json.dumps
    for spec in ("json", "no_such_module_here:x", "json:no_such_function", "json:__doc__"):
        with pytest.raises(ConfigError):
            load_alert_hook(spec)


def test_reconcile_help_explains_itself(services):
    done = outbox_cmd("reconcile", "--help", env=services.env())
    assert done.returncode == 0
    for word in (
        "MODULE",
        "--interval",
        "--once",
        "--alert-hook",
        "expire_leases",
        "resolve_unknown",
        "redispatch",
        "purge",
        "alerts",
        "OUTBOX_ALERT_HOOK",
        "advisory lock",
    ):
        assert word in done.stdout, word


@pytest.mark.stress
def test_reconcile_loop_resolves_rows_and_stops_cleanly_on_sigterm(clean, engine, provider, tmp_path):
    (row_id,) = write_rows(engine, 1)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        # The worker charged, then died before recording: its lease has run out.
        assert store.delivery.claim(db, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        elapse(db, 31, [row_id])
    ref = charge_at_provider(provider, "order:0:charge")
    log = tmp_path / "reconcile.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "reconcile", MODULE, "--interval", "0.2"],
            env=clean.env(SHOP_PROVIDER_URL=provider.url),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while state_of(clean, row_id)[0] != "sent" and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert state_of(clean, row_id) == ("sent", ref), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "job=expire_leases" in text and "expired=1" in text
    assert "job=resolve_unknown" in text and "sent=1" in text
    assert "reconciler stopped" in text


def test_reconcile_refuses_an_evicting_redis_unless_allowed(clean, tmp_path):
    with embedded_redis(str(tmp_path)) as url:
        client = redis.Redis.from_url(url)
        try:
            client.config_set("maxmemory", "10mb")
            client.config_set("maxmemory-policy", "allkeys-lru")
            refused = outbox_cmd(
                "reconcile", "examples.shop.handlers", "--once", env=clean.env(OUTBOX_REDIS_URL=url)
            )
            assert refused.returncode == 1, refused.stderr
            lines = [line for line in refused.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "maxmemory-policy" in lines[0], refused.stderr

            allowed = outbox_cmd(
                "reconcile",
                "examples.shop.handlers",
                "--once",
                env=clean.env(OUTBOX_REDIS_URL=url, OUTBOX_ALLOW_EVICTING_REDIS="true"),
            )
            assert allowed.returncode == 0, allowed.stderr
        finally:
            client.close()
