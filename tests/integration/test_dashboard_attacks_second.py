"""Second attack on the web dashboard (issue 16), through its HTTP interface only, after the first
one's fixes. Every test asserts the safe behaviour; the ones headed "Broke" were breaks (a 14-day
filter refused back, a pause "for 0" ending another operator's pause, a long non-ASCII reference
overflowing the provider_ref index, a payload with a huge number, credentials inside texts,
a reader seeing the payload echoed in the response, a signed-out cookie revived by a clock
difference), all fixed; the others held and stay as regressions."""

from __future__ import annotations

import random
import re
import threading
from typing import Any

import pytest
from helpers import ids_by_state, relay_once, sql
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.testclient import TestClient

import outbox
from outbox.consumer import DeliveryResult
from outbox.dashboard import create_app, hash_password

DEST = "billing.charge"
SECRET = "s" * 40
PASSWORDS = {"olga": "operator-pw", "otto": "operator2-pw", "rita": "reader-pw", "pam": "payload-pw"}
HASHES: dict[str, str] = {}


def _hash(user: str) -> str:
    if user not in HASHES:
        HASHES[user] = hash_password(PASSWORDS[user])
    return HASHES[user]


def users_file(**roles: str) -> str:
    return "\n".join(f"{name} {role} {_hash(name)}" for name, role in roles.items())


@pytest.fixture(scope="module")
def users_text() -> str:
    return users_file(olga="operate", otto="operate", rita="read", pam="read+payloads")


@pytest.fixture
def app(clean: Any, engine: Any, users_text: str) -> Starlette:
    return create_app(engine=engine, secret=SECRET, users=users_text)


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def client_for(app: Starlette) -> TestClient:
    return TestClient(
        app, base_url="https://testserver", follow_redirects=False, raise_server_exceptions=False
    )


def login(app: Starlette, user: str) -> TestClient:
    client = client_for(app)
    page = client.get("/login")
    assert page.status_code == 200
    r = client.post(
        "/login", data={"user": user, "password": PASSWORDS[user], "csrf_token": _csrf(page.text)}
    )
    assert r.status_code == 303, r.text
    return client


def token_of(client: TestClient) -> str:
    return _csrf(client.get("/").text)


def declare(provider: Any, **options: Any) -> outbox.Handler:
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


def write(engine: Any, key: str, payload: dict[str, Any] | None = None, destination: str = DEST) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=destination, payload=payload or {"amount_cents": 500}
        ).id


def confirm_form(preview_html: str) -> dict[str, Any]:
    form: dict[str, Any] = dict(
        re.findall(r'name="(action|fingerprint|csrf_token)" value="([^"]*)"', preview_html)
    )
    form["id"] = re.findall(r'name="id" value="(\d+)"', preview_html)
    return form


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


# ================================================================================================
# A. Filters and keyset cursors
# ================================================================================================


# Broke (second attack): Filter.params() writes older_than with '{:g}', six significant digits:
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


# ================================================================================================
# B. Actions that the CLI's rules would refuse, and HTTP 500s on an action
# ================================================================================================


# Broke (second attack): the CLI refuses `outbox pause D --until 0` ("must be a positive duration");
# the dashboard's pause takes for=0 (parse_duration -> 0.0), sets paused_until = now(): it reports
# "paused" while nothing is paused, and silently ends another operator's indefinite pause.
# Broke before the fix (second attack on the dashboard): app.py pause: for=0 accepted (CLI refuses <= 0):
# ends a pause
@pytest.mark.parametrize("for_", ["0", "0s", "0.0m"])
def test_pause_for_zero_is_refused_and_keeps_an_outage_pause(
    app: Starlette, engine: Any, clean: Any, for_: str
) -> None:
    write(engine, "order:1")
    with engine.begin() as c:
        outbox.pauses.pause(c, DEST, by="otto", reason="provider outage INC-7")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "typo", "for": for_, "csrf_token": token_of(client)},
    )
    assert r.status_code == 400
    with engine.connect() as c:
        assert [p.destination for p in outbox.pauses.paused(c)] == [DEST]


def test_pause_for_a_short_time_is_a_pause(app: Starlette, engine: Any, clean: Any) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "x", "for": "15m", "csrf_token": token_of(client)},
    )
    assert r.status_code == 200
    with engine.connect() as c:
        assert [p.destination for p in outbox.pauses.paused(c)] == [DEST]


