"""The web dashboard (issue 16) against real PostgreSQL: authentication (its own users and a host
app's hook), roles, CSRF, cookies and headers, search, the pages, and the actions with their
previews, which must follow exactly the CLI's rules (they call the same code)."""

from __future__ import annotations

import itertools
import re
import time
from datetime import datetime
from http.cookies import SimpleCookie
from typing import Any
from xml.etree import ElementTree

import pytest
from helpers import elapse, ids_by_state, relay_once, sql
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

import outbox
from outbox.consumer import DeliveryResult
from outbox.dashboard import Access, chart, create_app, hash_password, queries
from outbox.dashboard.security import parse_users
from outbox.exceptions import ConfigError

DEST = "billing.charge"
SECRET = "s" * 40
PASSWORDS = {"olga": "operator-pw", "rita": "reader-pw", "pam": "payload-reader-pw"}


@pytest.fixture(scope="module")
def users_text() -> str:
    return "\n".join(
        [
            "# name role hash",
            f"olga operate {hash_password(PASSWORDS['olga'])}",
            f"rita read {hash_password(PASSWORDS['rita'])}",
            f"pam read+payloads {hash_password(PASSWORDS['pam'])}",
        ]
    )


@pytest.fixture
def app(clean: Any, engine: Any, users_text: str) -> Starlette:
    return create_app(engine=engine, secret=SECRET, users=users_text)


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def login(app: Starlette, user: str, *, base: str = "https://testserver") -> TestClient:
    client = TestClient(app, base_url=base, follow_redirects=False)
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


def write(engine: Any, key: str, payload: dict[str, Any] | None = None) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=DEST, payload=payload or {"amount_cents": 500}
        ).id


# -- configuration -----------------------------------------------------------------------------------


def test_nothing_is_served_without_authentication(engine: Any, users_text: str) -> None:
    with pytest.raises(ConfigError, match="without authentication"):
        create_app(engine=engine, secret=SECRET)
    with pytest.raises(ConfigError, match="at least 32"):
        create_app(engine=engine, secret="short", users=users_text)
    with pytest.raises(ConfigError, match="never a password"):
        parse_users("olga operate hunter2")
    with pytest.raises(ConfigError, match="role"):
        parse_users(f"olga admin {hash_password('x')}")


# -- login, session, cookies, headers ----------------------------------------------------------------


def test_pages_need_a_login_and_carry_the_security_headers(app: Starlette) -> None:
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)
    r = client.get("/rows?state=failed")
    assert r.status_code == 303
    assert r.headers["location"].startswith("/login?next=")
    assert client.post("/apply", data={"action": "replay"}).status_code == 401
    page = client.get("/login")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/static/htmx.min.js").headers["content-security-policy"] == csp


def test_login_starts_a_new_session_with_strict_cookies(app: Starlette) -> None:
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)
    page = client.get("/login")
    before = page.cookies.get("outbox_login")
    r = client.post(
        "/login", data={"user": "olga", "password": "operator-pw", "csrf_token": _csrf(page.text)}
    )
    assert r.status_code == 303
    (header,) = [h for h in r.headers.get_list("set-cookie") if h.startswith("outbox_session=")]
    assert (
        "HttpOnly" in header
        and "SameSite=strict" in header.replace("Strict", "strict")
        and "Secure" in header
    )
    after = SimpleCookie(header)["outbox_session"].value
    assert after != before
    home = client.get("/")
    assert home.status_code == 200 and "olga" in home.text
    # The pre-login token is worth nothing after the login.
    assert _csrf(home.text) != _csrf(page.text)


def test_wrong_passwords_are_throttled_even_for_the_right_one(app: Starlette) -> None:
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)
    page = client.get("/login")
    token = _csrf(page.text)
    for _ in range(5):
        r = client.post("/login", data={"user": "olga", "password": "guess", "csrf_token": token})
        assert r.status_code == 401
    r = client.post("/login", data={"user": "olga", "password": "operator-pw", "csrf_token": token})
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    # An unknown user is refused like a wrong password (no enumeration).
    other = TestClient(app, base_url="https://testserver", follow_redirects=False)
    p2 = other.get("/login")
    assert other.post(
        "/login", data={"user": "nobody", "password": "x", "csrf_token": _csrf(p2.text)}
    ).status_code in (
        401,
        429,
    )


