"""The web dashboard's security, through its HTTP interface only: sessions end at sign-out, at a
password change and when a user is removed or demoted, whatever the clocks; CSRF on every POST
and on login, no open redirect, the login throttle against sequential and concurrent guesses;
roles (a reader never acts; the host application's authorize hook); secrets redacted and payload
data and error texts shown only to payload rights; no HTML injection, in pages or htmx
fragments; the security headers on every response, errors included."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import psycopg
import pytest
from helpers import ids_by_state, relay_once, sql
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.testclient import TestClient

import outbox
from outbox import store
from outbox.consumer import DeliveryResult
from outbox.dashboard import Access, create_app, hash_password
from outbox.dashboard.security import SECURITY_HEADERS
from outbox.settings import libpq_url

from .support import (
    DEST,
    PASSWORDS,
    SECRET,
    client_for,
    csrf,
    declare,
    login,
    token_of,
    users_file,
    write,
)


def _unknown_row(engine: Any, clean: Any, provider: Any, consumer: Any, key: str) -> int:
    row = write(engine, key)
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    return row


# Without the guard: stateless session: a cookie copied before logout still
# works after it
def test_a_cookie_is_worth_nothing_after_logout(app: Starlette) -> None:
    client = login(app, "olga")
    cookie = client.cookies.get("outbox_session")
    token = token_of(client)
    r = client.post("/logout", data={"csrf_token": token})
    assert r.status_code == 303
    thief = client_for(app)
    r = thief.get("/", headers={"cookie": f"outbox_session={cookie}"})
    assert r.status_code == 303 and "/login" in r.headers["location"]


# Without the guard: the session names only the user: a password reset does
# not end the old sessions
def test_a_password_change_ends_the_old_sessions(clean: Any, engine: Any) -> None:
    before = create_app(engine=engine, secret=SECRET, users=users_file(olga="operate"))
    client = login(before, "olga")
    cookie = client.cookies.get("outbox_session")
    # The operator's password leaked: a new hash is written and the dashboard restarted.
    new_hash = hash_password("a-brand-new-password")
    after = create_app(engine=engine, secret=SECRET, users=f"olga operate {new_hash}")
    r = client_for(after).get("/", headers={"cookie": f"outbox_session={cookie}"})
    assert r.status_code == 303


def test_a_removed_or_demoted_user_loses_access_at_once(clean: Any, engine: Any) -> None:
    first = create_app(engine=engine, secret=SECRET, users=users_file(olga="operate", rita="read"))
    client = login(first, "olga")
    cookie = client.cookies.get("outbox_session")
    removed = create_app(engine=engine, secret=SECRET, users=users_file(rita="read"))
    assert client_for(removed).get("/", headers={"cookie": f"outbox_session={cookie}"}).status_code == 303
    demoted = create_app(engine=engine, secret=SECRET, users=users_file(olga="read"))
    c2 = client_for(demoted)
    c2.cookies.set("outbox_session", cookie)
    page = c2.get("/")
    assert page.status_code == 200
    r = c2.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": csrf(page.text)})
    assert r.status_code == 403


def test_forged_and_cross_secret_cookies_are_refused(app: Starlette, clean: Any, engine: Any) -> None:
    import base64

    rita = login(app, "rita")
    cookie = rita.cookies.get("outbox_session")
    body, mac = cookie.split(".")
    data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    data["user"] = "olga"
    forged = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    c = client_for(app)
    for value in (f"{forged}.{mac}", f"{body}.", f"{body}.{mac}.x", "", "..", f"{forged}.{mac[:-1]}A"):
        r = c.get("/", headers={"cookie": f"outbox_session={value}"})
        assert r.status_code == 303, value
    other = create_app(engine=engine, secret="t" * 40, users=users_file(olga="operate", rita="read"))
    assert client_for(other).get("/", headers={"cookie": f"outbox_session={cookie}"}).status_code == 303


def test_a_reader_cannot_act_anywhere(app: Starlette, engine: Any) -> None:
    row = write(engine, "order:1")
    reader = login(app, "rita")
    token = token_of(reader)
    posts = [
        ("/preview", {"action": "cancel", "id": str(row)}),
        ("/apply", {"action": "cancel", "id": str(row), "fingerprint": "x", "reason": "x"}),
        (f"/rows/{row}/resolve", {"how": "failed", "reason": "x"}),
        ("/destinations/pause", {"destination": DEST, "reason": "x"}),
        ("/destinations/resume", {"destination": DEST}),
        ("/keys/repair", {"key": "order:1", "confirm": "yes", "reason": "x"}),
    ]
    for path, data in posts:
        r = reader.post(path, data={**data, "csrf_token": token})
        assert r.status_code == 403, path
    assert ids_by_state(app_services(engine))["pending"] == {row}


def app_services(engine: Any) -> Any:
    class _S:
        database_url = engine.url.render_as_string(hide_password=False)

    return _S()


def test_login_csrf_and_unauthenticated_posts_are_refused(app: Starlette) -> None:
    # No pre-login session: the login form cannot be posted from another site.
    c = client_for(app)
    r = c.post("/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": "x"})
    assert r.status_code == 403 and "outbox_session" not in r.headers.get("set-cookie", "")
    # A pre-login token planted by an attacker is worthless once the victim logs in.
    attacker = client_for(app)
    planted = attacker.get("/login")
    cookie, token = attacker.cookies.get("outbox_login"), csrf(planted.text)
    victim = client_for(app)
    victim.cookies.set("outbox_login", cookie)
    r = victim.post("/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": token})
    assert r.status_code == 303
    assert (
        victim.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": token}).status_code == 403
    )
    # Unauthenticated POSTs.
    for path in ("/preview", "/apply", "/rows/1/resolve", "/destinations/pause", "/logout"):
        assert client_for(app).post(path, data={"csrf_token": "x"}).status_code in (401, 403), path
    # Logged-in user: a token from another user's session is refused.
    olga, rita = login(app, "olga"), login(app, "rita")
    assert (
        olga.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": token_of(rita)}).status_code
        == 403
    )
    # The header form of the token needs the same value.
    assert (
        olga.post("/preview", data={"action": "cancel", "id": "1"}, headers={"x-csrf-token": "x"}).status_code
        == 403
    )


@pytest.mark.parametrize(
    "nxt",
    [
        "//evil.example/x",
        "/\\evil.example",
        "/\t/evil.example",
        "https://evil.example",
        "\\\\evil.example",
        "/%2F/evil.example",
        " //evil.example",
        "/\r\nLocation: https://evil.example",
    ],
)
def test_no_open_redirect_after_login(app: Starlette, nxt: str) -> None:
    client = client_for(app)
    page = client.get("/login")
    r = client.post(
        "/login",
        data={"user": "rita", "password": PASSWORDS["rita"], "csrf_token": csrf(page.text), "next": nxt},
    )
    assert r.status_code == 303
    location = r.headers["location"]
    assert "\r" not in location and "\n" not in location
    normalized = re.sub(r"[\t\r\n]", "", location).replace("\\", "/")
    assert normalized.startswith("/") and not normalized.startswith("//"), location


# Without the guard: throttle checks retry_after before the (slow) password
# check and records the failure after: concurrent guesses all pass the check
def test_concurrent_guesses_do_not_get_past_the_throttle(app: Starlette) -> None:
    attempts = 24
    clients = []
    for _ in range(attempts):
        c = client_for(app)
        clients.append((c, csrf(c.get("/login").text)))
    statuses: list[int] = []
    barrier = threading.Barrier(attempts)

    def guess(c: TestClient, token: str, i: int) -> None:
        barrier.wait()
        r = c.post("/login", data={"user": "olga", "password": f"guess-{i}", "csrf_token": token})
        statuses.append(r.status_code)

    threads = [threading.Thread(target=guess, args=(c, t, i)) for i, (c, t) in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    checked = statuses.count(401)  # each 401 is a password actually tried
    assert checked <= 5, f"{checked} passwords tried against olga in one window (limit 5): {statuses}"


# Without the guard: Throttle.retry_after setdefault()s an entry per user
# name, even when refused 429: unbounded memory keyed by attacker-chosen names
def test_the_throttle_does_not_keep_what_unknown_names_send(app: Starlette) -> None:
    client = client_for(app)
    token = csrf(client.get("/login").text)
    for i in range(6):
        client.post("/login", data={"user": f"x{i}", "password": "x", "csrf_token": token})
    for i in range(30):
        name = f"{i}-" + "n" * 100_000
        r = client.post("/login", data={"user": name, "password": "x", "csrf_token": token})
        assert r.status_code == 401  # counted per (name, address): each a new name
    throttle = app.state.dashboard.throttle
    kept = sum(len(k) for k in throttle._failures)
    assert kept < 200_000, f"{kept} bytes of user names kept by the throttle after 30 refused logins"


def test_the_throttle_holds_for_sequential_guesses_and_other_ips_of_one_name(app: Starlette) -> None:
    client = client_for(app)
    token = csrf(client.get("/login").text)
    for i in range(5):
        assert (
            client.post("/login", data={"user": "olga", "password": f"g{i}", "csrf_token": token}).status_code
            == 401
        )
    # Another session (the same client address) and a user name alias do not reset the count.
    other = client_for(app)
    t2 = csrf(other.get("/login").text)
    assert (
        other.post(
            "/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": t2}
        ).status_code
        == 429
    )
    # Another account from the same address is not locked out (counted per name and address),
    # and its successful login does not reset olga's count.
    assert (
        other.post(
            "/login", data={"user": "rita", "password": PASSWORDS["rita"], "csrf_token": t2}
        ).status_code
        == 303
    )
    t3 = csrf(other.get("/login").text)
    assert (
        other.post(
            "/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": t3}
        ).status_code
        == 429
    )


def host_app(engine: Any) -> Starlette:
    def authorize(request: Request) -> Access | tuple[str, str] | None:
        user = request.headers.get("x-user")
        if user is None:
            return None
        return (user, request.headers.get("x-role", "read"))

    return Starlette(routes=[Mount("/outbox", create_app(engine=engine, secret=SECRET, authorize=authorize))])


def test_host_role_none_sees_nothing(engine: Any, clean: Any) -> None:
    row = write(engine, "order:1", {"card_token": "tok_1", "note": "private-note"})
    c = client_for(host_app(engine))
    none = {"x-user": "eve", "x-role": "none"}
    for path in (
        "/outbox/",
        f"/outbox/rows/{row}",
        "/outbox/rows?state=pending",
        "/outbox/search?q=order",
        "/outbox/keys?key=order:1",
        "/outbox/batches",
        "/outbox/blocked",
    ):
        r = c.get(path, headers=none)
        assert r.status_code == 403, path
        assert "order:1" not in r.text and "private-note" not in r.text
    page = c.get(f"/outbox/rows/{row}", headers={"x-user": "rita"})
    assert "private-note" not in page.text


# Without the guard: with authorize=, the CSRF session is not bound to the
# user: a cookie+token pair minted for one user (e.g. an attacker's own, planted by cookie tossing) is
# accepted for an operator
def test_host_mode_csrf_token_of_another_user_is_refused(engine: Any, clean: Any) -> None:
    row = write(engine, "order:1")
    app = host_app(engine)
    attacker = client_for(app)
    page = attacker.get("/outbox/", headers={"x-user": "mallory", "x-role": "read"})
    cookie, token = attacker.cookies.get("outbox_session"), csrf(page.text)
    # The operator's browser carries the planted cookie and posts the attacker's form.
    victim = client_for(app)
    r = victim.post(
        "/outbox/preview",
        data={"action": "cancel", "id": str(row), "csrf_token": token},
        headers={"x-user": "olga", "x-role": "operate", "cookie": f"outbox_session={cookie}"},
    )
    assert r.status_code == 403


LEAKS_HELD = [
    {"password": "SECRET-VALUE-1"},
    {"Authorization": "Bearer SECRET-VALUE-1"},
    {"headers": {"authorization": "Bearer SECRET-VALUE-1"}},
    {"cardNumber": "SECRET-VALUE-1"},
    {"card_number": "SECRET-VALUE-1"},
    {"apiKey": "SECRET-VALUE-1"},
    {"card_token": "SECRET-VALUE-1"},
    {"cvv": "SECRET-VALUE-1"},
    {"card": {"cvc": "SECRET-VALUE-1"}},
    {"list": [{"client_secret": "SECRET-VALUE-1"}]},
    {"note": "card 4242 4242 4242 4242"},
    {"n": 4242424242424242},
]

LEAKS_BROKEN = [
    ({"cardCvc": "SECRET-VALUE-1"}, "camelCase cvc: the short-word rule needs a non-letter before it"),
    ({"cardPan": "SECRET-VALUE-1"}, "camelCase pan: not a whole word by the regex"),
    ({"pin": "SECRET-VALUE-1"}, "a card PIN is not a secret-like name"),
    ({"pwd": "SECRET-VALUE-1"}, "pwd (password) is not a secret-like name"),
    ({"passphrase": "SECRET-VALUE-1"}, "passphrase is not a secret-like name"),
    ({"stripe_key": "sk_live_SECRET-VALUE-1"}, "a *_key holding a live API key is not redacted"),
    ({"auth": "Bearer SECRET-VALUE-1"}, "a bearer credential under 'auth' is not redacted"),
    (
        {"credentials": {"user": "u", "pass": "SECRET-VALUE-1"}},
        "credentials / pass are not secret-like names",
    ),
]


def _payload_page(app: Starlette, engine: Any, payload: dict[str, Any], user: str = "olga") -> str:
    row = write(engine, "order:leak", payload)
    page = login(app, user).get(f"/rows/{row}")
    assert page.status_code == 200
    return page.text


@pytest.mark.parametrize("payload", LEAKS_HELD)
def test_secret_looking_payload_fields_are_redacted(
    app: Starlette, engine: Any, payload: dict[str, Any]
) -> None:
    text = _payload_page(app, engine, payload)
    assert "SECRET-VALUE-1" not in text and "4242424242424242" not in text


@pytest.mark.parametrize(
    "payload",
    [pytest.param(p, id=next(iter(p))) for p, why in LEAKS_BROKEN],
)
def test_more_secret_looking_payload_fields_are_redacted(
    app: Starlette, engine: Any, payload: dict[str, Any]
) -> None:
    text = _payload_page(app, engine, payload)
    assert "SECRET-VALUE-1" not in text


# Without the guard: the row page lists payload_keys (jsonb_object_keys) raw,
# to readers too: a card number used as a field name is shown unmasked (the payload itself masks it)
def test_a_card_number_as_a_payload_field_name_is_masked_in_the_field_list(
    app: Starlette, engine: Any
) -> None:
    text = _payload_page(app, engine, {"4242424242424242": {"amount": 1}}, user="rita")
    assert "4242424242424242" not in text


XSS = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


def test_no_html_injection_anywhere(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    row = _unknown_row(engine, clean, provider, consumer, f"order:{XSS}")
    other = write(engine, f"k{XSS}", {f"f{XSS}": XSS, "x": [XSS]})
    # A row written by plain SQL from another language: any destination, step, error.
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload, state, last_error) "
        "VALUES (%s, %s, %s, '{}', 'failed', %s)",
        (f"raw{XSS}", f"s{XSS}", f"d{XSS}", XSS),
    )
    client = login(app, "olga")
    token = token_of(client)
    version = re.search(r'name="version" value="([^"]+)"', client.get(f"/rows/{row}").text).group(1)  # type: ignore[union-attr]
    r = client.post(
        f"/rows/{row}/resolve",
        data={"how": "sent", "ref": f"ch{XSS}", "reason": XSS, "csrf_token": token, "version": version},
    )
    assert r.status_code == 200
    client.post("/destinations/pause", data={"destination": DEST, "reason": XSS, "csrf_token": token})
    pages = [
        client.get("/"),
        client.get(f"/rows/{row}"),
        client.get(f"/rows/{other}"),
        client.get("/rows"),
        client.get("/rows", params={"state": "failed", "error": XSS, "destination": XSS, "key_prefix": XSS}),
        client.get("/rows", params={"state": "failed"}),
        client.get("/search", params={"q": XSS}),
        client.get("/keys", params={"key": f"order:{XSS}"}),
        client.get("/keys", params={"key": XSS}),
        client.get("/login", params={"next": XSS}),
        client.post("/preview", data={"action": "replay", "state": "failed", "csrf_token": token}),
        client.post("/preview", data={"action": XSS, "csrf_token": token}),
        client.post("/preview", data={"action": "cancel", "state": XSS, "csrf_token": token}),
        client.post("/destinations/pause", data={"destination": XSS, "reason": "x", "csrf_token": token}),
        client.post("/destinations/resume", data={"destination": XSS, "csrf_token": token}),
    ]
    for p in pages:
        assert p.status_code < 500, p.url
        assert "<script>alert" not in p.text and "<img src=x" not in p.text, p.url
    refs = sql(clean, "SELECT provider_ref FROM outbox_message WHERE id = %s", (row,))
    assert refs == [(f"ch{XSS}",)]


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
def test_more_secret_field_names_are_redacted(app: Starlette, engine: Any, payload: dict[str, Any]) -> None:
    assert "SECRET-VALUE-1" not in _payload_page(app, engine, payload)


# Without the guard: sanitize: these credentials match neither the name
# nor value rule
@pytest.mark.parametrize("payload", [p for p, _ in LEAKS_BROKEN2], ids=[w[:30] for _, w in LEAKS_BROKEN2])
def test_credentials_in_odd_places_are_redacted(app: Starlette, engine: Any, payload: dict[str, Any]) -> None:
    text = _payload_page(app, engine, payload)
    assert "SECRET-VALUE-1" not in text and "SECRETVALUE1" not in text


# Without the guard: a `read` user ("every page, payloads hidden") sees the stored provider
# response on the row page (row.html prints it for every role): a payments provider's answer echoes
# the request (customer, e-mail, description, metadata), so the payload is shown after all.
# In short: row.html shows the stored response to readers
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


# Without the guard: the cookie's end is checked on the dashboard host's clock (Signer.unsign,
# time.time()), the sign-out record is purged on the database's (_END_SESSION: expires_at < now()).
# With the host's clock behind, the next sign-out of anyone purges the record while the stolen
# cookie is still valid: it works again. (DESIGN "one clock": instants compared come from one clock.)
# In short: _END_SESSION purges on the DB clock; cookie expiry
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


XSS_WITH_HX_GET = '<script>alert(1)</script>"><img src=x onerror=alert(2) hx-get="/x">'


def test_htmx_fragments_escape_and_follow_roles(app: Starlette, engine: Any, clean: Any) -> None:
    with Session(engine) as s, s.begin():
        b = outbox.batch(s, name="batch-xss-1")
        outbox.write(s, key="bx:1", step="charge", destination=DEST, payload={"a": 1}, batch=b)
        batch_id = b.id
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload, state, last_error) "
        "VALUES ('raw:x', 'charge', %s, '{}', 'pending', %s)",
        (f"d{XSS}", XSS_WITH_HX_GET),
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


#: The host's users (authorize=): the login's own tests are elsewhere.
ROLES = {"olga": ("operate", False), "rita": ("read", False), "pam": ("read", True)}

#: What a provider's error text echoes of the request: never shown to rita.
ECHO = "echo-of-4111-alice@example.com"


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


THOUSANDS = "9" * 5000


def _has_headers(r: Any) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert r.headers.get(name) == value, (r.status_code, r.url, name)


def test_every_error_response_carries_the_security_headers(
    app_hosted: Starlette, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_for_hosted(app_hosted, "olga")
    missing = client.get("/no-such-page")
    assert missing.status_code == 404
    _has_headers(missing)
    wrong_method = client.get("/logout")
    assert wrong_method.status_code == 405
    _has_headers(wrong_method)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a bug in a page")

    monkeypatch.setattr("outbox.dashboard.app.blocked_keys", broken)
    crashed = client.get("/blocked")
    assert crashed.status_code == 500
    _has_headers(crashed)


def test_a_mounted_dashboard_keeps_its_headers_on_errors(clean: Any, engine: Any) -> None:
    host = Starlette(routes=[Mount("/outbox", create_app(engine=engine, secret=SECRET, authorize=authorize))])
    client = client_for_hosted(host, "olga")
    r = client.get(f"/outbox/rows/{THOUSANDS}")
    assert r.status_code == 404
    _has_headers(r)


def _errors_everywhere(clean: Any, engine: Any) -> dict[str, int]:
    """A failed row whose error texts echo the request, at the head of an ordering key with a
    row behind it; an unknown row whose attempt's error echoes it too."""
    failed = write_hosted(engine, "order:echo", ordering_key="customer:9")
    write_hosted(engine, "order:behind", ordering_key="customer:9")
    claim_and_record(clean, failed, "failed", "failed", error=f"402 declined: {ECHO}", http_status=402)
    unknown = write_hosted(engine, "order:echo-unknown")
    claim_and_record(clean, unknown, "unknown", "unknown", error=f"read timeout after sending {ECHO}")
    return {"failed": failed, "unknown": unknown}


