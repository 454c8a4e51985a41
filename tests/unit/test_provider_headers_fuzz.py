"""Nothing a provider sends may change the outcome class: every parser of provider text that runs
inside ``d.http``'s response hook or the classification (the status, ``Retry-After`` as seconds
and as an HTTP date, ``Date``) is total, fuzzed here with hypothesis over raw header bytes.

In-memory ``httpx.Response`` objects carry any bytes a wire could; the integration test
(tests/integration/test_provider_headers.py) sends them over a real socket."""

from __future__ import annotations

import logging
import math
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox import policy, provider_headers
from outbox.handlers import Deliveries, Handler, clear_registry
from outbox.policy import Outcome
from outbox.provider_headers import MAX_RETRY_AFTER_SECONDS

#: No example database (no .hypothesis directory in the checkout), no per-example deadline (a
#: shared CI machine), and function-scoped fixtures are fine: they are set up once per test.
FUZZ = settings(
    database=None,
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

URL = "http://127.0.0.1/charges"

# -- strategies --------------------------------------------------------------------------------

#: Characters ``str.isdigit()`` accepts that are no ASCII digit: decimal digits of other scripts
#: (float() reads them) and superscripts, circled digits… (float() refuses them).
_UNICODE_DIGITS = "".join(c for c in map(chr, range(0x80, 0x20000)) if c.isdigit() and not ("0" <= c <= "9"))
unicode_digits = st.text(st.sampled_from(_UNICODE_DIGITS), min_size=1, max_size=12)
digits_mixed = st.text(st.sampled_from("0123456789" + _UNICODE_DIGITS[:200]), min_size=1, max_size=40)

_WEEKDAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun", "Xyz", ""]
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec", "Foo"]
_ZONES = st.one_of(
    st.sampled_from(["GMT", "UTC", "UT", "EST", "PDT", "Z", "-0000", "+0000", "", "+99999"]),
    st.builds(lambda sign, n: f"{sign}{n:04d}", st.sampled_from("+-"), st.integers(0, 9999)),
    st.text(string.ascii_letters + string.digits + "+-", max_size=6),
)
_NUMBER = st.one_of(st.integers(-(10**6), 10**12).map(str), digits_mixed, st.text(max_size=4))
#: Shapes of RFC 5322 / RFC 850 / asctime dates with any numbers in them: years past 9999,
#: days 0 and 99, offsets past a day, a Unicode digit where an ASCII one belongs.
dates = st.one_of(
    st.builds(
        lambda wd, d, m, y, hh, mm, ss, z: f"{wd}, {d} {m} {y} {hh}:{mm}:{ss} {z}".strip(),
        st.sampled_from(_WEEKDAYS),
        _NUMBER,
        st.sampled_from(_MONTHS),
        _NUMBER,
        _NUMBER,
        _NUMBER,
        _NUMBER,
        _ZONES,
    ),
    st.builds(
        lambda wd, d, m, y, t, z: f"{wd} {m} {d} {t} {y} {z}",
        st.sampled_from(_WEEKDAYS),
        _NUMBER,
        st.sampled_from(_MONTHS),
        _NUMBER,
        st.text("0123456789:", max_size=10),
        _ZONES,
    ),
)
#: A header value as text: anything, numbers of any script, dates of any shape.
header_text = st.one_of(
    st.text(max_size=60),
    unicode_digits,
    digits_mixed,
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    dates,
)
#: A header value as the wire carries it: any bytes but the line's own end (httpx decodes them
#: as ASCII, else UTF-8, else Latin-1 across the whole header block).
header_bytes = st.one_of(
    header_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=60),
).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))

statuses = st.one_of(st.sampled_from([429, 503, 500, 200, 404]), st.integers(100, 999))


def answer(status: int, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=httpx.Request("POST", URL))


def wire_headers(retry_after: bytes | None, date: bytes | None) -> list[tuple[bytes, bytes]]:
    headers = []
    if retry_after is not None:
        headers.append((b"Retry-After", retry_after))
    if date is not None:
        headers.append((b"Date", date))
    return headers


@pytest.fixture(autouse=True)
def _registry():
    clear_registry()
    provider_headers._warned.clear()  # "once per process": each test starts a process afresh
    yield
    clear_registry()


@pytest.fixture
def charge() -> Handler:
    @outbox.handler("payments.charge", time_limit=10, backoff=(5, 30))
    def charge(d): ...

    return charge


def _in_range(seconds: float | None) -> bool:
    return seconds is None or (math.isfinite(seconds) and 0.0 <= seconds <= MAX_RETRY_AFTER_SECONDS)


# -- Retry-After: seconds and HTTP date, with and without Date ----------------------------------


@FUZZ
@given(status=statuses, retry_after=st.none() | header_bytes, date=st.none() | header_bytes)
def test_retry_after_never_raises_and_stays_in_range(status, retry_after, date):
    seconds = provider_headers.retry_after_seconds(answer(status, wire_headers(retry_after, date)))
    assert _in_range(seconds)
    if status not in (429, 503):
        assert seconds is None


