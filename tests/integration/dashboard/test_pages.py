"""What the web dashboard's pages show, through its HTTP interface: the row page renders every
shape of history the code writes (lookups, replays, resolves, cancels, skips, repairs); the
overview lists each in-flight limit that holds; an ``AsyncEngine`` (the quickstart's FastAPI
app) is served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import elapse, lookup_on, relay_once, sql
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.testclient import TestClient

import outbox
from outbox import chains, store
from outbox.consumer import DeliveryResult
from outbox.dashboard import Access, create_app
from outbox.ops import actions
from outbox.settings import libpq_url, normalize_database_url

from .support import (
    DEST,
    SECRET,
    login,
    write,
)


def test_the_overview_lists_an_in_flight_limit(app: Starlette, engine: Any, clean: Any) -> None:
    write(engine, "order:1")
    with engine.begin() as c:
        outbox.limits.set_limit(c, DEST, in_flight=4, by="otto", reason="provider allows 4")
    client = login(app, "rita")
    page = client.get("/").text
    assert f"limited: {DEST}: at most 4 calls in flight" in page and "provider allows 4" in page


TIME_LIMIT = 2

#: The host's users (authorize=): the login's own tests are elsewhere.
ROLES = {"olga": ("operate", False), "rita": ("read", False), "pam": ("read", True)}


def authorize(request: Request) -> Access | None:
    name = request.headers.get("x-user", "")
    if name not in ROLES:
        return None
    role, payloads = ROLES[name]
    return Access(name, role, payloads)


@pytest.fixture
def app_hosted(clean: Any, engine: Any) -> Starlette:
    return create_app(engine=engine, secret=SECRET, authorize=authorize)


def client_for_hosted(app: Any, user: str) -> TestClient:
    c = TestClient(app, base_url="https://testserver", follow_redirects=False, raise_server_exceptions=False)
    c.headers["x-user"] = user
    return c


def declare(provider: Any) -> outbox.Handler:
    @outbox.handler(DEST, time_limit=TIME_LIMIT, backoff=(30,), max_attempts=3)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return lookup_on(charge, provider, keep_response=True)


def write_hosted(engine: Any, key: str, **options: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=DEST, payload={"amount_cents": 500}, **options
        ).id


def connect(clean: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(clean.database_url), autocommit=True)


def claim_and_record(clean: Any, row: int, state: str, outcome: str, **kw: Any) -> None:
    """A consumer's claim and its recorded outcome (the consumer's own statements)."""
    with connect(clean) as db:
        claimed = store.delivery.claim(db, row_id=row, destination=DEST, lease_seconds=30)
        assert claimed is not None
        assert store.delivery.record(
            db, row_id=row, token=claimed.token, state=state, outcome=outcome, **kw
        ).state


def history(clean: Any, row: int) -> list[dict[str, Any]]:
    return list(sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))[0][0])


def _unknown(clean: Any, engine: Any, key: str) -> int:
    row = write_hosted(engine, key)
    claim_and_record(clean, row, "unknown", "unknown", error="ReadTimeout")
    return row


def _lookup(clean: Any, engine: Any, provider: Any, consumer: Any, *, found: bool) -> int:
    """The reconciler's lookup settles an unknown row: sent (the provider has the charge) or
    pending (it has none)."""
    from outbox.reconciler.jobs.resolve_unknown import resolve_unknown

    handler = declare(provider)
    row = write_hosted(engine, "order:lookup")
    if found:
        relay_once(clean)
        provider.drop_after_charge(times=1)
        assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    else:
        claim_and_record(clean, row, "unknown", "unknown", error="ReadTimeout")
    with connect(clean) as db:
        elapse(db, TIME_LIMIT + 1, [row])
        settled = resolve_unknown(db, {DEST: handler})
    assert settled == ({"sent": 1} if found else {"pending": 1}), settled
    return row


def w_lookup_found(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    return _lookup(clean, engine, provider, consumer, found=True)


def w_lookup_not_found(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    return _lookup(clean, engine, provider, consumer, found=False)


def w_replay(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = write_hosted(engine, "order:replay")
    claim_and_record(clean, row, "failed", "failed", error="card declined", http_status=402)
    with engine.begin() as conn:
        assert actions.replay(conn, [row], by="tester", reason="customer asked")[0].done
    return row


def w_resolve_sent(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = _unknown(clean, engine, "order:resolve-sent")
    with engine.begin() as conn:
        actions.resolve(conn, row, sent_ref="ch_by_hand", by="tester", reason="seen at the provider")
    return row


def w_resolve_not_sent(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = _unknown(clean, engine, "order:resolve-not-sent")
    with engine.begin() as conn:
        actions.resolve(conn, row, not_sent=True, by="tester", reason="not at the provider")
    return row


def w_resolve_failed_then_forced_replay(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = _unknown(clean, engine, "order:forced")
    with engine.begin() as conn:
        actions.resolve(conn, row, failed_reason="refunded by hand", by="tester", reason="refunded by hand")
    with engine.begin() as conn:
        result = actions.replay(conn, [row], by="tester", reason="charge it after all", force=True)
    assert result[0].done, result
    assert history(clean, row)[-1].get("forced") is True
    return row


def w_cancel(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = write_hosted(engine, "order:cancel")
    with engine.begin() as conn:
        actions.cancel_rows(conn, [row], reason="order withdrawn", by="tester")
    return row


def w_skip(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    row = write_hosted(engine, "order:skip", ordering_key="customer:7")
    claim_and_record(clean, row, "failed", "failed", error="card declined")
    with engine.begin() as conn:
        assert actions.skip(conn, row, by="tester", reason="the rest may go").done
    return row


def w_repair_found(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    """``outbox repair``'s statement for a failed row its lookup found."""
    row = write_hosted(engine, "order:repair-found")
    claim_and_record(clean, row, "failed", "failed", error="deadline passed")
    with connect(clean) as db:
        (version,) = (
            db.execute("SELECT completed_at FROM outbox_message WHERE id = %s", (row,)).fetchone() or ()
        )
        assert (
            store.operator.repair_found(
                db,
                row_id=row,
                version=version,
                ref="ch_found",
                response=None,
                follow=chains.Plan(),
                by="tester",
                reason="asked the provider",
            )
            is not None
        )
    return row


