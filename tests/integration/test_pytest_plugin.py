"""The pytest plugin, as a user runs it: a project of their own (conftest with one line, a handler
module, tests) run by pytest in a subprocess, against a real PostgreSQL and the provider simulator.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = 'pytest_plugins = ["outbox.testing.pytest_plugin"]\n'

HANDLERS = """
import os

import outbox
from outbox import Confirmed, Delivery, PermanentError


def url() -> str:
    return os.environ["PROVIDER_URL"]


@outbox.handler("payments.charge", time_limit=5, lease_seconds=10, max_attempts=3, backoff=(1,))
def charge(d: Delivery) -> Confirmed:
    r = d.http.post(f"{url()}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
    if r.status_code == 402:
        raise PermanentError("card declined")
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"])


@charge.lookup
def find(d: Delivery) -> Confirmed | None:
    r = d.http.get(f"{url()}/charges", params={"idempotency_key": d.idempotency_key})
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"])
"""

TESTS = """
import importlib

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import outbox
from outbox.settings import normalize_database_url
from outbox.testing.delivery import crash_after_call, deliver, pass_time, reconcile_once

import shop_handlers


@pytest.fixture
def handlers(outbox_database_url, outbox_provider, monkeypatch):
    monkeypatch.setenv("PROVIDER_URL", outbox_provider.url)
    importlib.reload(shop_handlers)  # declared again: the fixture cleared the registry
    return shop_handlers


def place_order(url, order_id, amount=1200):
    engine = create_engine(normalize_database_url(url))
    with Session(engine) as s, s.begin():
        outbox.write(s, key=f"order:{order_id}", step="charge", destination="payments.charge",
                     payload={"amount_cents": amount})
    engine.dispose()


def test_written(outbox_database_url, outbox_written):
    place_order(outbox_database_url, 1)
    outbox_written.assert_written("order:1", "charge", destination="payments.charge",
                                  payload={"amount_cents": 1200})


def test_written_differs(outbox_database_url, outbox_written):
    place_order(outbox_database_url, 2, amount=999)
    outbox_written.assert_written("order:2", "charge", payload={"amount_cents": 1200})


def test_delivered_once(outbox_database_url, outbox_provider, handlers):
    place_order(outbox_database_url, 3)
    results = deliver(handlers, database_url=outbox_database_url)
    assert [str(r) for r in results.values()] == ["sent"]
    assert outbox_provider.stats()["charges"] == 1


def test_declined_fails_with_reason(outbox_database_url, outbox_provider, outbox_written, handlers):
    place_order(outbox_database_url, 4, amount=-1)  # the simulator declines a negative amount
    deliver(handlers, database_url=outbox_database_url)
    [row] = outbox_written()
    assert row["state"] == "failed" and "card declined" in row["last_error"]


def test_crash_after_call_charges_once(outbox_database_url, outbox_provider, outbox_written, handlers):
    place_order(outbox_database_url, 5)
    assert len(crash_after_call(handlers, database_url=outbox_database_url)) == 1
    assert outbox_written()[0]["state"] == "in_flight"
    pass_time(11, database_url=outbox_database_url)  # the lease (10 s) runs out
    reconcile_once(handlers, database_url=outbox_database_url)
    pass_time(6, database_url=outbox_database_url)  # the first lookup waits one time_limit
    reconcile_once(handlers, database_url=outbox_database_url)
    deliver(handlers, database_url=outbox_database_url)
    [row] = outbox_written()
    assert row["state"] == "sent"
    assert outbox_provider.stats()["charges"] == 1
"""


def test_a_user_project_tests_its_outbox_code_with_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "shop_handlers.py").write_text(textwrap.dedent(HANDLERS))
    (tmp_path / "test_shop.py").write_text(textwrap.dedent(TESTS))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k == "OUTBOX_TEST_DATABASE_URL"
    }
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",
            "-W",
            "error",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    # Every test passes but the one whose payload differs, which fails with a readable diff.
    assert "1 failed, 4 passed" in out, out
    assert "test_written_differs" in out
    assert "outbox row ('order:2', 'charge') differs:" in out
    assert "payload: expected {'amount_cents': 1200}" in out and "written  {'amount_cents': 999}" in out