def _reader_pages(client: TestClient, rows: dict[str, int]) -> dict[str, Any]:
    return {
        "row failed": client.get(f"/rows/{rows['failed']}"),
        "row unknown": client.get(f"/rows/{rows['unknown']}"),
        "list failed": client.get("/rows", params={"state": "failed"}),
        "list unknown": client.get("/rows", params={"state": "unknown"}),
        "list all": client.get("/rows"),
        "key": client.get("/keys", params={"key": "order:echo"}),
        "key unknown": client.get("/keys", params={"key": "order:echo-unknown"}),
        "blocked": client.get("/blocked"),
    }


# Without the guard: a `read` user read the provider's error texts, which
# echo the request, on the row and list pages, the key page and the blocked keys.
def test_a_reader_without_payload_rights_sees_no_error_text(
    app_hosted: Starlette, clean: Any, engine: Any
) -> None:
    rows = _errors_everywhere(clean, engine)
    pages = _reader_pages(client_for_hosted(app_hosted, "rita"), rows)
    for name, page in pages.items():
        assert page.status_code == 200, name
        assert ECHO not in page.text and "declined" not in page.text, name
    # The classification and the HTTP status stay.
    row = pages["row failed"].text
    assert 'class="outcome failed"' in row and "<td>402</td>" in row
    assert "hidden" in row
    assert 'class="outcome unknown"' in pages["row unknown"].text


