"""Outcome classification: what each kind of provider answer means for the row.

httpx.MockTransport stands in for the provider here only: these are classification rules, not
delivery tests (those use the real simulator over loopback)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import httpx
import pytest

import outbox
from outbox.handlers import Handler, clear_registry
from outbox.policy import (
    Outcome,
    classify_exception,
    deadline_error,
    decide_exception,
    decide_result,
    next_state,
)


@pytest.fixture(autouse=True)
def _registry():
    clear_registry()
    yield
    clear_registry()


def _status_error(status: int) -> httpx.HTTPStatusError:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": "x"})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        response = client.post("http://provider.test/charges")
    try:
        response.raise_for_status()
    except httpx.HTTPStatusError as exc:
        return exc
    raise AssertionError("no error raised")


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (400, Outcome.FAILED),
        (401, Outcome.FAILED),
        (402, Outcome.FAILED),
        (404, Outcome.FAILED),
        (422, Outcome.FAILED),
        (408, Outcome.UNKNOWN),
        (409, Outcome.UNKNOWN),
        (425, Outcome.UNKNOWN),
        (429, Outcome.RETRY),
        (503, Outcome.RETRY),
        (500, Outcome.UNKNOWN),
        (502, Outcome.UNKNOWN),
        (504, Outcome.UNKNOWN),
    ],
)
def test_http_status_classification(status: int, outcome: Outcome) -> None:
    got, reason, http_status = classify_exception(_status_error(status))
    assert got is outcome
    assert http_status == status
    assert str(status) in reason


def _raising(exc: Exception):
    def answer(request: httpx.Request) -> httpx.Response:
        raise exc

    return answer


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (httpx.ConnectError("refused"), Outcome.RETRY),
        (httpx.ConnectTimeout("slow connect"), Outcome.RETRY),
        (httpx.PoolTimeout("pool"), Outcome.RETRY),
        (httpx.ReadTimeout("no answer"), Outcome.UNKNOWN),
        (httpx.WriteTimeout("stuck"), Outcome.UNKNOWN),
        (httpx.RemoteProtocolError("closed"), Outcome.UNKNOWN),
        (httpx.ReadError("reset"), Outcome.UNKNOWN),
    ],
)
def test_transport_errors(exc: Exception, outcome: Outcome) -> None:
    with httpx.Client(transport=httpx.MockTransport(_raising(exc))) as client:
        with pytest.raises(httpx.HTTPError) as info:
            client.post("http://provider.test/charges")
    assert classify_exception(info.value)[0] is outcome


def test_handler_exceptions() -> None:
    assert classify_exception(outbox.PermanentError("card declined"))[:2] == (
        Outcome.FAILED,
        "card declined",
    )
    assert classify_exception(outbox.RetryableError("later"))[0] is Outcome.RETRY
    assert classify_exception(outbox.AmbiguousError("?"))[0] is Outcome.UNKNOWN
    outcome, reason, _ = classify_exception(KeyError("id"))
    assert outcome is Outcome.UNKNOWN and "KeyError" in reason


def test_garbage_json_is_ambiguous() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"not json{")

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        response = client.post("http://provider.test/charges")
    with pytest.raises(ValueError) as info:
        response.json()
    outcome, reason, _ = classify_exception(info.value)
    assert outcome is Outcome.UNKNOWN and "JSON" in reason


def _handler(**kw) -> Handler:
    @outbox.handler("payments.charge", **kw)
    def charge(d):  # pragma: no cover - never called
        raise AssertionError

    return charge


def test_results() -> None:
    assert decide_result(outbox.Confirmed(ref="ch_1")).outcome is Outcome.SENT
    d = decide_result(None)
    assert d.outcome is Outcome.UNKNOWN and "NoneType" in (d.error or "")
    assert decide_result({"id": "ch_1"}).outcome is Outcome.UNKNOWN
    with pytest.raises(TypeError):
        outbox.Confirmed(ref="")


def test_override_classification() -> None:
    h = _handler(classify=lambda exc: "retry" if isinstance(exc, KeyError) else None)
    assert decide_exception(h, KeyError("x")).outcome is Outcome.RETRY
    assert decide_exception(h, ValueError("x")).outcome is Outcome.UNKNOWN


def test_next_state_backoff_and_attempts_as_delays() -> None:
    # Delays, never instants: the statement that applies them adds them to the database's clock,
    # and decides there whether a retry would fall past the row's deadline.
    h = _handler(max_attempts=3, backoff=(10, 60), time_limit=7)
    retry = decide_exception(h, httpx.ConnectError("refused"))
    n1 = next_state(h, retry, attempt=1)
    assert (n1.state, n1.delay_seconds) == ("pending", 10)
    assert next_state(h, retry, attempt=2).delay_seconds == 60
    n3 = next_state(h, retry, attempt=3)
    assert n3.state == "failed" and "3 attempts" in (n3.error or "") and n3.delay_seconds is None
    ambiguous = decide_exception(h, httpx.ReadTimeout("x"))
    unknown = next_state(h, ambiguous, attempt=1)
    # The first lookup waits one time_limit: the provider may still be executing the call.
    assert (unknown.state, unknown.delay_seconds) == ("unknown", 7)
    deadline = datetime(2026, 1, 1, tzinfo=UTC)
    assert (
        deadline_error(deadline, "HTTP 503") == "deadline 2026-01-01T00:00:00Z reached; last error: HTTP 503"
    )
    assert deadline_error(None, "HTTP 503") is None


def test_idempotent_destination_retries_ambiguous_outcomes() -> None:
    h = _handler(idempotent=True)
    ambiguous = decide_exception(h, httpx.ReadTimeout("x"))
    nxt = next_state(h, ambiguous, attempt=1)
    assert nxt.state == "pending"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"time_limit": 30, "lease_seconds": 30}, "longer than time_limit"),
        ({"time_limit": 30, "lease_seconds": 30.5}, "by at least 1 s"),
        ({"time_limit": 0}, "time_limit must be > 0"),
        ({"backoff": (10, 0)}, "backoff entry must be > 0"),
        ({"backoff": ()}, "backoff entry must be > 0"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": 10, "backoff": (3600,), "key_ttl": 7200}, "key_ttl"),
    ],
)
def test_handler_configuration_errors(kwargs, message) -> None:
    with pytest.raises(outbox.ConfigError, match=message):
        _handler(**kwargs)


def test_duplicate_destination_and_bad_name() -> None:
    _handler()

    with pytest.raises(outbox.ConfigError, match="already has a handler"):

        @outbox.handler("payments.charge")
        def other(d):  # pragma: no cover
            raise AssertionError

    with pytest.raises(outbox.ConfigError, match="must match"):
        outbox.handler("9bad name")


def test_lease_default_and_timeouts_inside_time_limit() -> None:
    h = _handler(time_limit=20)
    assert h.lease_seconds > h.time_limit
    # Half the lease's margin is kept for the record, at most 5 s; the rest absorbs the claim.
    assert h.start_margin_seconds == 5
    clear_registry()
    assert _handler(time_limit=2, lease_seconds=3).start_margin_seconds == 0.5
    t = h.timeouts()
    assert t.connect + t.write + t.read <= h.time_limit


def test_problems_lists_every_problem_at_once() -> None:
    with pytest.raises(outbox.ConfigError) as info:
        _handler(time_limit=30, lease_seconds=30.5, backoff=(10, 0), max_attempts=0)
    message = str(info.value)
    assert message.startswith("handler payments.charge: ")
    for part in ("max_attempts", "backoff entry must be > 0", "by at least 1 s"):
        assert part in message, part


def test_problems_of_a_handler_built_without_the_decorator() -> None:
    """What `outbox doctor` asks of a module that builds Handler objects itself."""
    good = _handler()
    assert good.problems() == []
    bad = Handler(
        destination="mail.XQ",
        fn=lambda d: None,
        time_limit=10,
        max_attempts=3,
        backoff=(1.0,),
        idempotent=False,
        key_ttl=60,
        lease_seconds=30,
    )
    (problem,) = bad.problems()
    assert "must not end in '.XQ'" in problem
    bad = dataclasses.replace(good, destination="mail.send", lease_seconds=good.time_limit + 0.5)
    assert bad.problems() == [
        "mail.send: lease_seconds (30.5) must exceed time_limit (30) by at least 1 s, the room the "
        "claim's round trip and the record need around the call"
    ]
    bad = dataclasses.replace(good, backoff=(40_000.0,), key_ttl=86_400.0)
    assert [p.split(": ", 1)[1] for p in bad.problems()] == [
        "the backoffs add up to 160000 s over 5 attempts, not under key_ttl (86400 s); the provider "
        "would forget the Idempotency-Key before the last retry"
    ]


def test_handler_is_frozen_and_its_lookup_is_registered_by_destination() -> None:
    h = _handler()
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.time_limit = 5  # type: ignore[misc]
    assert h.lookup_fn is None

    @h.lookup
    def find(d):  # pragma: no cover - never called
        return None

    assert h.lookup_fn is find
    assert outbox.handlers.registry()["payments.charge"].lookup_fn is find
    clear_registry()
    assert h.lookup_fn is None


def test_defaults_come_from_settings() -> None:
    from outbox import settings

    h = _handler()
    assert (h.time_limit, h.max_attempts, h.backoff, h.key_ttl) == (
        settings.DEFAULT_TIME_LIMIT_SECONDS,
        settings.DEFAULT_MAX_ATTEMPTS,
        settings.DEFAULT_BACKOFF_SECONDS,
        settings.DEFAULT_KEY_TTL_SECONDS,
    )
    assert h.lease_seconds == settings.default_lease_seconds(h.time_limit) == 60


def _status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "https://provider.test/charges")
    return httpx.HTTPStatusError(
        f"HTTP {code}", request=request, response=httpx.Response(code, request=request)
    )


def test_a_permanent_error_keeps_the_http_status() -> None:
    h = _handler()
    # The last answer d.http received during the call, when it is a 4xx.
    d = decide_exception(h, outbox.PermanentError("card declined"), last_status=402)
    assert (d.outcome, d.http_status, d.error) == (Outcome.FAILED, 402, "card declined (HTTP 402)")
    for status in (None, 200, 503):
        d = decide_exception(h, outbox.PermanentError("card declined"), last_status=status)
        assert (d.http_status, d.error) == (None, "card declined")
    # Raised from (or while handling) a status error: that status, whatever came last.
    try:
        try:
            raise _status_error(422)
        except httpx.HTTPStatusError as exc:
            raise outbox.PermanentError("invalid amount") from exc
    except outbox.PermanentError as exc:
        d = decide_exception(h, exc, last_status=200)
    assert (d.http_status, d.error) == (422, "invalid amount (HTTP 422)")
    # `from None` hides what it was raised while handling.
    try:
        try:
            raise _status_error(422)
        except httpx.HTTPStatusError:
            raise outbox.PermanentError("invalid amount") from None
    except outbox.PermanentError as exc:
        assert decide_exception(h, exc).http_status is None
    # Already in the text: not repeated; a long text keeps the status at its end.
    d = decide_exception(h, outbox.PermanentError("HTTP 402: card declined"), last_status=402)
    assert (d.http_status, d.error) == (402, "HTTP 402: card declined")
    d = decide_exception(h, outbox.PermanentError("x" * 1000), last_status=400)
    assert d.error is not None and len(d.error) == 500 and d.error.endswith("… (HTTP 400)")
    # A status error the default classification fails keeps its status, as before.
    d = decide_exception(h, _status_error(404))
    assert (d.outcome, d.http_status) == (Outcome.FAILED, 404)
    # A retry is not a permanent error: no status borrowed from an earlier answer.
    d = decide_exception(h, outbox.RetryableError("later"), last_status=404)
    assert d.http_status is None