def test_login_redirects_only_within_the_app(app: Starlette) -> None:
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)
    page = client.get("/login")
    data = {"user": "rita", "password": "reader-pw", "csrf_token": _csrf(page.text)}
    r = client.post("/login", data={**data, "next": "//evil.example/x"})
    assert r.headers["location"] == "/"


def test_insecure_cookies_only_when_asked(engine: Any, users_text: str, clean: Any) -> None:
    app = create_app(engine=engine, secret=SECRET, users=users_text, secure_cookies=False)
    client = TestClient(app, base_url="http://testserver", follow_redirects=False)
    page = client.get("/login")
    r = client.post("/login", data={"user": "rita", "password": "reader-pw", "csrf_token": _csrf(page.text)})
    assert "Secure" not in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]


def test_a_post_without_the_csrf_token_is_refused(app: Starlette, engine: Any, provider: Any) -> None:
    declare(provider)
    row = write(engine, "order:1")
    client = login(app, "olga")
    r = client.post("/preview", data={"action": "cancel", "id": str(row)})
    assert r.status_code == 403 and "CSRF" in r.text
    # Another session's token is no better.
    other = login(app, "olga")
    token = _csrf(other.get("/").text)
    assert (
        client.post("/preview", data={"action": "cancel", "id": str(row), "csrf_token": token}).status_code
        == 403
    )
    assert ids_by_state(app_services(engine))["pending"] == {row}


def app_services(engine: Any) -> Any:
    class _S:
        database_url = engine.url.render_as_string(hide_password=False)

    return _S()


# -- roles -------------------------------------------------------------------------------------------


def test_a_reader_cannot_act_and_does_not_see_payloads(app: Starlette, engine: Any) -> None:
    row = write(engine, "order:7", {"amount_cents": 900, "card_token": "tok_visa_4242", "note": "hello"})
    reader = login(app, "rita")
    page = reader.get(f"/rows/{row}")
    assert page.status_code == 200
    assert "hello" not in page.text and "payload is hidden" in page.text
    assert "Cancel…" not in page.text
    r = reader.post("/preview", data={"action": "cancel", "id": str(row), "csrf_token": _csrf(page.text)})
    assert r.status_code == 403
    r = reader.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "x", "csrf_token": _csrf(page.text)},
    )
    assert r.status_code == 403
    # Granted payloads: shown, with the secret-looking field redacted.
    shown = login(app, "pam").get(f"/rows/{row}")
    assert "hello" in shown.text and "tok_visa_4242" not in shown.text and "***" in shown.text


# -- search ------------------------------------------------------------------------------------------


def test_search_by_id_key_idempotency_key_reference_and_prefix(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    sent = write(engine, "order:42")
    other = write(engine, "order:43")
    relay_once(clean)
    assert consumer().deliver(sent, DEST) is DeliveryResult.SENT
    ref = sql(clean, "SELECT provider_ref FROM outbox_message WHERE id = %s", (sent,))[0][0]
    client = login(app, "rita")

    def lands(q: str) -> str:
        r = client.get("/search", params={"q": q})
        assert r.status_code == 303, (q, r.text)
        return r.headers["location"]

    assert lands(str(other)) == f"/rows/{other}"
    assert lands("order:42") == "/keys?key=order%3A42"
    assert lands("order:42:charge") == f"/rows/{sent}"
    assert lands(ref) == f"/rows/{sent}"
    assert lands("order:4") == "/rows?key_prefix=order%3A4"
    listed = client.get("/rows", params={"key_prefix": "order:4"}).text
    assert f"/rows/{sent}" in listed and f"/rows/{other}" in listed
    # A key's page: its steps with their milestones.
    key_page = client.get("/keys", params={"key": "order:42"}).text
    assert ref in key_page and "Every step confirmed" in key_page
    row_page = client.get(f"/rows/{sent}").text
    assert "succeeded" in row_page or "sent" in row_page
    assert ref in row_page


def test_lists_page_with_a_keyset_cursor(app: Starlette, engine: Any) -> None:
    ids = [write(engine, f"page:{i:03d}") for i in range(120)]
    client = login(app, "rita")
    seen: list[int] = []
    url = "/rows?state=pending"
    for _ in range(5):
        page = client.get(url)
        seen += [int(i) for i in re.findall(r'<td><a href="/rows/(\d+)">', page.text)]
        nxt = re.search(r'rel="next" href="([^"]+)"', page.text)
        if not nxt:
            break
        url = nxt.group(1).replace("&amp;", "&")
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen)) == 120


