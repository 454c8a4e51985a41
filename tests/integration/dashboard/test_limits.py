"""The web dashboard against crafted and odd input, through its HTTP interface only: ids past
bigint or of thousands of digits, superscript digits, NUL bytes, bad keyset cursors, huge or
infinite durations, non-ASCII tokens and cookies are a 4xx, never a 500; long filters and odd
cursors still page and preview; long provider references and huge numbers are stored and
rendered; payloads that are not JSON objects (written by plain SQL) render."""

from __future__ import annotations

import logging
import random
import re
from typing import Any

import pytest
from helpers import ids_by_state, relay_once, sql
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.testclient import TestClient

import outbox
from outbox.consumer import DeliveryResult
from outbox.dashboard import Access, create_app
from outbox.dashboard.security import SECURITY_HEADERS

from .support import (
    DEST,
    SECRET,
    client_for,
    login,
    token_of,
    write,
)

HUGE = "9" * 25  # past bigint


def test_row_page_with_an_id_past_bigint_is_404(app: Starlette) -> None:
    r = login(app, "rita").get(f"/rows/{HUGE}")
    assert r.status_code == 404


# Without the guard: /batches/{id} with an id past bigint: DataError, 500
def test_batch_page_with_an_id_past_bigint_is_404(app: Starlette) -> None:
    r = login(app, "rita").get(f"/batches/{HUGE}")
    assert r.status_code == 404


# Without the guard: /batches?before= digits past bigint: CAST AS bigint
# fails, 500
def test_batches_before_past_bigint_is_not_500(app: Starlette) -> None:
    r = login(app, "rita").get("/batches", params={"before": HUGE})
    assert r.status_code in (200, 400)


# Without the guard: a cursor whose value is not a timestamp: CAST AS
# timestamptz fails, 500
def test_rows_cursor_with_a_bad_timestamp_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "after": "not-a-time|1"})
    assert r.status_code == 400


# Without the guard: a cursor whose id is past bigint: DataError is not
# caught, 500
def test_rows_cursor_with_a_huge_id_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"after": f"|{HUGE}"})
    assert r.status_code == 400


def test_rows_cursor_without_an_id_is_400(app: Starlette) -> None:
    client = login(app, "rita")
    for after in ("|", "abc", "x|y"):
        r = client.get("/rows", params={"state": "pending", "after": after})
        assert r.status_code == 400, (after, r.status_code)


# Without the guard: older_than of a huge duration overflows the SQL interval,
# 500
def test_a_huge_duration_filter_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "older_than": "99999999999999d"})
    assert r.status_code in (200, 400)


# Without the guard: older_than of 400 digits parses to float inf: SQL fails, 500
def test_an_infinite_duration_filter_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "older_than": "9" * 400})
    assert r.status_code in (200, 400)


# Without the guard: pause 'for' of a huge duration overflows the SQL
# interval, 500
def test_pause_for_a_huge_duration_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "x", "for": "99999999999999d", "csrf_token": token_of(client)},
    )
    assert r.status_code in (200, 400)


# Without the guard: a NUL byte in a search/filter term reaches PostgreSQL
# text: 500
@pytest.mark.parametrize(
    "url,params",
    [
        ("/search", {"q": "order\x00"}),
        ("/keys", {"key": "a\x00b"}),
        ("/rows", {"key_prefix": "a\x00"}),
        ("/rows", {"destination": "a\x00"}),
        ("/rows", {"error": "a\x00"}),
    ],
)
def test_a_nul_byte_in_a_term_is_not_500(app: Starlette, url: str, params: dict[str, str]) -> None:
    r = login(app, "rita").get(url, params=params)
    assert r.status_code < 500


# Without the guard: '²'.isdigit() is True but int('²') raises: preview/apply
# crash, 500
@pytest.mark.parametrize("path", ["/preview", "/apply"])
def test_a_superscript_digit_id_is_not_500(app: Starlette, engine: Any, path: str) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    r = client.post(
        path,
        data={
            "action": "cancel",
            "id": "²",
            "fingerprint": "x",
            "reason": "x",
            "csrf_token": token_of(client),
        },
    )
    assert r.status_code < 500


