"""What the dashboard's tests share: the users and their passwords, signing in over HTTP, a
charging handler of DEST and a writer of its rows (``users_text`` and ``app`` are fixtures in
conftest.py)."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.testclient import TestClient

import outbox
from outbox.dashboard import hash_password

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


def csrf(html: str) -> str:
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
    r = client.post("/login", data={"user": user, "password": PASSWORDS[user], "csrf_token": csrf(page.text)})
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
    return csrf(client.get("/").text)