@FUZZ
@given(value=unicode_digits, status=st.sampled_from([429, 503]))
def test_a_retry_after_of_non_ascii_digits_is_absent(value, status):
    """RFC 9110's delay-seconds is ASCII digits: ``str.isdigit()`` also accepts ``١٢`` (which
    ``float()`` reads as 12) and ``²`` (which ``float()`` refuses): neither is a delay."""
    response = answer(status, [(b"Retry-After", value.encode())])
    assert provider_headers.retry_after_seconds(response) is None


@FUZZ
@given(value=st.integers(0, 10**30), pad=st.sampled_from(["", " ", "\t", "  "]))
def test_ascii_delay_seconds_are_read_and_capped(value, pad):
    response = answer(503, [(b"Retry-After", f"{pad}{value}{pad}".encode())])
    assert provider_headers.retry_after_seconds(response) == min(float(value), MAX_RETRY_AFTER_SECONDS)


@FUZZ
@given(retry_after=dates, date=st.none() | dates)
def test_any_date_shaped_retry_after_never_raises(retry_after, date):
    headers = [(b"Retry-After", retry_after.encode())]
    if date is not None:
        headers.append((b"Date", date.encode()))
    assert _in_range(provider_headers.retry_after_seconds(answer(503, headers)))


# -- the response hook of d.http: the status line and every header it reads -------------------


def _hooks(handler: Handler) -> list:
    deliveries = Deliveries()
    try:
        return list(deliveries.client(handler).event_hooks["response"])
    finally:
        deliveries.close()


@FUZZ
@given(status=statuses, retry_after=st.none() | header_bytes, date=st.none() | header_bytes)
def test_d_http_response_hook_never_raises(charge, status, retry_after, date):
    from outbox.handlers import last_response_status, last_retry_after, set_send_bound

    hooks = _hooks(charge)
    assert hooks
    set_send_bound(None)
    response = answer(status, wire_headers(retry_after, date))
    for hook in hooks:
        hook(response)
    assert last_response_status() == status
    assert _in_range(last_retry_after())


# -- the classification of what the handler raised ---------------------------------------------


@FUZZ
@given(status=statuses, retry_after=st.none() | header_bytes, date=st.none() | header_bytes)
def test_classification_of_a_status_error_never_raises(charge, status, retry_after, date):
    response = answer(status, wire_headers(retry_after, date))
    error = httpx.HTTPStatusError("no", request=response.request, response=response)
    decision = policy.decide_exception(charge, error, last_status=status)
    assert decision.outcome is policy.classify_status(status)
    if status in (429, 503):
        # Whatever the headers hold, "not processed" stays a retry the breaker counts.
        assert decision.outcome is Outcome.RETRY and decision.not_processed
    assert _in_range(decision.retry_after_seconds)


@FUZZ
@given(status=st.integers(-(10**6), 10**6))
def test_classify_status_is_total(status):
    assert policy.classify_status(status) in set(Outcome)


# -- a malformed value is logged once per (process, destination, header) -----------------------


def test_a_malformed_retry_after_is_warned_about_once_per_destination_and_header(charge, caplog):
    def warnings_about(header: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.WARNING and header in r.getMessage()]

    bad = [(b"Retry-After", "١٢".encode()), (b"Date", b"yesterday")]
    later = [(b"Retry-After", b"Tue, 01 Dec 2026 10:01:30 GMT"), (b"Date", "¹²".encode())]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            error = httpx.HTTPStatusError("no", request=httpx.Request("POST", URL), response=answer(503, bad))
            assert policy.decide_exception(charge, error).outcome is Outcome.RETRY
        assert len(warnings_about("Retry-After")) == 1
        [record] = warnings_about("Retry-After")
        assert "payments.charge" in record.getMessage() and "\\u0661\\u0662" in record.getMessage()
        # The Date header is only read for a date Retry-After: then it is a header of its own.
        error = httpx.HTTPStatusError("no", request=httpx.Request("POST", URL), response=answer(503, later))
        policy.decide_exception(charge, error)
        policy.decide_exception(charge, error)
        assert len(warnings_about("Date header")) == 1
        # Another destination gets its own warning.
        clear_registry()

        @outbox.handler("payments.refund", time_limit=10, backoff=(5, 30))
        def refund(d): ...

        error = httpx.HTTPStatusError("no", request=httpx.Request("POST", URL), response=answer(503, bad))
        policy.decide_exception(refund, error)
        assert len(warnings_about("Retry-After")) == 2


# -- the parsers one by one ---------------------------------------------------------------------


@FUZZ
@given(raw=header_text | header_bytes.map(lambda b: b.decode("latin-1")))
def test_delay_seconds_is_total(raw):
    seconds = provider_headers.delay_seconds(raw)
    assert _in_range(seconds)
    stripped = raw.strip()
    if seconds is not None:
        assert stripped.isascii() and stripped.isdigit()


@FUZZ
@given(raw=header_text | header_bytes.map(lambda b: b.decode("latin-1")))
def test_http_date_is_total_and_aware(raw):
    at = provider_headers.http_date(raw)
    assert at is None or at.utcoffset() is not None
