"""The dashboard's login against real PostgreSQL and, for the client address, a real `outbox
dashboard` under uvicorn: the throttle per (user, address) with a per-user slowdown that never
locks a user out, forwarded headers trusted only from the configured proxies, the pre-login state
in a cookie of its own (a navigation to /login signs no one out), and a login over plain HTTP
with Secure cookies refused with its real cause."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import free_port, wait_for
from starlette.applications import Starlette
from starlette.testclient import TestClient

from outbox.cli import main
from outbox.dashboard import create_app, hash_password
from outbox.dashboard.security import Throttle

SECRET = "s" * 40
PASSWORDS = {"olga": "operator-pw", "rita": "reader-pw"}


@pytest.fixture(scope="module")
def users_text() -> str:
    return "\n".join(
        [
            f"olga operate {hash_password(PASSWORDS['olga'])}",
            f"rita read {hash_password(PASSWORDS['rita'])}",
        ]
    )


@pytest.fixture
def app(clean: Any, engine: Any, users_text: str) -> Starlette:
    return create_app(engine=engine, secret=SECRET, users=users_text)


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def client_from(app: Starlette, address: str = "10.0.0.1", *, base: str = "https://testserver") -> TestClient:
    return TestClient(app, base_url=base, client=(address, 40000), follow_redirects=False)


def try_login(c: TestClient, user: str, password: str) -> httpx.Response:
    page = c.get("/login")
    assert page.status_code == 200
    return c.post("/login", data={"user": user, "password": password, "csrf_token": _csrf(page.text)})


# -- the throttle: per (user, address) locks, a per-user slowdown -----------------------------------


def test_five_bad_guesses_lock_that_user_from_that_address_only(app: Starlette) -> None:
    shared = client_from(app, "10.0.0.1")
    for i in range(5):
        assert try_login(shared, "olga", f"guess-{i}").status_code == 401
    # The right password from the guessing address waits out the window ...
    refused = try_login(shared, "olga", PASSWORDS["olga"])
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    # ... but another operator behind the same address is not locked out,
    assert try_login(client_from(app, "10.0.0.1"), "rita", PASSWORDS["rita"]).status_code == 303
    # nor olga herself from her own address.
    assert try_login(client_from(app, "10.0.0.2"), "olga", PASSWORDS["olga"]).status_code == 303
    # Her success forgets nothing of the guessing address's failures.
    assert try_login(shared, "olga", PASSWORDS["olga"]).status_code == 429


def test_the_per_user_slowdown_never_locks_the_user_out(app: Starlette) -> None:
    app.state.dashboard.throttle = Throttle(slow_seconds=0.2, slow_max_seconds=0.4)
    # Olga's browser has signed in before.
    browser = client_from(app, "10.2.0.1")
    assert try_login(browser, "olga", PASSWORDS["olga"]).status_code == 303
    browser.cookies.delete("outbox_session")
    # 20 guesses from four addresses, checked or refused (the name's tries one at a time).
    for address in ("10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"):
        c = client_from(app, address)
        for i in range(5):
            assert try_login(c, "olga", f"guess-{i}").status_code in (401, 429)
    # Her browser: in at once.
    assert try_login(browser, "olga", PASSWORDS["olga"]).status_code == 303
    # Another browser: in, or told to try again within the slowdown's spacing.
    other = client_from(app, "10.2.0.2")
    r = try_login(other, "olga", PASSWORDS["olga"])
    if r.status_code == 429:
        assert 0 < int(r.headers["retry-after"]) <= 1
        time.sleep(0.4)
        r = try_login(other, "olga", PASSWORDS["olga"])
    assert r.status_code == 303


def test_the_slowdown_spaces_guesses_from_many_addresses(app: Starlette) -> None:
    app.state.dashboard.throttle = Throttle(slow_seconds=0.5, slow_max_seconds=0.5)
    for i in range(5):
        assert try_login(client_from(app, f"10.3.0.{i}"), "olga", "guess").status_code == 401
    # Past five failures of the name, one try is checked each 0.5 s: a guesser with a new
    # address per guess gets no more than that, the others are told when to come back.
    started = time.monotonic()
    statuses = [try_login(client_from(app, f"10.4.0.{i}"), "olga", "guess").status_code for i in range(20)]
    took = time.monotonic() - started
    assert set(statuses) <= {401, 429}
    assert statuses[0] == 401
    assert statuses.count(401) <= 1 + took / 0.5, (statuses, took)


def test_concurrent_guesses_from_many_addresses_are_spaced(app: Starlette) -> None:
    app.state.dashboard.throttle = Throttle(slow_seconds=3, slow_max_seconds=3)
    for i in range(5):
        assert try_login(client_from(app, f"10.5.0.{i}"), "olga", "guess").status_code == 401
    clients = [client_from(app, f"10.6.0.{i}") for i in range(6)]
    tokens = [_csrf(c.get("/login").text) for c in clients]
    statuses: list[int] = []
    barrier = threading.Barrier(len(clients))

    def guess(c: TestClient, token: str) -> None:
        barrier.wait()
        statuses.append(
            c.post("/login", data={"user": "olga", "password": "g", "csrf_token": token}).status_code
        )

    threads = [threading.Thread(target=guess, args=(c, t)) for c, t in zip(clients, tokens, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # One checked, the five others refused at once (none waits behind another's guess).
    assert sorted(statuses) == [401] + [429] * 5, statuses


# -- the pre-login cookie ---------------------------------------------------------------------------


def test_a_navigation_to_login_signs_no_one_out(app: Starlette) -> None:
    c = client_from(app)
    assert try_login(c, "olga", PASSWORDS["olga"]).status_code == 303
    signed_in = c.cookies.get("outbox_session")
    # Another site sends the operator's browser to /login (a top-level navigation).
    page = c.get("/login")
    assert page.status_code == 200
    assert "outbox_session" not in page.headers.get("set-cookie", "")
    assert c.cookies.get("outbox_session") == signed_in
    home = c.get("/")
    assert home.status_code == 200 and "olga" in home.text


def test_a_login_over_a_signed_in_session_ends_it(app: Starlette) -> None:
    c = client_from(app)
    assert try_login(c, "olga", PASSWORDS["olga"]).status_code == 303
    replaced = c.cookies.get("outbox_session")
    assert try_login(c, "rita", PASSWORDS["rita"]).status_code == 303
    assert c.cookies.get("outbox_session") != replaced
    # A copy of the replaced cookie is worth nothing now.
    r = client_from(app, "10.9.9.9").get("/", headers={"cookie": f"outbox_session={replaced}"})
    assert r.status_code == 303 and "/login" in r.headers["location"]
    assert "rita" in c.get("/").text


def test_the_login_cookie_is_not_a_session(app: Starlette) -> None:
    c = client_from(app)
    c.get("/login")
    pending = c.cookies.get("outbox_login")
    assert pending
    r = client_from(app).get("/", headers={"cookie": f"outbox_session={pending}"})
    assert r.status_code == 303 and "/login" in r.headers["location"]


# -- plain HTTP with Secure cookies -----------------------------------------------------------------


def test_a_login_over_plain_http_names_the_secure_cookies(app: Starlette) -> None:
    c = client_from(app, base="http://testserver")
    r = try_login(c, "olga", PASSWORDS["olga"])  # the Secure pre-login cookie does not come back
    assert r.status_code == 403
    assert "Secure" in r.text and "plain HTTP" in r.text and "HTTPS" in r.text
    assert "OUTBOX_DASHBOARD_INSECURE_COOKIES" in r.text
    # Over HTTPS, a form posted without its cookie is the usual CSRF refusal.
    r = client_from(app).post("/login", data={"user": "olga", "password": "x", "csrf_token": "x"})
    assert r.status_code == 403 and "plain HTTP" not in r.text


def _serve_args(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, users_text: str, *args: str
) -> dict[str, Any]:
    import uvicorn

    served: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(kwargs))
    users = tmp_path / "users"
    users.write_text(users_text)
    monkeypatch.setenv("OUTBOX_DASHBOARD_SECRET", SECRET)
    assert main(["dashboard", "--users", str(users), *args]) == 0
    return served


def test_a_warning_at_start_for_secure_cookies_over_plain_http(
    clean: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, users_text: str, capsys: Any
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
    monkeypatch.delenv("OUTBOX_DASHBOARD_TRUSTED_PROXIES", raising=False)
    monkeypatch.delenv("OUTBOX_DASHBOARD_INSECURE_COOKIES", raising=False)
    _serve_args(monkeypatch, tmp_path, users_text, "--host", "192.0.2.10")
    err = capsys.readouterr().err
    assert "plain HTTP" in err and "Secure" in err and "OUTBOX_DASHBOARD_INSECURE_COOKIES" in err
    # Not on loopback (browsers return Secure cookies to localhost), nor with insecure cookies.
    for args in (("--host", "127.0.0.1"), ("--host", "192.0.2.10", "--insecure-cookies")):
        _serve_args(monkeypatch, tmp_path, users_text, *args)
        assert "plain HTTP" not in capsys.readouterr().err, args


def test_forwarded_headers_are_trusted_only_from_the_configured_proxies(
    clean: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, users_text: str
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", clean.database_url)
    monkeypatch.delenv("OUTBOX_DASHBOARD_TRUSTED_PROXIES", raising=False)
    served = _serve_args(monkeypatch, tmp_path, users_text)
    assert served["proxy_headers"] is False
    monkeypatch.setenv("OUTBOX_DASHBOARD_TRUSTED_PROXIES", "10.0.0.5, 10.1.0.0/16")
    served = _serve_args(monkeypatch, tmp_path, users_text)
    # Handed to uvicorn as written: its parser, not a second one.
    assert served["proxy_headers"] is True and served["forwarded_allow_ips"] == "10.0.0.5, 10.1.0.0/16"


# -- a real `outbox dashboard` under uvicorn --------------------------------------------------------


@pytest.fixture
def serve(clean: Any, tmp_path: Path, users_text: str) -> Iterator[Any]:
    started: list[tuple[subprocess.Popen[bytes], Any]] = []

    def start(**env: str) -> tuple[str, Path]:
        port = free_port()
        users = tmp_path / "users"
        users.write_text(users_text)
        log = tmp_path / f"dashboard-{port}.log"
        out = log.open("wb")
        environ = clean.env(OUTBOX_DASHBOARD_SECRET=SECRET, OUTBOX_LOG_LEVEL="INFO", **env)
        if "OUTBOX_DASHBOARD_TRUSTED_PROXIES" not in env:
            environ.pop("OUTBOX_DASHBOARD_TRUSTED_PROXIES", None)
        environ.pop("FORWARDED_ALLOW_IPS", None)
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "outbox", "dashboard", "--port", str(port)),
                *("--users", str(users), "--insecure-cookies"),
            ],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        started.append((proc, out))

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return True
            except OSError:
                return False

        wait_for(up, 60, "the dashboard to listen")
        return f"http://127.0.0.1:{port}", log

    yield start
    for proc, out in started:
        proc.terminate()
        proc.wait(30)
        out.close()


def _guess(base: str, user: str, password: str, forwarded_for: str) -> int:
    with httpx.Client(base_url=base, timeout=30, follow_redirects=False) as c:
        token = _csrf(c.get("/login", headers={"x-forwarded-for": forwarded_for}).text)
        return c.post(
            "/login",
            data={"user": user, "password": password, "csrf_token": token},
            headers={"x-forwarded-for": forwarded_for},
        ).status_code


def test_a_loopback_client_cannot_name_its_address_by_default(serve: Any) -> None:
    base, log = serve()
    for i in range(5):
        assert _guess(base, "olga", f"guess-{i}", f"203.0.113.{i}") == 401
    # A new X-Forwarded-For per guess is not a new address: this one is still locked.
    assert _guess(base, "olga", PASSWORDS["olga"], "203.0.113.99") == 429
    failed = [line for line in log.read_text().splitlines() if "dashboard login failed" in line]
    assert len(failed) == 5 and all("client=127.0.0.1" in line for line in failed), failed


def test_the_configured_proxy_names_the_client(serve: Any) -> None:
    base, log = serve(OUTBOX_DASHBOARD_TRUSTED_PROXIES="127.0.0.1")
    for i in range(5):
        assert _guess(base, "olga", f"guess-{i}", "203.0.113.7") == 401
    assert _guess(base, "olga", PASSWORDS["olga"], "203.0.113.7") == 429
    # The operator behind the same proxy, from her own address: in, after at most the slowdown.
    started = time.monotonic()
    assert _guess(base, "olga", PASSWORDS["olga"], "198.51.100.3") == 303
    assert time.monotonic() - started < Throttle().slow_max_seconds + 5
    failed = [line for line in log.read_text().splitlines() if "dashboard login failed" in line]
    assert len(failed) == 5 and all("client=203.0.113.7" in line for line in failed), failed


# -- attacked live: the slowdown must bound a real user's wait --------------------------------------


def _campaign(base: str, addresses: int, *, per_address: int = 5) -> list[Any]:
    """Guesses of olga's password from many addresses at once (through the trusted proxy), each
    given up by the guesser after 2 s: whatever the server does with them, the guesser waits not."""
    import asyncio

    async def one(address: str, i: int) -> Any:
        headers = {"x-forwarded-for": address}
        async with httpx.AsyncClient(base_url=base, timeout=2) as c:
            token = _csrf((await c.get("/login", headers=headers)).text)
            r = await c.post(
                "/login", data={"user": "olga", "password": f"g{i}", "csrf_token": token}, headers=headers
            )
            return r.status_code

    async def all_of_them() -> list[Any]:
        tries = [one(f"203.0.113.{a}", i) for a in range(addresses) for i in range(per_address)]
        return await asyncio.gather(*tries, return_exceptions=True)

    return asyncio.run(all_of_them())


# Broke (attack on issue 29's throttle): the per-name slowdown queued every try of the name, each
# 1-8 s after the one before, and a queued try kept its place when its guesser hung up: 30 guesses
# from six addresses made olga's own login wait about four minutes, a lockout in all but name.
def test_a_campaign_from_many_addresses_never_makes_the_user_wait(serve: Any) -> None:
    base, _log = serve(OUTBOX_DASHBOARD_TRUSTED_PROXIES="127.0.0.1")
    # Olga's browser has signed in before the campaign.
    browser = httpx.Client(base_url=base, timeout=15, follow_redirects=False)
    headers = {"x-forwarded-for": "198.51.100.3"}
    token = _csrf(browser.get("/login", headers=headers).text)
    r = browser.post(
        "/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": token}, headers=headers
    )
    assert r.status_code == 303
    browser.cookies.delete("outbox_session")  # signed out since, her browser is the same
    _campaign(base, addresses=6)
    # Her browser gets in at once, whatever the campaign queued.
    started = time.monotonic()
    token = _csrf(browser.get("/login", headers=headers).text)
    r = browser.post(
        "/login", data={"user": "olga", "password": PASSWORDS["olga"], "csrf_token": token}, headers=headers
    )
    assert r.status_code == 303 and time.monotonic() - started < 5
    # A browser she never used: an answer at once, in or "try again in at most 8 s", never a queue.
    for address in ("198.51.100.4", "198.51.100.5"):
        started = time.monotonic()
        status = _guess(base, "olga", PASSWORDS["olga"], address)
        assert time.monotonic() - started < 5
        assert status in (303, 429)
    browser.close()


def test_concurrent_tries_of_a_name_are_refused_not_queued(app: Starlette) -> None:
    throttle = app.state.dashboard.throttle = Throttle(slow_seconds=5, slow_max_seconds=5)
    for i in range(5):
        assert try_login(client_from(app, f"10.7.0.{i}"), "olga", "guess").status_code == 401
    # Past five failures, one try of the name at a time: the next is told when, not held.
    assert try_login(client_from(app, "10.8.0.1"), "olga", "guess").status_code == 401
    started = time.monotonic()
    r = try_login(client_from(app, "10.8.0.2"), "olga", PASSWORDS["olga"])
    assert time.monotonic() - started < 2
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 5
    assert "one at a time" in r.text
    assert throttle.begin("olga", "10.8.0.3").refused_for > 0


# Broke (attack on issue 29's throttle): past 10,000 counters every try rebuilt the whole table
# (nothing was old enough to drop), in the event loop: a flood of made-up names stalled every page.
def test_many_names_do_not_make_each_try_slower(app: Starlette) -> None:
    throttle = Throttle()
    started = time.monotonic()
    for i in range(16_000):
        throttle.begin(f"made-up-{i}", "203.0.113.9")
    assert time.monotonic() - started < 2.0


# Broke (attack on issue 29): a form's size was checked after the whole body was read, so one
# unauthenticated POST of 300 MB held 300 MB of the dashboard's memory until it was refused.
def test_a_form_too_large_is_refused_before_it_is_read(app: Starlette) -> None:
    import asyncio

    from outbox.dashboard.app import MAX_FORM_BYTES

    chunk = b"a" * 65536
    total = 64 * 1024 * 1024
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": pulled < total}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    for headers in ([], [(b"content-length", str(total).encode())]):
        pulled, sent[:] = 0, []
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "https",
            "path": "/login",
            "raw_path": b"/login",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"host", b"testserver"),
                (b"content-type", b"application/x-www-form-urlencoded"),
                *headers,
            ],
            "client": ("10.0.0.1", 40000),
            "server": ("testserver", 443),
        }
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] == 413, headers
        assert pulled <= MAX_FORM_BYTES + len(chunk), (headers, pulled)


# Broke (attack on issue 29): the engine create_app opens (on database_url, or beside an
# AsyncEngine) was never disposed: its connections outlived the app's shutdown.
def test_the_engine_the_app_opened_is_disposed_at_shutdown(clean: Any, users_text: str) -> None:
    import psycopg

    from outbox.settings import libpq_url

    app = create_app(clean.database_url, secret=SECRET, users=users_text)
    engine = app.state.dashboard.c.engine
    with client_from(app) as c:
        assert c.get("/login").status_code == 200
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
        alive = db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert alive == (0,)


def test_an_engine_opened_beside_an_async_engine_is_disposed_with_the_host(
    clean: Any, users_text: str
) -> None:
    import asyncio
    import contextlib

    import psycopg
    from sqlalchemy.ext.asyncio import create_async_engine
    from starlette.routing import Mount

    from outbox.settings import libpq_url, normalize_database_url

    async_engine = create_async_engine(normalize_database_url(clean.database_url))
    dashboard = create_app(engine=async_engine, secret=SECRET, users=users_text)

    @contextlib.asynccontextmanager
    async def lifespan(_host: Starlette) -> Any:
        async with dashboard.router.lifespan_context(dashboard):  # as docs/dashboard.md says
            yield

    host = Starlette(routes=[Mount("/outbox", dashboard)], lifespan=lifespan)
    try:
        with client_from(host) as c:
            assert c.get("/outbox/login").status_code == 200
            with dashboard.state.dashboard.c.engine.connect() as conn:
                pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as db:
            alive = db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        assert alive == (0,)
    finally:
        asyncio.run(async_engine.dispose())


# Broke (attack on issue 29): over http://localhost, where browsers do send Secure cookies back,
# a login form left open past its ten minutes was refused as "served over plain HTTP ... reloading
# will not help", when reloading is exactly what helps.
@pytest.mark.parametrize("base", ["http://localhost", "http://127.0.0.1:8090", "http://[::1]:8090"])
def test_a_stale_form_on_loopback_is_not_blamed_on_plain_http(app: Starlette, base: str) -> None:
    r = client_from(app, "127.0.0.1", base=base).post(
        "/login", data={"user": "olga", "password": "x", "csrf_token": "from-a-page-left-open"}
    )
    assert r.status_code == 403
    assert "plain HTTP" not in r.text and "reload" in r.text


def test_behind_an_untrusted_proxy_a_known_browser_is_not_locked_out(app: Starlette) -> None:
    proxy = "10.0.0.99"  # every operator and the guesser share the proxy's address
    browser = client_from(app, proxy)
    assert try_login(browser, "olga", PASSWORDS["olga"]).status_code == 303
    browser.cookies.delete("outbox_session")
    guesser = client_from(app, proxy)
    for i in range(5):
        assert try_login(guesser, "olga", f"guess-{i}").status_code == 401
    assert try_login(guesser, "olga", PASSWORDS["olga"]).status_code == 429
    assert try_login(browser, "olga", PASSWORDS["olga"]).status_code == 303
    # The browser's own wrong passwords count against it alone, and five make it one like any other.
    for i in range(5):
        assert try_login(browser, "olga", f"typo-{i}").status_code == 401
    assert try_login(browser, "olga", PASSWORDS["olga"]).status_code == 429
