"""Reading a 429/503 answer's Retry-After (RFC 9110: seconds or an HTTP date) and what the retry
policy makes of it. Plain httpx.Response objects: no transport involved."""

from __future__ import annotations

import email.utils

import httpx
import pytest

import outbox
from outbox import policy, provider_headers
from outbox.handlers import Handler, clear_registry

NOON = "Tue, 01 Dec 2026 10:00:00 GMT"


def answer(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=httpx.Request("POST", "http://127.0.0.1/charges"))


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (503, {"Retry-After": "120"}, 120.0),
        (429, {"Retry-After": "0"}, 0.0),
        (503, {"Retry-After": " 7 "}, 7.0),
        # An HTTP date counts from the answer's own Date (the provider's clock), not ours.
        (
            503,
            {"Retry-After": "Tue, 01 Dec 2026 10:01:30 GMT", "Date": "Tue, 01 Dec 2026 10:00:00 GMT"},
            90.0,
        ),
        (503, {"Retry-After": "Tue, 01 Dec 2026 09:59:00 GMT", "Date": "Tue, 01 Dec 2026 10:00:00 GMT"}, 0.0),
        (503, {"Retry-After": "99999999"}, provider_headers.MAX_RETRY_AFTER_SECONDS),
        (503, {"Retry-After": "soon"}, None),
        (503, {"Retry-After": "-5"}, None),
        (503, {}, None),
        (500, {"Retry-After": "120"}, None),  # not a "not processed" answer
        (200, {"Retry-After": "120"}, None),
    ],
)
def test_retry_after_seconds(status, headers, expected):
    assert provider_headers.retry_after_seconds(answer(status, **headers)) == expected


def test_an_http_date_without_a_date_header_counts_from_this_machines_clock():
    import time

    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    seconds = provider_headers.retry_after_seconds(answer(503, **{"Retry-After": later}))
    assert seconds is not None and 58 <= seconds <= 60


@pytest.fixture(autouse=True)
def _registry():
    clear_registry()
    yield
    clear_registry()


def handler(**options) -> Handler:
    clear_registry()

    @outbox.handler("payments.charge", **{"time_limit": 10, "backoff": (5, 30), **options})
    def charge(d): ...

    return charge


def status_error(status: int, **headers: str) -> httpx.HTTPStatusError:
    response = answer(status, **headers)
    return httpx.HTTPStatusError("no", request=response.request, response=response)


def test_a_retry_waits_the_longer_of_its_backoff_and_the_retry_after():
    h = handler()
    long = policy.decide_exception(h, status_error(503, **{"Retry-After": "120"}))
    assert long.retry_after_seconds == 120 and "Retry-After 120 s" in (long.error or "")
    assert policy.next_state(h, long, attempt=1) == policy.Move("pending", 120.0, long.error)
    short = policy.decide_exception(h, status_error(429, **{"Retry-After": "1"}))
    assert policy.next_state(h, short, attempt=1).delay_seconds == 5.0  # the backoff is longer
    # Out of attempts: the Retry-After changes nothing.
    assert policy.next_state(h, long, attempt=h.max_attempts).state == "failed"


def test_a_handler_raising_its_own_error_keeps_the_answers_retry_after():
    """A handler that checks r.status_code and raises RetryableError: the worker noted the
    answer's Retry-After through Delivery.http and passes it on."""
    from outbox import RetryableError

    decision = policy.decide_exception(handler(), RetryableError("busy"), last_retry_after=45.0)
    assert decision.retry_after_seconds == 45.0
    assert policy.next_state(handler(), decision, attempt=1).delay_seconds == 45.0
    # Not for an outcome that is no retry.
    failed = policy.decide_exception(handler(), ValueError("bug"), last_retry_after=45.0)
    assert failed.retry_after_seconds is None
