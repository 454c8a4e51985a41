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
    # 20 guesses from four addresses: each address locked for olga, olga herself never.
    for address in ("10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"):
        c = client_from(app, address)
        for i in range(5):
            assert try_login(c, "olga", f"guess-{i}").status_code == 401
        assert try_login(c, "olga", PASSWORDS["olga"]).status_code == 429
    started = time.monotonic()
    assert try_login(client_from(app, "10.2.0.1"), "olga", PASSWORDS["olga"]).status_code == 303
    assert time.monotonic() - started < 0.4 + 2.0  # at most the slowdown, plus the work


def test_the_slowdown_spaces_guesses_from_many_addresses(app: Starlette) -> None:
    app.state.dashboard.throttle = Throttle(slow_seconds=0.2, slow_max_seconds=0.4)
    for i in range(5):
        assert try_login(client_from(app, f"10.3.0.{i}"), "olga", "guess").status_code == 401
    # Past five failures of the name, tries are checked 0.2 s apart, then 0.4 s: a guesser
    # with a new address per guess gets no more than that.
    started = time.monotonic()
    for i in range(5):
        assert try_login(client_from(app, f"10.4.0.{i}"), "olga", "guess").status_code == 401
    assert time.monotonic() - started >= 0.2 + 0.4 * 3 - 0.05


def test_concurrent_guesses_from_many_addresses_are_spaced(app: Starlette) -> None:
    app.state.dashboard.throttle = Throttle(slow_seconds=0.3, slow_max_seconds=0.3)
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
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [401] * 6
    assert time.monotonic() - started >= 0.3 * 5 - 0.05, "six parallel guesses were not spaced"


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
