"""A ``@then`` function sees one truth (issue 29, item 5): on every path that settles a step
``sent`` (the worker's record, the reconciler's lookup, ``outbox resolve --sent``, ``outbox
repair``, the reconciler's ``chains`` job, the dashboard's resolve) it is given
``Confirmed(ref, response=...)`` with the response exactly as the row stores it (sanitised by
outbox.sanitize), or None when none is stored. This file is the handler module those paths
import (MODULE); its handlers are declared per test. Real PostgreSQL and the provider
simulator on 127.0.0.1."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest
from helpers import elapse, sql
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

import outbox
from outbox import chains
from outbox.cli import main
from outbox.consumer import DeliveryResult
from outbox.dashboard import create_app, hash_password
from outbox.handlers import registry
from outbox.reconciler.jobs.chains import write_uncomputed
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import libpq_url
from outbox.settlement import LookupClients

MODULE = __name__
KEY = "order:5"
#: What the provider's answer carries beyond its reference: a card number and a key, which the
#: stored summary masks, and a float that PostgreSQL's jsonb gives back as an integer.
EXTRA = {"card": "4111 1111 1111 1111", "api_key": "sk_live_0123456789abcdef", "big": 1e300}

#: (row id, ref, response) for every call of the then-function.
SEEN: list[tuple[int, str, Any]] = []


def declare(provider: Any, **options: Any) -> outbox.Handler:
    """payments.charge (its answer and its lookup's both carry EXTRA) -> accounting.export."""

    @outbox.handler("payments.charge", **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response={**r.json(), **EXTRA})

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        r = d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response={"id": r.json()["id"], "found": True, **EXTRA})

    @charge.then
    def export(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        SEEN.append((d.id, c.ref, c.response))
        return [outbox.Next("export", "accounting.export", {"charge": c.ref})]

    @outbox.handler("accounting.export", time_limit=2)
    def post(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref="x")

    return charge


@pytest.fixture(autouse=True)
def _seen() -> Any:
    SEEN.clear()
    yield
    SEEN.clear()


def write_charge(engine: Any, key: str = KEY) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination="payments.charge", payload={"amount_cents": 1200}
        ).id


def stored(services: Any, row_id: int) -> tuple[str, str | None, Any]:
    [row] = sql(services, "SELECT state, provider_ref, response FROM outbox_message WHERE id = %s", (row_id,))
    return row


def export_written(services: Any, row_id: int) -> bool:
    return bool(
        sql(services, "SELECT 1 FROM outbox_message WHERE parent_id = %s AND step = 'export'", (row_id,))
    )


def assert_then_saw_the_stored_row(services: Any, row_id: int) -> Any:
    state, ref, response = stored(services, row_id)
    assert state == "sent"
    assert SEEN == [(row_id, ref, response)]
    assert export_written(services, row_id)
    return response


def assert_sanitised(response: Any) -> None:
    assert response["card"] != EXTRA["card"] and response["api_key"] == "***"


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def unknown_charge(services: Any, engine: Any, provider: Any, consumer: Any, key: str = KEY) -> int:
    """A charge the provider made whose answer was lost: unknown, and no call of it still landing."""
    provider.configure(fault_keys={f"{key}:charge": "drop_after"})
    row_id = write_charge(engine, key)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.UNKNOWN
    elapse(services, 60, [row_id])
    return row_id