def test_a_bad_filter_is_a_clear_400(app: Starlette) -> None:
    client = login(app, "rita")
    r = client.get("/rows", params={"state": "lost"})
    assert r.status_code == 400 and "unknown state" in r.text
    r = client.get("/rows", params={"state": "failed", "older_than": "soon"})
    assert r.status_code == 400 and "duration" in r.text


# -- actions -----------------------------------------------------------------------------------------


def _failed_rows(engine: Any, clean: Any, provider: Any, consumer: Any) -> tuple[int, int]:
    """One row failed for a certain reason (declined: replayable), one failed by an operator out
    of unknown (its call may have taken effect: the replay rules refuse it)."""
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


def test_bulk_replay_previews_then_acts_on_exactly_the_previewed_rows(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declined, ambiguous = _failed_rows(engine, clean, provider, consumer)
    client = login(app, "olga")
    listing = client.get("/rows", params={"state": "failed", "destination": DEST})
    preview = client.post(
        "/preview",
        data={"action": "replay", "state": "failed", "destination": DEST, "csrf_token": _csrf(listing.text)},
    )
    assert preview.status_code == 200, preview.text
    assert "Nothing has been done yet" in preview.text
    assert "1 row(s) will be acted on; 1 refused" in preview.text
    assert "could charge twice" in preview.text  # the CLI's refusal text, word for word
    assert ids_by_state(clean)["failed"] == {declined, ambiguous}
    form = dict(re.findall(r'name="(action|fingerprint|csrf_token)" value="([^"]*)"', preview.text))
    ids = re.findall(r'name="id" value="(\d+)"', preview.text)
    done = client.post("/apply", data={**form, "id": ids, "reason": "card updated"})
    assert done.status_code == 200, done.text
    assert ids_by_state(clean)["pending"] == {declined}
    assert ids_by_state(clean)["failed"] == {ambiguous}
    [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (declined,))
    assert history[-1]["by"] == "olga (dashboard)" and history[-1]["reason"] == "card updated"


def test_a_confirmation_after_the_rows_changed_does_nothing(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declined, _ = _failed_rows(engine, clean, provider, consumer)
    client = login(app, "olga")
    token = _csrf(client.get("/").text)
    preview = client.post("/preview", data={"action": "replay", "id": str(declined), "csrf_token": token})
    fingerprint = re.search(r'name="fingerprint" value="([^"]+)"', preview.text).group(1)  # type: ignore[union-attr]
    # It is replayed, delivered, declined again: a different failure than the one previewed.
    with engine.begin() as c:
        outbox.ops.actions.replay(c, [declined], by="cli", reason="meanwhile")
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(declined, DEST) is DeliveryResult.FAILED
    done = client.post(
        "/apply",
        data={
            "action": "replay",
            "id": str(declined),
            "fingerprint": fingerprint,
            "reason": "x",
            "csrf_token": token,
        },
    )
    assert "changed since the preview" in done.text
    assert ids_by_state(clean)["failed"] >= {declined}


def test_an_action_needs_a_reason(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declined, _ = _failed_rows(engine, clean, provider, consumer)
    client = login(app, "olga")
    token = _csrf(client.get("/").text)
    preview = client.post("/preview", data={"action": "replay", "id": str(declined), "csrf_token": token})
    fingerprint = re.search(r'name="fingerprint" value="([^"]+)"', preview.text).group(1)  # type: ignore[union-attr]
    r = client.post(
        "/apply",
        data={
            "action": "replay",
            "id": str(declined),
            "fingerprint": fingerprint,
            "reason": " ",
            "csrf_token": token,
        },
    )
    assert r.status_code == 400 and "reason" in r.text
    assert ids_by_state(clean)["failed"] >= {declined}


def test_bulk_cancel_refuses_a_row_whose_call_may_have_taken_effect(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    # Idempotent: an ambiguous answer is retried, so the row is pending again with an attempt row
    # whose call may have taken effect.
    declare(provider, idempotent=True, max_attempts=3, backoff=(600,))
    touched = write(engine, "order:201")
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(touched, DEST) is DeliveryResult.PENDING
    fresh = write(engine, "order:200")
    client = login(app, "olga")
    token = _csrf(client.get("/").text)
    preview = client.post(
        "/preview", data={"action": "cancel", "state": "pending", "destination": DEST, "csrf_token": token}
    )
    assert "1 row(s) will be acted on; 1 refused" in preview.text, preview.text
    assert "may have taken effect" in preview.text
    form = dict(re.findall(r'name="(action|fingerprint|csrf_token)" value="([^"]*)"', preview.text))
    ids = re.findall(r'name="id" value="(\d+)"', preview.text)
    client.post("/apply", data={**form, "id": ids, "reason": "customer left"})
    assert ids_by_state(clean)["cancelled"] == {fresh}
    assert touched in ids_by_state(clean)["pending"]


def test_resolve_one_row_sent_and_bulk_resolve_failed(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    a, b, c = (write(engine, f"order:30{i}") for i in range(3))
    relay_once(clean)
    for row in (a, b, c):
        provider.drop_after_charge(times=1)
        assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    client = login(app, "olga")
    page = client.get(f"/rows/{a}").text
    token = _csrf(page)
    # The form names the unknown episode the page showed (its unknown_since).
    version = re.search(r'name="version" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    form = {"how": "sent", "ref": "ch_manual_1", "reason": "seen in the provider's UI", "csrf_token": token}
    assert client.post(f"/rows/{a}/resolve", data=form).status_code == 409
    r = client.post(f"/rows/{a}/resolve", data={**form, "version": version})
    assert r.status_code == 200 and "unknown -&gt; sent" in r.text
    assert sql(clean, "SELECT state, provider_ref FROM outbox_message WHERE id = %s", (a,)) == [
        ("sent", "ch_manual_1")
    ]
    preview = client.post(
        "/preview", data={"action": "resolve-failed", "state": "unknown", "csrf_token": token}
    )
    assert "2 row(s) will be acted on" in preview.text
    form = dict(re.findall(r'name="(action|fingerprint|csrf_token)" value="([^"]*)"', preview.text))
    ids = re.findall(r'name="id" value="(\d+)"', preview.text)
    client.post("/apply", data={**form, "id": ids, "reason": "provider cannot tell"})
    assert ids_by_state(clean)["failed"] == {b, c}
    # Never in bulk: --sent and --not-sent have no bulk form.
    bulk = client.post("/preview", data={"action": "resolve-sent", "state": "unknown", "csrf_token": token})
    assert bulk.status_code == 400


def test_pause_and_resume_a_destination(app: Starlette, engine: Any, clean: Any) -> None:
    write(engine, "order:500")
    client = login(app, "olga")
    token = _csrf(client.get("/").text)
    r = client.post(
        "/destinations/pause", data={"destination": DEST, "reason": "provider outage", "csrf_token": token}
    )
    assert r.status_code == 200, r.text
    assert sql(clean, "SELECT paused_by, pause_reason FROM outbox_destination") == [
        ("olga (dashboard)", "provider outage")
    ]
    assert "provider outage" in client.get("/").text
    client.post("/destinations/resume", data={"destination": DEST, "csrf_token": token})
    assert "provider outage" not in client.get("/").text
    r = client.post("/destinations/pause", data={"destination": "nope", "reason": "x", "csrf_token": token})
    assert r.status_code == 404


def test_overview_counts_and_the_last_hour(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    rows = [write(engine, f"order:6{i:02d}") for i in range(5)]
    relay_once(clean)
    for row in rows[:3]:
        assert consumer().deliver(row, DEST) is DeliveryResult.SENT
    page = login(app, "rita").get("/").text
    assert DEST in page
    assert re.search(r"state=sent&amp;destination=billing.charge\">3</a>", page), page
    assert re.search(r"state=dispatched&amp;destination=billing.charge\">2</a>", page)
    assert "confirmed/s" in page and "Nothing confirmed in the last hour" not in page


def _confirm(engine: Any, clean: Any, provider: Any, consumer: Any, keys: list[str]) -> list[int]:
    """The rows written and confirmed now, within one minute of the database's clock (the chart
    puts each minute's bar at its place)."""
    declare(provider)
    rows = [write(engine, key) for key in keys]
    relay_once(clean)
    [(second,)] = sql(clean, "SELECT EXTRACT(SECOND FROM clock_timestamp())::float8")
    if second > 45:
        time.sleep(60.5 - second)
    deliverer = consumer()
    for row in rows:
        assert deliverer.deliver(row, DEST) is DeliveryResult.SENT
    return rows


def test_the_confirmed_tile_is_the_last_minutes_rate(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    rows = _confirm(engine, clean, provider, consumer, [f"order:8{i:02d}" for i in range(15)])
    # Three of them confirmed 20 minutes ago: in the hour, not in the last minute.
    elapse(clean, 20 * 60, rows[:3])
    page = login(app, "rita").get("/").text
    tile = re.search(r'id="confirmed-rate"><b>([^<]*)</b> confirmed/s\s*<small>(.*?)</small>', page, re.S)
    assert tile, page
    assert float(tile.group(1)) == pytest.approx(12 / 60)
    assert "last 60 s: 12 rows" in tile.group(2)
    assert re.search(r"last hour 0\.0042/s", tile.group(2)), tile.group(2)
    # With a sample smaller than the minute's rows, the rate is that of the newest, marked.
    with engine.connect() as conn:
        sampled = queries.recent(conn, sample=5)
        counted = queries.recent(conn)
    assert (counted.confirmed, counted.estimated, counted.per_second) == (12, False, 12 / 60)
    assert sampled.estimated and sampled.confirmed == 5 and sampled.per_second > 12 / 60


def test_the_last_hour_chart_has_a_time_axis_and_a_count_axis(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    rows = _confirm(engine, clean, provider, consumer, [f"order:9{i:02d}" for i in range(15)])
    elapse(clean, 20 * 60, rows[:3])
    page = login(app, "rita").get("/").text
    svg = ElementTree.fromstring(re.search(r'<svg class="chart".*?</svg>', page, re.S).group(0))  # type: ignore[union-attr]
    axes = {g.get("class"): g for g in svg.iter("g")}
    times = [t.text or "" for t in axes["axis time"].iter("text")]
    # Every 15 minutes over the hour, then the axis's title with the time zone.
    assert len(times) == 6 and times[-1].startswith("time ("), times
    marks = [datetime.strptime(t, "%H:%M") for t in times[:-1]]
    assert [round((b - a).total_seconds()) % 86400 for a, b in itertools.pairwise(marks)] == [900] * 4
    counts = [t.text for t in axes["axis count"].iter("text")]
    # 12 rows at the peak: round steps of 5 up to 15, from 0, and the unit.
    assert counts == ["0", "5", "10", "15", "rows/min"], counts
    bars = sorted(float(r.get("x") or 0) for r in svg.iter("rect"))
    assert len(bars) == 2, bars
    # Each minute at its place in the hour: 20 minutes (10 units each) apart, the newest last.
    assert bars[1] - bars[0] == pytest.approx(200)
    assert bars[1] >= chart.LEFT + 58 * 10
    heights = {float(r.get("x") or 0): float(r.get("height") or 0) for r in svg.iter("rect")}
    assert heights[bars[1]] == pytest.approx(12 / 15 * chart.PLOT_HEIGHT)
    assert heights[bars[0]] == pytest.approx(3 / 15 * chart.PLOT_HEIGHT)


# -- mounted in a host application with its own authentication -------------------------------------


def host_app(engine: Any, role_by_header: bool = True) -> Starlette:
    def authorize(request: Request) -> Access | tuple[str, str] | None:
        user = request.headers.get("x-user")
        if user is None:
            return None
        return (user, request.headers.get("x-role", "read"))

    async def home(_: Request) -> PlainTextResponse:
        return PlainTextResponse("host")

    dashboard = create_app(engine=engine, secret=SECRET, authorize=authorize)
    return Starlette(routes=[Route("/", home), Mount("/outbox", dashboard)])


def test_mounted_under_a_prefix_with_the_hosts_authorize_hook(engine: Any, clean: Any) -> None:
    row = write(engine, "order:900")
    client = TestClient(host_app(engine), base_url="https://testserver", follow_redirects=False)
    assert client.get("/outbox/").status_code == 401
    assert client.get("/outbox/", headers={"x-user": "eve", "x-role": "none"}).status_code == 403
    page = client.get(f"/outbox/rows/{row}", headers={"x-user": "rita"})
    assert page.status_code == 200 and 'href="/outbox/static/dashboard.css"' in page.text
    cookie = page.headers["set-cookie"]
    assert "Path=/outbox" in cookie and "HttpOnly" in cookie and "Secure" in cookie
    # CSRF applies when mounted too: an operator's POST needs the token of its own session (a
    # token of another user's session is refused: the session is bound to the host's user).
    headers = {"x-user": "olga", "x-role": "operate"}
    rita_token = _csrf(page.text)
    form = {"action": "cancel", "id": str(row)}
    assert client.post("/outbox/preview", data=form, headers=headers).status_code == 403
    assert (
        client.post("/outbox/preview", data={**form, "csrf_token": rita_token}, headers=headers).status_code
        == 403
    )
    token = _csrf(client.get("/outbox/", headers=headers).text)
    r = client.post("/outbox/preview", data={**form, "csrf_token": token}, headers=headers)
    assert r.status_code == 200 and "1 row(s) will be acted on" in r.text
    # A reader with a valid token still cannot act.
    r = client.post(
        "/outbox/preview",
        data={"action": "cancel", "id": str(row), "csrf_token": token},
        headers={"x-user": "rita"},
    )
    assert r.status_code == 403
    # No login page of its own when the host authenticates.
    assert client.get("/outbox/login").status_code == 404


def test_skip_a_failed_head_of_an_ordering_key(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    with Session(engine) as s, s.begin():
        head = outbox.write(
            s, key="c:1", step="charge", destination=DEST, payload={}, ordering_key="customer:1"
        ).id
        behind = outbox.write(
            s, key="c:2", step="charge", destination=DEST, payload={}, ordering_key="customer:1"
        ).id
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(head, DEST) is DeliveryResult.FAILED
    client = login(app, "olga")
    page = client.get(f"/rows/{head}").text
    assert "Skip: let customer:1 go on without it" in page
    blocked = client.get("/blocked").text
    assert f"/rows/{head}" in blocked and "customer:1" in blocked
    token = _csrf(page)
    assert client.post(f"/rows/{head}/skip", data={"reason": " ", "csrf_token": token}).status_code == 409
    r = client.post(
        f"/rows/{head}/skip", data={"reason": "card closed; later updates may go", "csrf_token": token}
    )
    assert r.status_code == 200 and "skipped" in r.text
    assert relay_once(clean) == 1
    assert consumer().deliver(behind, DEST) is DeliveryResult.SENT
    # A reader cannot.
    reader = login(app, "rita")
    assert (
        reader.post(
            f"/rows/{head}/skip", data={"reason": "x", "csrf_token": _csrf(reader.get("/").text)}
        ).status_code
        == 403
    )
