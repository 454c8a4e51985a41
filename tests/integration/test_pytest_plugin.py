"""The pytest plugin, as a user runs it: a project of their own (conftest with one line, a handler
module, tests) run by pytest in a subprocess, against a real PostgreSQL and the provider simulator.
What docs/testing.md shows runs in tests/integration/test_docs.py; this covers the rest: the
diff, handlers declared in tests, other destinations, a crash of one row, no lookup.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from helpers import run_user_project

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
import pytest
from sqlalchemy.orm import Session

import outbox
from outbox import Confirmed
from outbox.testing.delivery import crash_after_call, deliver, recover

import shop_handlers


@pytest.fixture
def provider(outbox_provider, monkeypatch):
    monkeypatch.setenv("PROVIDER_URL", outbox_provider.url)
    return outbox_provider


def charge_without_lookup(provider, destination, **options):
    @outbox.handler(destination, time_limit=5, **options)
    def charge(d):
        r = d.http.post(provider.url + "/charges", json=d.payload,
                        headers={"Idempotency-Key": d.idempotency_key})
        r.raise_for_status()
        return Confirmed(ref=r.json()["id"])

    return charge


def write(engine, key, destination="payments.charge", amount=1200, **more):
    with Session(engine) as s, s.begin():
        outbox.write(s, key=key, step="charge", destination=destination,
                     payload={"amount_cents": amount, **more})


def test_written(outbox_engine, outbox_written):
    write(outbox_engine, "order:1")
    outbox_written.assert_written("order:1", "charge", destination="payments.charge",
                                  payload={"amount_cents": 1200})


def test_written_differs(outbox_engine, outbox_written):
    write(outbox_engine, "order:42", amount=999, currency="eur")
    outbox_written.assert_written("order:42", "charge", payload={"amount_cents": 1200, "currency": "eur"})


def test_a_handler_declared_in_a_test(outbox_engine, outbox_database_url, provider):
    @outbox.handler("mail.send", time_limit=5)
    def send(d):
        return Confirmed(ref="m1")

    write(outbox_engine, "user:1", destination="mail.send")
    assert deliver({"mail.send": send}, database_url=outbox_database_url) == {1: "sent"}


def test_is_forgotten_after_it(outbox_engine, outbox_database_url):
    # Another function for the same destination: refused if the last test's were still declared.
    @outbox.handler("mail.send", time_limit=5)
    def other(d):
        return Confirmed(ref="m2")

    assert "payments.charge" in outbox.handlers.registry()  # the module's handlers stay


def test_other_destinations_are_left_alone(outbox_engine, outbox_database_url, outbox_written, provider):
    write(outbox_engine, "user:1", destination="mail.send")
    write(outbox_engine, "order:3")
    assert deliver(shop_handlers, database_url=outbox_database_url) == {2: "sent"}
    assert [r["state"] for r in outbox_written()] == ["pending", "sent"]


def test_a_crash_of_one_row(outbox_engine, outbox_database_url, outbox_written, provider):
    write(outbox_engine, "order:4")
    write(outbox_engine, "order:5")
    assert crash_after_call(shop_handlers, database_url=outbox_database_url, ids=[2]) == [2]
    assert deliver(shop_handlers, database_url=outbox_database_url) == {1: "sent"}
    assert [r["state"] for r in outbox_written()] == ["sent", "in_flight"]
    assert recover(shop_handlers, database_url=outbox_database_url) == {1: "sent", 2: "sent"}
    assert provider.charges() == 2 and provider.stats()["double_charged"] == []


def test_without_a_lookup_a_lost_answer_stays_unknown(outbox_engine, outbox_database_url, provider):
    refund = charge_without_lookup(provider, "payments.refund", lease_seconds=10)
    provider.drop_after_charge(times=1)
    write(outbox_engine, "order:6", destination="payments.refund")
    assert recover({"payments.refund": refund}, database_url=outbox_database_url) == {1: "unknown"}
    assert provider.charges() == 1


def test_a_module_without_handlers_is_refused(outbox_database_url):
    with pytest.raises(outbox.ConfigError, match="declares no @outbox.handler"):
        deliver("json", database_url=outbox_database_url)
    with pytest.raises(outbox.ConfigError, match="map each destination"):
        deliver({}, database_url=outbox_database_url)
    with pytest.raises(outbox.ConfigError, match="map each destination"):
        deliver({"payments.refund": shop_handlers.charge}, database_url=outbox_database_url)
    with pytest.raises(TypeError, match="a handler module"):
        deliver([shop_handlers.charge], database_url=outbox_database_url)


def test_recover_waits_out_a_long_backoff(outbox_engine, provider):
    slow = charge_without_lookup(provider, "payments.slow", backoff=(3600,))
    provider.unavailable(times=1)
    write(outbox_engine, "order:7", destination="payments.slow")
    assert deliver({"payments.slow": slow}, database_url=outbox_engine) == {1: "pending"}
    assert recover({"payments.slow": slow}, database_url=outbox_engine) == {1: "sent"}
    assert provider.charges() == 1


def test_reconciling_one_module_leaves_other_rows_alone(outbox_engine, outbox_written, provider):
    @outbox.handler("mail.send", time_limit=5, lease_seconds=10)
    def send(d):
        return Confirmed(ref="m1")

    write(outbox_engine, "user:1", destination="mail.send")
    write(outbox_engine, "order:8")
    assert crash_after_call({"mail.send": send}, database_url=outbox_engine) == [1]
    assert recover(shop_handlers, database_url=outbox_engine) == {2: "sent"}
    assert [r["state"] for r in outbox_written()] == ["in_flight", "sent"]
"""


def test_a_user_project_tests_its_outbox_code_with_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "shop_handlers.py").write_text(textwrap.dedent(HANDLERS))
    (tmp_path / "test_shop.py").write_text(textwrap.dedent(TESTS))
    # No OUTBOX_TEST_DATABASE_URL: the plugin starts its embedded PostgreSQL (docs/testing.md's
    # project, run by tests/integration/test_docs.py, covers a server named by the variable).
    _, out = run_user_project(tmp_path)
    # Every test passes but the one whose payload differs, which fails with a readable diff.
    assert "1 failed, 9 passed" in out, out
    assert "test_written_differs" in out
    # The diff docs/testing.md shows is the one a user gets.
    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    shown = page.split("```text\nAssertionError: ", 1)[1].split("```", 1)[0]
    for line in shown.splitlines():
        assert line in out, f"docs/testing.md shows {line!r}; the plugin printed:\n{out}"