def test_the_worker_gives_then_the_stored_response(clean, engine, provider, consumer):
    declare(provider)
    row_id = write_charge(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.SENT
    response = assert_then_saw_the_stored_row(clean, row_id)
    assert_sanitised(response)


def test_the_reconcilers_lookup_gives_then_the_stored_response(clean, engine, provider, consumer):
    declare(provider)
    row_id = unknown_charge(clean, engine, provider, consumer)
    clients = LookupClients()
    try:
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
            assert resolve_unknown(conn, registry(), module=MODULE, clients=clients).get("sent") == 1
    finally:
        clients.close()
    response = assert_then_saw_the_stored_row(clean, row_id)
    assert response["found"] is True
    assert_sanitised(response)


def test_resolve_sent_gives_then_no_response_unless_one_is_given(clean, engine, provider, consumer, capsys):
    declare(provider)
    row_id = unknown_charge(clean, engine, provider, consumer)
    code, _, err = cli(clean, capsys, "resolve", MODULE, str(row_id), "--sent", "ch_by_hand")
    assert code == 0, err
    assert assert_then_saw_the_stored_row(clean, row_id) is None


def test_resolve_sent_with_a_response_stores_it_sanitised_and_gives_then_that(
    clean, engine, provider, consumer, capsys
):
    declare(provider)
    row_id = unknown_charge(clean, engine, provider, consumer)
    for bad, why in (
        ("[1, 2]", "a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"amount": NaN}', "not valid JSON"),
        # What a strict JSON parser reads as infinity, and nesting past Python's parser.
        ('{"amount": 1e400}', "not valid JSON"),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
    ):
        code, _, err = cli(clean, capsys, "resolve", MODULE, str(row_id), "--sent", "ch_1", "--response", bad)
        assert code == 2 and "--response" in err and why in err, err
    code, _, err = cli(clean, capsys, "resolve", str(row_id), "--not-sent", "--response", '{"a": 1}')
    assert code == 2 and "--response goes with --sent" in err
    assert stored(clean, row_id)[0] == "unknown" and SEEN == []

    given = {"id": "ch_seen_in_ui", "status": "succeeded", **EXTRA}
    code, out, err = cli(
        clean,
        capsys,
        "resolve",
        MODULE,
        str(row_id),
        "--sent",
        "ch_seen_in_ui",
        "--response",
        json.dumps(given),
        "--json",
    )
    assert code == 0, err
    response = assert_then_saw_the_stored_row(clean, row_id)
    assert response["status"] == "succeeded"
    assert_sanitised(response)
    assert "sk_live" not in out


def test_the_chains_job_and_repair_after_a_resolve_without_module_give_then_the_stored_response(
    clean, engine, provider, consumer, capsys
):
    declare(provider)
    first = unknown_charge(clean, engine, provider, consumer)
    code, _, err = cli(clean, capsys, "resolve", str(first), "--sent", "ch_a", "--response", '{"id": "ch_a"}')
    assert code == 0, err
    assert stored(clean, first)[2] == {"id": "ch_a"} and SEEN == []
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert write_uncomputed(conn, registry(), module=MODULE) == {"followed": 1, "steps": 1}
    assert SEEN == [(first, "ch_a", {"id": "ch_a"})]


def test_repair_gives_then_the_stored_response_on_each_of_its_paths(
    clean, engine, provider, consumer, capsys
):
    declare(provider)
    # An unknown step the lookup finds (the reconciler's path, run by repair).
    row_id = unknown_charge(clean, engine, provider, consumer)
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes", "--reason", "INC-1")
    assert code == 0, err
    assert_sanitised(assert_then_saw_the_stored_row(clean, row_id))

    # A confirmed step whose next steps were not computed (resolved without the module).
    SEEN.clear()
    row_id = unknown_charge(clean, engine, provider, consumer, "order:6")
    code, _, err = cli(
        clean, capsys, "resolve", str(row_id), "--sent", "ch_b", "--response", json.dumps(EXTRA)
    )
    assert code == 0, err
    assert stored(clean, row_id)[2]["api_key"] == "***"
    code, _, err = cli(clean, capsys, "repair", MODULE, "order:6", "--yes", "--reason", "INC-2")
    assert code == 0, err
    assert_sanitised(assert_then_saw_the_stored_row(clean, row_id))


def test_repair_of_an_ambiguous_failure_gives_then_the_stored_response(
    clean, engine, provider, consumer, capsys
):
    # An idempotent destination out of attempts fails a call whose answer was lost; repair asks
    # the provider, which has it: failed -> sent.
    declare(provider, idempotent=True, max_attempts=1)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    row_id = write_charge(engine)
    assert consumer().deliver(row_id, "payments.charge") is DeliveryResult.FAILED
    elapse(clean, 60, [row_id])
    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes", "--reason", "INC-3")
    assert code == 0 and "failed -> sent" in out, out + err
    response = assert_then_saw_the_stored_row(clean, row_id)
    assert response["found"] is True
    assert_sanitised(response)


def test_the_dashboards_resolve_gives_then_no_response(clean, engine, provider, consumer):
    declare(provider)
    row_id = unknown_charge(clean, engine, provider, consumer)
    app = create_app(
        engine=engine,
        secret="s" * 40,
        users=f"olga operate {hash_password('pw')}",
        database_url=clean.database_url,
        handlers=registry(),
        module=MODULE,
    )
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)

    def token(html: str) -> str:
        found = re.search(r'name="csrf_token" value="([^"]+)"', html)
        assert found
        return found.group(1)

    r = client.post(
        "/login", data={"user": "olga", "password": "pw", "csrf_token": token(client.get("/login").text)}
    )
    assert r.status_code == 303
    page = client.get(f"/rows/{row_id}").text
    version = re.search(r'name="version" value="([^"]+)"', page)
    assert version
    form = {"how": "sent", "ref": "ch_ui", "reason": "seen in the provider's UI", "version": version.group(1)}
    r = client.post(f"/rows/{row_id}/resolve", data={**form, "csrf_token": token(page)})
    assert r.status_code == 200, r.text
    assert assert_then_saw_the_stored_row(clean, row_id) is None


def test_the_given_response_is_what_the_database_gives_back(clean):
    # jsonb keeps numbers as decimals: a float written as 1e+300 reads back as an integer. The
    # stored form is what a then-function gets, so the two must be equal, whatever was sent.
    from outbox import sanitize

    answers = [
        {"big": 1e300, "max": 1.7976931348623157e308, "neg": -2.5e17, "small": 1.5e-7, "n": 12.5},
        {"nested": [{"x": 1e16}, 3.0, -0.0], "card": 4111111111111111.0},
    ]
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        for answer in answers:
            given = chains.as_stored(outbox.Confirmed("ch_1", answer)).response
            back = conn.execute("SELECT CAST(%s AS jsonb)", (sanitize.encode_response(answer),)).fetchone()
            assert back is not None and given == back[0]
            assert json.dumps(given, sort_keys=True) == json.dumps(back[0], sort_keys=True)


def _nested(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    _nested,
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=st.dictionaries(st.text(max_size=8), _JSON, max_size=5))
def test_any_answer_given_to_then_equals_the_stored_one(clean, answer):
    from outbox import sanitize

    given = chains.as_stored(outbox.Confirmed("ch_1", answer)).response
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        back = conn.execute("SELECT CAST(%s AS jsonb)", (sanitize.encode_response(answer),)).fetchone()
    assert back is not None
    assert json.dumps(given, sort_keys=True) == json.dumps(back[0], sort_keys=True)