def w_repair_note(clean: Any, engine: Any, provider: Any, consumer: Any) -> int:
    """``outbox repair``'s line for a lookup it asked or next steps it wrote (its own keys)."""
    row = write_hosted(engine, "order:repair-note")
    with connect(clean) as db:
        for extra in (
            {"result": "not_found_past_key_ttl"},
            {"result": "next_steps_written", "written": 0, "problem": None},
        ):
            store.operator.note_history(
                db, row_id=row, by="tester", action="repair", reason=None, extra=json.dumps(extra)
            )
    return row


WRITERS: dict[str, Callable[..., int]] = {
    "lookup found (reconciler)": w_lookup_found,
    "lookup not found (reconciler)": w_lookup_not_found,
    "replay": w_replay,
    "resolve --sent": w_resolve_sent,
    "resolve --not-sent": w_resolve_not_sent,
    "resolve --failed, then replay --force": w_resolve_failed_then_forced_replay,
    "cancel": w_cancel,
    "skip": w_skip,
    "repair found": w_repair_found,
    "repair note": w_repair_note,
}


# Without the guard: a lookup's history entry has no `reason`, read under
# strict undefined: HTTP 500 for every row the reconciler settled through a lookup.
@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
@pytest.mark.parametrize("user", ["olga", "rita"])
def test_the_row_page_renders_every_history_the_code_writes(
    app_hosted: Starlette, clean: Any, engine: Any, provider: Any, consumer: Any, writer: str, user: str
) -> None:
    row = WRITERS[writer](clean, engine, provider, consumer)
    entries = history(clean, row)
    assert entries, "the writer wrote no history"
    page = client_for_hosted(app_hosted, user).get(f"/rows/{row}")
    assert page.status_code == 200, page.text[-2000:]
    listed = page.text.split('<ul class="history">', 1)[1].split("</ul>", 1)[0]
    assert listed.count("<li>") == len(entries)
    for entry in entries:
        assert entry["action"] in listed
        # What the entry says beyond who and when is shown: a lookup's result, the new state.
        for name in ("result", "state", "provider_ref", "to"):
            if entry.get(name):
                assert str(entry[name]) in listed, (name, entry)


def test_a_history_entry_of_any_shape_renders(app_hosted: Starlette, clean: Any, engine: Any) -> None:
    """Entries written by hand (plain SQL) or by an older version: missing keys, odd values."""
    row = write_hosted(engine, "order:odd")
    odd = [
        {},
        {"action": "lookup"},
        {"at": "not a time", "by": None, "reason": ["a", 1]},
        {"at": 7},
        {"note": "x"},
    ]
    sql(clean, "UPDATE outbox_message SET history = %s::jsonb WHERE id = %s", (json.dumps(odd), row))
    page = client_for_hosted(app_hosted, "rita").get(f"/rows/{row}")
    assert page.status_code == 200, page.text[-2000:]


# Without the guard: create_app(engine=<AsyncEngine>) crashed on the first request.
@pytest.mark.parametrize("driver", ["postgresql+psycopg", "postgresql+psycopg_async"])
def test_an_async_engine_is_served(clean: Any, engine: Any, driver: str) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    url = driver + normalize_database_url(clean.database_url)[len("postgresql+psycopg") :]
    async_engine = create_async_engine(url)
    dashboard = create_app(engine=async_engine, secret=SECRET, authorize=authorize)
    try:
        row = write_hosted(engine, "order:async")
        host = Starlette(routes=[Mount("/outbox", dashboard)])
        client = client_for_hosted(host, "olga")
        assert client.get("/outbox/").status_code == 200
        page = client.get(f"/outbox/rows/{row}")
        assert page.status_code == 200 and "order:async" in page.text
    finally:
        dashboard.state.dashboard.c.engine.dispose()  # the pool the dashboard opened for itself
        asyncio.run(async_engine.dispose())