@pytest.mark.parametrize("user", ["pam", "olga"])
def test_payload_rights_see_the_error_texts(
    app_hosted: Starlette, clean: Any, engine: Any, user: str
) -> None:
    rows = _errors_everywhere(clean, engine)
    pages = _reader_pages(client_for_hosted(app_hosted, user), rows)
    for name in ("row failed", "row unknown", "list failed", "list unknown", "key", "blocked"):
        assert pages[name].status_code == 200, name
        assert ECHO in pages[name].text, name


# Without the guard: the error filter (last_error ILIKE) answered a reader
# whether a row's error text, hence its payload, holds a fragment.
def test_the_error_filter_is_no_oracle_for_a_reader(app_hosted: Starlette, clean: Any, engine: Any) -> None:
    _errors_everywhere(clean, engine)
    rita = client_for_hosted(app_hosted, "rita")
    hit = rita.get("/rows", params={"state": "failed", "error": "4111"})
    miss = rita.get("/rows", params={"state": "failed", "error": "5555"})
    assert hit.status_code == miss.status_code == 403
    assert hit.text == miss.text
    assert 'name="error"' not in rita.get("/rows").text
    pam = client_for_hosted(app_hosted, "pam").get("/rows", params={"state": "failed", "error": "4111"})
    assert pam.status_code == 200 and "order:echo" in pam.text
