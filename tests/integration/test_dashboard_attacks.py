"""Attacks on the web dashboard (issue 16) through its HTTP interface only, by a helper given the
contract, the code and the services. Every test asserts the safe behaviour. The ones headed
"Broke before the fix" were breaks (a stale repair or resolve acting on what the operator never
saw, sessions outliving a sign-out or a password change, a host-mode CSRF token not bound to its
user, concurrent guesses past the throttle, secret-looking payload fields shown, HTTP 500s on
crafted input); the others held and stay as regressions."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from helpers import ids_by_state, relay_once, sql
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.testclient import TestClient

import outbox
from outbox.consumer import DeliveryResult
from outbox.dashboard import Access, create_app, hash_password

DEST = "billing.charge"
SECRET = "s" * 40
PASSWORDS = {"olga": "operator-pw", "rita": "reader-pw", "pam": "payload-reader-pw"}
HASHES: dict[str, str] = {}


def _hash(user: str) -> str:
    if user not in HASHES:
        HASHES[user] = hash_password(PASSWORDS[user])
    return HASHES[user]


def users_file(**roles: str) -> str:
    return "\n".join(f"{name} {role} {_hash(name)}" for name, role in roles.items())


@pytest.fixture(scope="module")
def users_text() -> str:
    return users_file(olga="operate", rita="read", pam="read+payloads")


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


def declare(provider: Any, **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def write(engine: Any, key: str, payload: dict[str, Any] | None = None, destination: str = DEST) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=destination, payload=payload or {"amount_cents": 500}
        ).id


def token_of(client: TestClient) -> str:
    return _csrf(client.get("/").text)


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


# ================================================================================================
# 5. Crashes: crafted input must be a 4xx, never a 500
# ================================================================================================

HUGE = "9" * 25  # past bigint


def test_row_page_with_an_id_past_bigint_is_404(app: Starlette) -> None:
    r = login(app, "rita").get(f"/rows/{HUGE}")
    assert r.status_code == 404


# Broke before the fix (attack on the dashboard): /batches/{id} with an id past bigint: DataError, 500
def test_batch_page_with_an_id_past_bigint_is_404(app: Starlette) -> None:
    r = login(app, "rita").get(f"/batches/{HUGE}")
    assert r.status_code == 404


# Broke before the fix (attack on the dashboard): /batches?before= digits past bigint: CAST AS bigint
# fails, 500
def test_batches_before_past_bigint_is_not_500(app: Starlette) -> None:
    r = login(app, "rita").get("/batches", params={"before": HUGE})
    assert r.status_code in (200, 400)


# Broke before the fix (attack on the dashboard): a cursor whose value is not a timestamp: CAST AS
# timestamptz fails, 500
def test_rows_cursor_with_a_bad_timestamp_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "after": "not-a-time|1"})
    assert r.status_code == 400


# Broke before the fix (attack on the dashboard): a cursor whose id is past bigint: DataError is not
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


# Broke before the fix (attack on the dashboard): older_than of a huge duration overflows the SQL interval,
# 500
def test_a_huge_duration_filter_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "older_than": "99999999999999d"})
    assert r.status_code in (200, 400)


# Broke before the fix (attack on the dashboard): older_than of 400 digits parses to float inf: SQL fails, 500
def test_an_infinite_duration_filter_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    r = login(app, "rita").get("/rows", params={"state": "pending", "older_than": "9" * 400})
    assert r.status_code in (200, 400)


# Broke before the fix (attack on the dashboard): pause 'for' of a huge duration overflows the SQL
# interval, 500
def test_pause_for_a_huge_duration_is_400(app: Starlette, engine: Any) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "x", "for": "99999999999999d", "csrf_token": token_of(client)},
    )
    assert r.status_code in (200, 400)


# Broke before the fix (attack on the dashboard): a NUL byte in a search/filter term reaches PostgreSQL
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


# Broke before the fix (attack on the dashboard): '²'.isdigit() is True but int('²') raises: preview/apply
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


# Broke before the fix (attack on the dashboard): an id past bigint in a preview/confirm form: DataError, 500
@pytest.mark.parametrize("action", ["replay", "cancel", "resolve-failed"])
def test_an_id_past_bigint_in_a_preview_is_400(app: Starlette, action: str) -> None:
    client = login(app, "olga")
    r = client.post("/preview", data={"action": action, "id": HUGE, "csrf_token": token_of(client)})
    assert r.status_code == 400


# Broke before the fix (attack on the dashboard): non-ASCII CSRF token: hmac.compare_digest raises
# TypeError on str, 500
def test_a_non_ascii_csrf_token_is_403_not_500(app: Starlette) -> None:
    client = login(app, "olga")
    r = client.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": "é"})
    assert r.status_code == 403


# Broke before the fix (attack on the dashboard): non-ASCII CSRF token on the (unauthenticated) login form:
# 500
def test_a_non_ascii_csrf_token_on_login_is_403_not_500(app: Starlette) -> None:
    client = client_for(app)
    client.get("/login")
    r = client.post("/login", data={"user": "olga", "password": "x", "csrf_token": "é"})
    assert r.status_code == 403


# Broke before the fix (attack on the dashboard): non-ASCII session cookie MAC: hmac.compare_digest
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


# ================================================================================================
# 3. Authentication, roles, CSRF, sessions, throttle
# ================================================================================================


# Broke before the fix (attack on the dashboard): stateless session: a cookie copied before logout still
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


# Broke before the fix (attack on the dashboard): the session names only the user: a password reset does
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
    r = c2.post("/preview", data={"action": "cancel", "id": "1", "csrf_token": _csrf(page.text)})
    assert r.status_code == 403


def test_forged_and_cross_secret_cookies_are_refused(app: Starlette, clean: Any, engine: Any) -> None:
    import base64
    import json

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
    cookie, token = attacker.cookies.get("outbox_login"), _csrf(planted.text)
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
        data={"user": "rita", "password": PASSWORDS["rita"], "csrf_token": _csrf(page.text), "next": nxt},
    )
    assert r.status_code == 303
    location = r.headers["location"]
    assert "\r" not in location and "\n" not in location
    normalized = re.sub(r"[\t\r\n]", "", location).replace("\\", "/")
    assert normalized.startswith("/") and not normalized.startswith("//"), location


# Broke before the fix (attack on the dashboard): throttle checks retry_after before the (slow) password
# check and records the failure after: concurrent guesses all pass the check
def test_concurrent_guesses_do_not_get_past_the_throttle(app: Starlette) -> None:
    attempts = 24
    clients = []
    for _ in range(attempts):
        c = client_for(app)
        clients.append((c, _csrf(c.get("/login").text)))
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


# Broke before the fix (attack on the dashboard): Throttle.retry_after setdefault()s an entry per user
# name, even when refused 429: unbounded memory keyed by attacker-chosen names
def test_the_throttle_does_not_keep_what_unknown_names_send(app: Starlette) -> None:
    client = client_for(app)
    token = _csrf(client.get("/login").text)
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
    token = _csrf(client.get("/login").text)
    for i in range(5):
        assert (
            client.post("/login", data={"user": "olga", "password": f"g{i}", "csrf_token": token}).status_code
            == 401
        )
    # Another session (the same client address) and a user name alias do not reset the count.
    other = client_for(app)
    t2 = _csrf(other.get("/login").text)
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
    t3 = _csrf(other.get("/login").text)
    assert (
        other.post(
            "/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": t3}
        ).status_code
        == 429
    )


# -- the host application's authorize hook -----------------------------------------------------------


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


# Broke before the fix (attack on the dashboard): with authorize=, the CSRF session is not bound to the
# user: a cookie+token pair minted for one user (e.g. an attacker's own, planted by cookie tossing) is
# accepted for an operator
def test_host_mode_csrf_token_of_another_user_is_refused(engine: Any, clean: Any) -> None:
    row = write(engine, "order:1")
    app = host_app(engine)
    attacker = client_for(app)
    page = attacker.get("/outbox/", headers={"x-user": "mallory", "x-role": "read"})
    cookie, token = attacker.cookies.get("outbox_session"), _csrf(page.text)
    # The operator's browser carries the planted cookie and posts the attacker's form.
    victim = client_for(app)
    r = victim.post(
        "/outbox/preview",
        data={"action": "cancel", "id": str(row), "csrf_token": token},
        headers={"x-user": "olga", "x-role": "operate", "cookie": f"outbox_session={cookie}"},
    )
    assert r.status_code == 403


# ================================================================================================
# 1. / 2. Actions: exactly the previewed rows, and the CLI's rules
# ================================================================================================


def _failed_rows(engine: Any, clean: Any, provider: Any, consumer: Any) -> tuple[int, int]:
    declare(provider)
    declined = write(engine, "order:100")
    ambiguous = write(engine, "order:101")
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(declined, DEST) is DeliveryResult.FAILED
    provider.drop_after_charge(times=1)
    assert consumer().deliver(ambiguous, DEST) is DeliveryResult.UNKNOWN
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, ambiguous, failed_reason="support gave up", by="test")
    return declined, ambiguous


def test_tampered_confirm_forms_act_on_nothing_unpreviewed(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declined, ambiguous = _failed_rows(engine, clean, provider, consumer)
    other = write(engine, "order:102")  # pending
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/preview", data={"action": "replay", "id": [str(declined)], "csrf_token": token})
    form = confirm_form(preview.text)
    # Another action with the same fingerprint.
    r = client.post("/apply", data={**form, "action": "cancel", "reason": "x"})
    assert "changed since the preview" in r.text
    # Extra ids: the refused one, a pending one, duplicates, unicode digits.
    r = client.post(
        "/apply",
        data={**form, "id": [str(declined), str(ambiguous), str(other), str(declined), "0"], "reason": "x"},
    )
    assert ids_by_state(clean)["failed"] >= {ambiguous}
    assert other in ids_by_state(clean)["pending"]
    # No id at all, empty fingerprint.
    r = client.post("/apply", data={**form, "id": [], "reason": "x"})
    assert r.status_code == 400
    r = client.post("/apply", data={**form, "fingerprint": "", "reason": "x"})
    assert "changed since the preview" in r.text
    # Cancel of the ambiguous failed row: not pending, refused.
    p = client.post("/preview", data={"action": "cancel", "id": str(ambiguous), "csrf_token": token})
    assert "0 row(s) will be acted on" in p.text
    # resolve-failed of a failed row: refused.
    p = client.post("/preview", data={"action": "resolve-failed", "id": str(ambiguous), "csrf_token": token})
    assert "0 row(s) will be acted on" in p.text
    assert ambiguous in ids_by_state(clean)["failed"]


def test_never_in_bulk_and_never_the_refused_replay(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    _declined, ambiguous = _failed_rows(engine, clean, provider, consumer)
    client = login(app, "olga")
    token = token_of(client)
    for action in ("resolve-sent", "resolve-not-sent", "replay-force", "force", "resolve", "skip", "repair"):
        r = client.post("/preview", data={"action": action, "state": "unknown", "csrf_token": token})
        assert r.status_code == 400, action
        r = client.post(
            "/apply",
            data={
                "action": action,
                "id": str(ambiguous),
                "fingerprint": "x",
                "reason": "x",
                "csrf_token": token,
            },
        )
        assert r.status_code in (400, 200) and ambiguous in ids_by_state(clean)["failed"], action
    # A force flag in the form is ignored.
    preview = client.post(
        "/preview", data={"action": "replay", "id": str(ambiguous), "force": "1", "csrf_token": token}
    )
    assert "0 row(s) will be acted on; 1 refused" in preview.text
    r = client.post(
        "/apply",
        data={
            "action": "replay",
            "id": str(ambiguous),
            "fingerprint": confirm_form(preview.text).get("fingerprint", ""),
            "force": "yes",
            "reason": "x",
            "csrf_token": token,
        },
    )
    assert ambiguous in ids_by_state(clean)["failed"]


def test_resolve_one_row_follows_the_cli_rules(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:300")
    pending = write(engine, "order:301")
    client = login(app, "olga")
    token = token_of(client)
    # Not unknown: refused.
    r = client.post(f"/rows/{pending}/resolve", data={"how": "not-sent", "reason": "x", "csrf_token": token})
    assert r.status_code == 409
    # sent with a blank ref: refused.
    r = client.post(
        f"/rows/{row}/resolve", data={"how": "sent", "ref": "  ", "reason": "x", "csrf_token": token}
    )
    assert r.status_code == 409
    # Two "how"s: only the first is read.
    r = client.post(
        f"/rows/{row}/resolve",
        data={"how": ["bogus", "sent"], "ref": "ch", "reason": "x", "csrf_token": token},
    )
    assert r.status_code == 400
    assert row in ids_by_state(clean)["unknown"]


# Broke before the fix (attack on the dashboard): the row page's resolve form carries no version of the
# unknown episode it showed: a 'not sent' meant for one ambiguous call settles a later one (a second charge
# re-run)
def test_resolve_not_sent_from_a_stale_page_does_not_settle_a_newer_ambiguous_call(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider, max_attempts=5)
    row = _unknown_row(engine, clean, provider, consumer, "order:310")
    client = login(app, "olga")
    page = client.get(f"/rows/{row}")
    form_html = re.search(r'<form method="post" action="/rows/\d+/resolve".*?</form>', page.text, re.S).group(
        0
    )  # type: ignore[union-attr]
    hidden = dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form_html))
    # Meanwhile: another operator settles that call not-sent (CLI); the row runs again and its
    # new call is ambiguous too (the provider may have charged).
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, row, not_sent=True, by="cli", reason="provider has nothing")
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    # The first operator now confirms what they saw on the old page.
    r = client.post(
        f"/rows/{row}/resolve", data={**hidden, "how": "not-sent", "reason": "provider has nothing"}
    )
    assert r.status_code == 409
    assert row in ids_by_state(clean)["unknown"]


def test_a_row_moved_between_preview_and_confirm_stops_the_cancel(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider, idempotent=True, max_attempts=3, backoff=(600,))
    row = write(engine, "order:400")
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/preview", data={"action": "cancel", "id": str(row), "csrf_token": token})
    assert "1 row(s) will be acted on" in preview.text
    form = confirm_form(preview.text)
    # Published, claimed, ambiguous; retried: pending again, with a call that may have charged.
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.PENDING
    r = client.post("/apply", data={**form, "reason": "customer left"})
    assert r.status_code in (200, 400)
    assert row in ids_by_state(clean)["pending"]


def test_a_filter_preview_of_another_destination_or_state_acts_only_on_what_it_named(
    app: Starlette, engine: Any, clean: Any
) -> None:
    a = write(engine, "order:500")
    b = write(engine, "order:501", destination="mail.send")
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post(
        "/preview", data={"action": "cancel", "state": "pending", "destination": DEST, "csrf_token": token}
    )
    assert "1 row(s) will be acted on; 0 refused" in preview.text
    form = confirm_form(preview.text)
    assert form["id"] == [str(a)]
    # New row written between preview and confirm, same filter: untouched.
    c = write(engine, "order:502")
    client.post("/apply", data={**form, "reason": "x"})
    assert ids_by_state(clean)["cancelled"] == {a}
    assert {b, c} <= ids_by_state(clean)["pending"]
    # A filter with a key prefix containing LIKE wildcards takes them literally.
    write(engine, "orderX500")
    p = client.post(
        "/preview", data={"action": "cancel", "state": "pending", "key_prefix": "order_", "csrf_token": token}
    )
    assert p.status_code == 400  # "order_" is a literal prefix: no row


# ================================================================================================
# 4. Leaks and XSS
# ================================================================================================

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


# Broke before the fix (attack on the dashboard): the row page lists payload_keys (jsonb_object_keys) raw,
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


# ================================================================================================
# 1. Repair: the confirmation carries no fingerprint of the plan it confirms
# ================================================================================================


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


def _claimed_then_unknown(clean: Any, row: int) -> None:
    """The worker died after its claim (no call reached the provider); the lease ran out: unknown."""
    import psycopg
    from helpers import elapse

    from outbox import store
    from outbox.handlers import registry
    from outbox.reconciler.jobs.expire_leases import expire_leases
    from outbox.settings import libpq_url

    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.claim(conn, row_id=row, destination=DEST, lease_seconds=5)
        elapse(conn, 6, [row])
        assert expire_leases(conn, registry()) == 1
        elapse(conn, 120, [row])  # no call can still be landing


# Broke before the fix (attack on the dashboard): POST /keys/repair confirm=yes re-plans from the key
# (app.py repair): the confirmation carries no fingerprint, so it acts on a plan the operator never saw
# (here it re-runs a row another operator failed on purpose)
def test_repair_confirm_acts_only_on_the_previewed_plan(
    clean: Any, engine: Any, users_text: str, provider: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare(provider), provider)
    row = write(engine, "order:700")
    _claimed_then_unknown(clean, row)
    app = _repair_app(clean, engine, users_text)
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/keys/repair", data={"key": "order:700", "csrf_token": token})
    assert preview.status_code == 200 and "Confirm the repair" in preview.text, preview.text
    assert "unknown" in preview.text or "ask the provider" in preview.text
    hidden = dict(
        re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', preview.text.split('class="confirm"')[1])
    )
    # Meanwhile another operator gives up on the row (support refunded the customer by hand).
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, row, failed_reason="refunded by hand: never charge", by="cli")
    r = client.post("/keys/repair", data={**hidden, "reason": "INC-1"})
    assert r.status_code in (200, 400, 409)
    assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,)) == [("failed",)]


def test_repair_of_a_key_needs_an_operator_and_a_reason(
    clean: Any, engine: Any, users_text: str, provider: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare(provider), provider)
    row = write(engine, "order:701")
    _claimed_then_unknown(clean, row)
    app = _repair_app(clean, engine, users_text)
    reader = login(app, "rita")
    r = reader.post(
        "/keys/repair",
        data={"key": "order:701", "confirm": "yes", "reason": "x", "csrf_token": token_of(reader)},
    )
    assert r.status_code == 403
    olga = login(app, "olga")
    r = olga.post(
        "/keys/repair",
        data={"key": "order:701", "confirm": "yes", "reason": " ", "csrf_token": token_of(olga)},
    )
    assert r.status_code == 400
    assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,)) == [("unknown",)]


# ================================================================================================
# 5. Rows written by plain SQL (the contract allows any language): odd payloads
# ================================================================================================


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
