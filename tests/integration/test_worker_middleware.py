"""Dramatiq middleware of the user's own on the worker's broker: it runs around each delivery,
and what would break the guarantee or the metrics is refused with the reason."""

from __future__ import annotations

import threading

import pytest
from dramatiq.middleware import Middleware, Retries, TimeLimit
from dramatiq.middleware.prometheus import Prometheus
from helpers import relay_once, wait_for, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import middleware


@pytest.fixture(autouse=True)
def _forget_middleware():
    middleware.clear()
    yield
    middleware.clear()


class Seen(Middleware):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.before: list[int] = []
        self.after: list[int] = []

    def before_process_message(self, broker, message):
        with self.lock:
            self.before.append(message.args[0])

    def after_process_message(self, broker, message, *, result=None, exception=None):
        with self.lock:
            self.after.append(message.args[0])


@pytest.mark.parametrize(
    ("refused", "reason"),
    [
        (Retries(), "retries live in the database"),
        (TimeLimit(), "bounds each call by the handler's time_limit"),
        (Prometheus(), "outbox serves its own metrics"),
    ],
)
def test_what_would_break_the_guarantee_or_the_metrics_is_refused(refused, reason):
    with pytest.raises(outbox.ConfigError, match=reason):
        outbox.worker_middleware(refused)
    with pytest.raises(outbox.ConfigError, match="instantiate it"):
        outbox.worker_middleware(Seen)
    assert middleware.added() == []


def test_the_users_middleware_runs_around_each_delivery(clean, engine, provider):
    @outbox.handler("payments.charge", time_limit=5)
    def charge(d):
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    seen = Seen()
    outbox.worker_middleware(seen)
    with Session(engine) as s, s.begin():
        ids = [
            outbox.write(s, key=f"o:{i}", step="charge", destination="payments.charge", payload={}).id
            for i in range(3)
        ]
    assert relay_once(clean) == 3
    with worker_thread(clean, threads=2):
        wait_for(lambda: len(seen.after) == 3, 30, "three deliveries through the middleware")
    assert sorted(seen.before) == sorted(seen.after) == ids
    assert provider.charges() == 3