# Without the guard: an id past bigint in a preview/confirm form: DataError, 500
@pytest.mark.parametrize("action", ["replay", "cancel", "resolve-failed"])
def test_an_id_past_bigint_in_a_preview_is_400(app: Starlette, action: str) -> None:
    client = login(app, "olga")
    r = client.post("/preview", data={"action": action, "id": HUGE, "csrf_token": token_of(client)})
    assert r.status_code == 400


# Without the guard: non-ASCII CSRF token: hmac.compare_digest raises
# TypeError on str, 500
def test_a_non_ascii_csrf_token_is_403_not_500(app: Starlette) -> None:
    client = login(app, "olga")
    r = client.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": "é"})
    assert r.status_code == 403


# Without the guard: non-ASCII CSRF token on the (unauthenticated) login form:
# 500
def test_a_non_ascii_csrf_token_on_login_is_403_not_500(app: Starlette) -> None:
    client = client_for(app)
    client.get("/login")
    r = client.post("/login", data={"user": "olga", "password": "x", "csrf_token": "é"})
    assert r.status_code == 403


# Without the guard: non-ASCII session cookie MAC: hmac.compare_digest
# TypeError, unauthenticated 500
def test_a_non_ascii_cookie_is_ignored_not_500(app: Starlette) -> None:
    client = client_for(app)
    r = client.get("/", headers={"cookie": "outbox_session=abc.\u00e9".encode()})
    assert r.status_code == 303


def test_other_odd_inputs_are_clean_refusals(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    token = token_of(client)
    assert client.get("/rows/0").status_code == 404
    assert client.get("/rows", params={"state": "pending", "older_than": "-5m"}).status_code == 400
    assert client.get("/rows", params={"state": "\u202e"}).status_code == 400
    assert client.get("/search", params={"q": "\U0001f600\u202e\u0301\ufeff" * 100}).status_code < 500
    assert client.get("/search", params={"q": "9" * 18}).status_code < 500
    assert client.get("/search", params={"q": ":"}).status_code < 500
    assert client.get("/keys").status_code == 404
    assert client.post("/preview", data={"csrf_token": token}).status_code == 400
    assert client.post("/preview", data={"action": "replay", "csrf_token": token}).status_code == 400
    assert (
        client.post("/preview", data={"action": "replay", "state": "x", "csrf_token": token}).status_code
        == 400
    )
    assert (
        client.post("/preview", data={"action": "replay", "id": "abc", "csrf_token": token}).status_code
        == 400
    )
    assert (
        client.post(
            "/apply", data={"action": "nope", "id": "1", "reason": "x", "csrf_token": token}
        ).status_code
        == 400
    )
    assert client.post("/apply", data={"csrf_token": token}).status_code == 400
    assert client.post("/rows/1/resolve", data={"csrf_token": token}).status_code == 400
    assert (
        client.post("/rows/1/resolve", data={"how": "sent", "reason": "r", "csrf_token": token}).status_code
        == 409
    )
    assert client.post("/destinations/pause", data={"csrf_token": token}).status_code == 400
    assert client.post("/destinations/resume", data={"csrf_token": token}).status_code == 200
    assert client.post("/keys/repair", data={"key": "k", "csrf_token": token}).status_code == 409
    r = client.post(
        "/preview",
        content=b"csrf_token=" + token.encode() + b"&action=\xff\xfe",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400
    assert client.post("/preview", content=b"x" * (300 * 1024)).status_code == 413


@pytest.mark.parametrize(
    "payload",
    [
        '[1, 2, {"password": "SECRET-VALUE-1"}]',
        '"just a string"',
        "null",
        "12",
        '{"a": {"b": ' * 40 + "1" + "}}" * 40,
    ],
)
def test_non_object_payloads_render(app: Starlette, clean: Any, payload: str) -> None:
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('raw:1', 'charge', %s, %s::jsonb)",
        (DEST, payload),
    )
    [(row,)] = sql(clean, "SELECT id FROM outbox_message WHERE key = 'raw:1'")
    for user in ("olga", "rita"):
        page = login(app, user).get(f"/rows/{row}")
        assert page.status_code == 200
        assert "SECRET-VALUE-1" not in page.text


def declare_storing_answers(provider: Any, **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return charge


def _unknown_row(engine: Any, clean: Any, provider: Any, consumer: Any, key: str) -> int:
    row = write(engine, key)
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    return row


def _resolve_hidden(page_html: str) -> dict[str, str]:
    form = re.search(r'<form method="post" action="[^"]*/resolve".*?</form>', page_html, re.S)
    assert form, "no resolve form on the page"
    return dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form.group(0)))