def _incompressible_ref(chars: int) -> str:
    rnd = random.Random(7)
    return "ch_" + "".join(chr(rnd.randrange(0x10000, 0x1FFFF)) for _ in range(chars))


# Broke (second attack): resolve --sent stores the operator's ref cut to 1000 characters
# (sanitize.clean_ref), but 1000 four-byte characters are ~4 KB and the btree index on provider_ref
# (migration 0019) takes at most 2704 bytes: the UPDATE fails, ProgramError is not an OutboxError,
# HTTP 500.
# Broke before the fix (second attack on the dashboard): resolve --sent: a 4 KB ref overflows
# provider_ref's btree: 500
def test_resolve_sent_with_a_long_non_ascii_ref_is_not_500(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
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
    declare(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:801")
    client = login(app, "olga")
    hidden = _resolve_hidden(client.get(f"/rows/{row}").text)
    r = client.post(
        f"/rows/{row}/resolve",
        data={**hidden, "how": "sent", "ref": "ch_" + "a" * 5000, "reason": "r" * 100_000},
    )
    assert r.status_code == 200
    assert state_of(clean, row) == "sent"


# Broke (second attack): a row written by plain SQL (the contract allows any language) whose payload
# holds an integer of more than 4300 digits: psycopg's json loader (Python's int limit) raises while
# the row page reads the payload: HTTP 500 on the row the operator must look at.
# Broke before the fix (second attack on the dashboard): row page: payload with a >4300-digit number fails
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


# ================================================================================================
# C. Leaks: secrets shown, payload data shown to a reader
# ================================================================================================


def _payload_page(app: Starlette, engine: Any, payload: dict[str, Any], user: str = "olga") -> str:
    row = write(engine, "order:leak", payload)
    page = login(app, user).get(f"/rows/{row}")
    assert page.status_code == 200
    return page.text


LEAKS_HELD2 = [
    {"cardPIN": "SECRET-VALUE-1"},
    {"card[cvc]": "SECRET-VALUE-1"},
    {"sessionToken": "SECRET-VALUE-1"},
    {"x-api-key": "SECRET-VALUE-1"},
    {"note": " Bearer SECRET-VALUE-1 "},
    {"deep": [[[{"Authorization": "SECRET-VALUE-1"}]]]},
]
# Each a credential the rules of outbox/sanitize.py let through (name: _SECRET_NAME; value:
# _SECRET_VALUE, anchored at the start of the value and whole-value only).
LEAKS_BROKEN2 = [
    ({"headers": ["Authorization: Bearer SECRET-VALUE-1"]}, "a raw header line: the value rule is anchored"),
    ({"headers": {"Cookie": "session=SECRET-VALUE-1"}}, "a Cookie header is a credential, not a name rule"),
    ({"note": "BEARER SECRET-VALUE-1"}, "an upper-case scheme (schemes are case-insensitive)"),
    ({"note": "key sk_live_SECRETVALUE1"}, "sk_live_ inside a text: the value rule only matches at start"),
    ({"callback": "https://h.example/cb?access_token=SECRET-VALUE-1"}, "a credential in a URL query"),
    ({"body": '{"password": "SECRET-VALUE-1"}'}, "a JSON body kept as a string (webhooks) is not parsed"),
    ({"API Key": "SECRET-VALUE-1"}, "'API Key' with a space: api[-_]?key"),
    ({"PINCode": "SECRET-VALUE-1"}, "PINCode: camelCase split needs a lower-case letter before"),
    ({"jwt": "SECRET-VALUE-1"}, "jwt is not a secret-like name"),
]


@pytest.mark.parametrize("payload", LEAKS_HELD2, ids=lambda p: str(next(iter(p))))
def test_more_secret_fields_held(app: Starlette, engine: Any, payload: dict[str, Any]) -> None:
    assert "SECRET-VALUE-1" not in _payload_page(app, engine, payload)


# Broke before the fix (second attack on the dashboard): sanitize: these credentials match neither the name
# nor value rule
@pytest.mark.parametrize("payload", [p for p, _ in LEAKS_BROKEN2], ids=[w[:30] for _, w in LEAKS_BROKEN2])
def test_credentials_in_odd_places_are_redacted(app: Starlette, engine: Any, payload: dict[str, Any]) -> None:
    text = _payload_page(app, engine, payload)
    assert "SECRET-VALUE-1" not in text and "SECRETVALUE1" not in text


# Broke (second attack): a `read` user ("every page, payloads hidden") sees the stored provider
# response on the row page (row.html prints it for every role): a payments provider's answer echoes
# the request (customer, e-mail, description, metadata), so the payload is shown after all.
# Broke before the fix (second attack on the dashboard): row.html shows the stored response to readers
# without payloads
def test_a_reader_does_not_see_the_payload_echoed_in_the_response(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    @outbox.handler(DEST, time_limit=2, backoff=(1,), max_attempts=2)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        # What a provider's charge object carries: the request's data, echoed.
        return outbox.Confirmed(ref="ch_1", response={"id": "ch_1", "description": d.payload["note"]})

    row = write(engine, "order:900", {"amount_cents": 500, "note": "PRIVATE-NOTE-1 for jane@example.com"})
    relay_once(clean)
    assert consumer().deliver(row, DEST) is DeliveryResult.SENT
    reader = login(app, "rita").get(f"/rows/{row}")
    assert reader.status_code == 200 and "payload is hidden" in reader.text
    assert "PRIVATE-NOTE-1" not in reader.text


# ================================================================================================
# D. Sessions: sign-out record, two clocks
# ================================================================================================


class _BehindClock:
    """The dashboard host's clock, `lag` seconds behind the database's (NTP drift, a VM resumed)."""

    def __init__(self, lag: float) -> None:
        import time as _time

        self._time = _time
        self.lag = lag

    def time(self) -> float:
        return self._time.time() - self.lag

    def monotonic(self) -> float:
        return self._time.monotonic()


# Broke (second attack): the cookie's end is checked on the dashboard host's clock (Signer.unsign,
# time.time()), the sign-out record is purged on the database's (_END_SESSION: expires_at < now()).
# With the host's clock behind, the next sign-out of anyone purges the record while the stolen
# cookie is still valid: it works again. (DESIGN "one clock": instants compared come from one clock.)
# Broke before the fix (second attack on the dashboard): _END_SESSION purges on the DB clock; cookie expiry
# is app clock
def test_a_signed_out_cookie_stays_dead_when_the_clocks_differ(
    clean: Any, engine: Any, users_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.dashboard import security

    monkeypatch.setattr(security, "time", _BehindClock(120))
    app = create_app(engine=engine, secret=SECRET, users=users_text, session_seconds=60)
    victim = login(app, "olga")
    stolen = victim.cookies.get("outbox_session")
    assert victim.post("/logout", data={"csrf_token": token_of(victim)}).status_code == 303
    # Someone else signs out later: the purge runs.
    other = login(app, "rita")
    other.post("/logout", data={"csrf_token": token_of(other)})
    r = client_for(app).get("/", headers={"cookie": f"outbox_session={stolen}"})
    assert r.status_code == 303, "a signed-out cookie works again"


def test_a_signed_out_cookie_stays_dead_after_other_sign_outs(app: Starlette) -> None:
    victim = login(app, "olga")
    stolen = victim.cookies.get("outbox_session")
    victim.post("/logout", data={"csrf_token": token_of(victim)})
    for user in ("rita", "pam", "otto"):
        c = login(app, user)
        c.post("/logout", data={"csrf_token": token_of(c)})
    r = client_for(app).get("/", headers={"cookie": f"outbox_session={stolen}"})
    assert r.status_code == 303
    # And a POST with the stolen cookie and its token is refused too.
    r = client_for(app).post(
        "/destinations/resume",
        data={"destination": DEST, "csrf_token": "x"},
        headers={"cookie": f"outbox_session={stolen}"},
    )
    assert r.status_code == 401


# ================================================================================================
# E. Concurrency: two operators confirming at once
# ================================================================================================


def _declined_row(engine: Any, clean: Any, provider: Any, consumer: Any, key: str) -> int:
    declare(provider)
    row = write(engine, key)
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(row, DEST) is DeliveryResult.FAILED
    return row


def _at_once(calls: list[Any]) -> list[Any]:
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_two_operators_confirming_one_replay_preview_replay_it_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    row = _declined_row(engine, clean, provider, consumer, "order:1000")
    olga, otto = login(app, "olga"), login(app, "otto")
    forms = []
    for c in (olga, otto):
        p = c.post("/preview", data={"action": "replay", "id": str(row), "csrf_token": token_of(c)})
        forms.append(confirm_form(p.text))
    results = _at_once(
        [
            lambda c=c, f=f: c.post("/apply", data={**f, "reason": "card updated"})
            for c, f in zip((olga, otto), forms, strict=True)
        ]
    )
    assert all(r.status_code == 200 for r in results)
    [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
    assert [h["action"] for h in history].count("replay") == 1
    assert state_of(clean, row) == "pending"


def test_two_operators_resolving_one_row_at_once_settle_it_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:1001")
    olga, otto = login(app, "olga"), login(app, "otto")
    hidden = [_resolve_hidden(c.get(f"/rows/{row}").text) for c in (olga, otto)]
    results = _at_once(
        [
            lambda: olga.post(
                f"/rows/{row}/resolve", data={**hidden[0], "how": "not-sent", "reason": "none"}
            ),
            lambda: otto.post(
                f"/rows/{row}/resolve", data={**hidden[1], "how": "sent", "ref": "ch_9", "reason": "seen"}
            ),
        ]
    )
    assert sorted(r.status_code for r in results) == [200, 409]
    [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
    assert [h["action"] for h in history].count("resolve") == 1


def test_two_operators_bulk_resolving_failed_at_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    rows = [_unknown_row(engine, clean, provider, consumer, f"order:11{i}") for i in range(3)]
    olga, otto = login(app, "olga"), login(app, "otto")
    forms = []
    for c in (olga, otto):
        data = {"action": "resolve-failed", "state": "unknown", "csrf_token": token_of(c)}
        p = c.post("/preview", data=data)
        forms.append(confirm_form(p.text))
    _at_once(
        [
            lambda c=c, f=f: c.post("/apply", data={**f, "reason": "gave up"})
            for c, f in zip((olga, otto), forms, strict=True)
        ]
    )
    for row in rows:
        [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
        assert [h["action"] for h in history].count("resolve") == 1
        assert state_of(clean, row) == "failed"


# ================================================================================================
# F. htmx fragments, HTML injection, repair confirmations
# ================================================================================================

XSS = '<script>alert(1)</script>"><img src=x onerror=alert(2) hx-get="/x">'


def test_htmx_fragments_escape_and_follow_roles(app: Starlette, engine: Any, clean: Any) -> None:
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name="batch-xss-1")
        outbox.write(s, key="bx:1", step="charge", destination=DEST, payload={"a": 1}, batch=b)
        batch_id = b.id
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload, state, last_error) "
        "VALUES ('raw:x', 'charge', %s, '{}', 'pending', %s)",
        (f"d{XSS}", XSS),
    )
    hx = {"hx-request": "true"}
    reader = login(app, "rita")
    frag = reader.get("/", headers=hx)
    assert frag.status_code == 200 and "<html" not in frag.text
    assert "<script>alert" not in frag.text and "<img src=x" not in frag.text
    assert "/destinations/pause" not in frag.text  # a reader's fragment has no action form
    bfrag = reader.get(f"/batches/{batch_id}", headers=hx)
    assert bfrag.status_code == 200 and "<html" not in bfrag.text
    assert client_for(app).get("/", headers=hx).status_code == 303  # no fragment without a login
    assert "no-store" in frag.headers["cache-control"]


def _repair_app(clean: Any, engine: Any, users_text: str) -> Starlette:
    from outbox.handlers import registry

    return create_app(
        engine=engine,
        secret=SECRET,
        users=users_text,
        database_url=clean.database_url,
        handlers=registry(),
        module=__name__,
    )


def test_a_repair_fingerprint_of_one_key_does_not_confirm_another(
    clean: Any, engine: Any, users_text: str, provider: Any, consumer: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare(provider), provider)
    a = _unknown_row(engine, clean, provider, consumer, "order:1200")
    b = _unknown_row(engine, clean, provider, consumer, "order:1201")
    app = _repair_app(clean, engine, users_text)
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/keys/repair", data={"key": "order:1200", "csrf_token": token})
    assert preview.status_code == 200
    fp = re.search(r'name="fingerprint" value="([^"]+)"', preview.text)
    assert fp
    r = client.post(
        "/keys/repair",
        data={
            "key": "order:1201",
            "confirm": "yes",
            "fingerprint": fp.group(1),
            "reason": "x",
            "csrf_token": token,
        },
    )
    assert r.status_code == 409
    assert state_of(clean, a) == state_of(clean, b) == "unknown"


def test_the_overview_lists_an_in_flight_limit(app: Starlette, engine: Any, clean: Any) -> None:
    write(engine, "order:1")
    with engine.begin() as c:
        outbox.limits.set_limit(c, DEST, in_flight=4, by="otto", reason="provider allows 4")
    client = login(app, "rita")
    page = client.get("/").text
    assert f"limited: {DEST}: at most 4 calls in flight" in page and "provider allows 4" in page