def state_of(clean: Any, row: int) -> str:
    return sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,))[0][0]


# Without the guard: Filter.params() writes older_than with '{:g}', six significant digits:
# 14d (1,209,600 s) becomes '1.2096e+06s', which parse_duration refuses: the next-page link and the
# rows page's own bulk form (hidden older_than) are 400s (and 1234567s would come back rounded).
def test_a_two_week_filter_pages_and_previews(app: Starlette, engine: Any, clean: Any) -> None:
    ids = [write(engine, f"old:{i:03d}") for i in range(60)]
    sql(clean, "UPDATE outbox_message SET available_at = now() - interval '20 days'")
    client = login(app, "olga")
    first = client.get("/rows", params={"state": "pending", "older_than": "14d"})
    assert first.status_code == 200
    nxt = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert nxt, "no next page"
    second = client.get(nxt.group(1).replace("&amp;", "&"))
    assert second.status_code == 200, second.text
    # The rows page's bulk form posts its filter back as hidden fields.
    bulk = re.search(r'<form method="post" action="/preview" class="bulk">.*?</form>', first.text, re.S)
    assert bulk
    hidden = dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', bulk.group(0)))
    r = client.post("/preview", data={**hidden, "action": "cancel"})
    assert r.status_code == 200 and "60 row(s) will be acted on" in r.text, r.text[-400:]
    assert ids_by_state(clean)["pending"] == set(ids)


def test_a_short_filter_pages_and_previews(app: Starlette, engine: Any, clean: Any) -> None:
    for i in range(60):
        write(engine, f"old:{i:03d}")
    sql(clean, "UPDATE outbox_message SET available_at = now() - interval '2 days'")
    client = login(app, "olga")
    first = client.get("/rows", params={"state": "pending", "older_than": "1d"})
    nxt = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert nxt and client.get(nxt.group(1).replace("&amp;", "&")).status_code == 200


@pytest.mark.parametrize(
    "after",
    [
        "0001-01-01T00:00:00+14:00|1",
        "9999-12-31T23:59:59.999999-14:00|1",
        "2020-01-01|1",
        "2020-01-01T00:00:00Z|9223372036854775807",
        "2020-W01-1|1",
        "\u0662\u0660\u0662\u0660-01-01|1",
    ],
)
def test_odd_time_cursors_are_not_500(app: Starlette, engine: Any, after: str) -> None:
    write(engine, "c:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "after": after})
    assert r.status_code in (200, 400), r.status_code


def test_key_cursor_with_bars_and_odd_text_pages_every_row_once(app: Starlette, engine: Any) -> None:
    keys = [f"p|{i:03d}|x%_\\ z" for i in range(70)]
    ids = {write(engine, k) for k in keys}
    client = login(app, "rita")
    seen: list[int] = []
    url = "/rows?key_prefix=p%7C"
    for _ in range(5):
        page = client.get(url)
        assert page.status_code == 200
        seen += [int(i) for i in re.findall(r'<td><a href="/rows/(\d+)">', page.text)]
        nxt = re.search(r'rel="next" href="([^"]+)"', page.text)
        if not nxt:
            break
        url = nxt.group(1).replace("&amp;", "&")
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))


def _incompressible_ref(chars: int) -> str:
    rnd = random.Random(7)
    return "ch_" + "".join(chr(rnd.randrange(0x10000, 0x1FFFF)) for _ in range(chars))


# Without the guard: resolve --sent stores the operator's ref cut to 1000 characters
# (sanitize.clean_ref), but 1000 four-byte characters are ~4 KB and the btree index on provider_ref
# (migration 0019) takes at most 2704 bytes: the UPDATE fails, ProgramError is not an OutboxError,
# HTTP 500.
# In short: resolve --sent: a 4 KB ref overflows
# provider_ref's btree: 500
def test_resolve_sent_with_a_long_non_ascii_ref_is_not_500(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare_storing_answers(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:800")
    client = login(app, "olga")
    hidden = _resolve_hidden(client.get(f"/rows/{row}").text)
    r = client.post(
        f"/rows/{row}/resolve",
        data={**hidden, "how": "sent", "ref": _incompressible_ref(2000), "reason": "seen in the UI"},
    )
    assert r.status_code < 500, r.status_code


def test_resolve_sent_with_a_long_ascii_ref_is_stored_cut(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare_storing_answers(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:801")
    client = login(app, "olga")
    hidden = _resolve_hidden(client.get(f"/rows/{row}").text)
    r = client.post(
        f"/rows/{row}/resolve",
        data={**hidden, "how": "sent", "ref": "ch_" + "a" * 5000, "reason": "r" * 100_000},
    )
    assert r.status_code == 200
    assert state_of(clean, row) == "sent"


# Without the guard: a row written by plain SQL (the contract allows any language) whose payload
# holds an integer of more than 4300 digits: psycopg's json loader (Python's int limit) raises while
# the row page reads the payload: HTTP 500 on the row the operator must look at.
# In short: row page: payload with a >4300-digit number fails
# to load: 500
def test_a_payload_with_a_huge_number_renders(app: Starlette, clean: Any) -> None:
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('raw:big', 'charge', %s, %s::jsonb)",
        (DEST, '{"amount_cents": ' + "9" * 5000 + "}"),
    )
    [(row,)] = sql(clean, "SELECT id FROM outbox_message WHERE key = 'raw:big'")
    page = login(app, "olga").get(f"/rows/{row}")
    assert page.status_code == 200, page.status_code


def test_a_reader_row_page_with_a_huge_number_payload(app: Starlette, clean: Any) -> None:
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('raw:big', 'charge', %s, %s::jsonb)",
        (DEST, '{"amount_cents": ' + "9" * 5000 + "}"),
    )
    [(row,)] = sql(clean, "SELECT id FROM outbox_message WHERE key = 'raw:big'")
    assert login(app, "rita").get(f"/rows/{row}").status_code == 200


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


THOUSANDS = "9" * 5000


def _has_headers(r: Any) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert r.headers.get(name) == value, (r.status_code, r.url, name)


# Without the guard: the int route converter raised on 5,000 digits (past
# Python's int-from-text limit): a 500 without the security headers, a traceback logged each time.
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/rows/{THOUSANDS}"),
        ("GET", f"/batches/{THOUSANDS}"),
        ("POST", f"/rows/{THOUSANDS}/resolve"),
        ("POST", f"/rows/{THOUSANDS}/skip"),
        ("GET", "/rows/99999999999999999999"),
        ("GET", "/rows/0"),
        ("GET", "/rows/-1"),
        ("GET", "/rows/1x"),
        ("GET", "/batches/²"),
    ],
)
def test_an_id_of_any_length_is_a_clean_refusal(
    app_hosted: Starlette, caplog: pytest.LogCaptureFixture, method: str, path: str
) -> None:
    caplog.set_level(logging.DEBUG)
    r = client_for_hosted(app_hosted, "olga").request(method, path)
    assert r.status_code in (403, 404), (r.status_code, r.text[:300])
    _has_headers(r)
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
