"""A request that did not reach the provider says where it went and why it got no further (the
host and port, the OS's error), and nothing of the URL beyond them: no path, no query, no
userinfo. A real refused connection on 127.0.0.1, and hypothesis over what an error may hold."""

from __future__ import annotations

import socket

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.policy import Outcome, classify_exception

SECRET = "s3cr3tVALUE"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused(url: str) -> httpx.ConnectError:
    with httpx.Client() as client, pytest.raises(httpx.ConnectError) as caught:
        client.post(url, json={})
    return caught.value


def test_a_refused_connection_names_host_port_and_the_os_error_only():
    port = closed_port()
    exc = refused(f"http://ops:{SECRET}@127.0.0.1:{port}/v1/charges?api_key={SECRET}&card=4242424242424242")
    outcome, reason, status = classify_exception(exc)
    assert (outcome, status) == (Outcome.RETRY, None)
    cause = f"127.0.0.1:{port}: [Errno 111] Connection refused"
    assert reason == f"ConnectError: the request did not reach the provider ({cause})"


def test_the_default_port_of_the_scheme_is_named():
    exc = httpx.ConnectError(
        "[Errno 111] Connection refused", request=httpx.Request("GET", "https://api.example.com/x")
    )
    assert classify_exception(exc)[1].endswith("(api.example.com:443: [Errno 111] Connection refused)")
    v6 = httpx.ConnectTimeout("timed out", request=httpx.Request("GET", "http://[::1]/x?token=abc"))
    assert (
        classify_exception(v6)[1]
        == "ConnectTimeout: the request did not reach the provider ([::1]:80: timed out)"
    )


def test_the_os_error_is_found_under_the_transports_own_exceptions():
    inner = ConnectionRefusedError(111, "Connection refused")
    try:
        try:
            raise inner
        except OSError as e:
            raise httpx.ConnectError("All connection attempts failed") from e
    except httpx.ConnectError as e:
        e.request = httpx.Request("POST", "http://10.0.0.7:8443/charges")
        exc = e
    assert classify_exception(exc)[1].endswith("(10.0.0.7:8443: [Errno 111] Connection refused)")


def test_an_error_text_carrying_a_url_keeps_its_host_and_port_only():
    text = f"could not connect to https://user:{SECRET}@proxy.example.net:3128/path?token={SECRET} (refused)"
    exc = httpx.ConnectError(text, request=httpx.Request("GET", "https://api.example.com/"))
    reason = classify_exception(exc)[1]
    assert "proxy.example.net:3128" in reason and "(refused)" in reason
    assert SECRET not in reason and "user" not in reason and "/path" not in reason


def test_without_a_request_or_a_message_the_reason_is_as_before():
    assert (
        classify_exception(httpx.ConnectError(""))[1]
        == "ConnectError: the request did not reach the provider"
    )


@settings(database=None, deadline=None, max_examples=300)
@given(
    message=st.text(max_size=2000),
    host=st.sampled_from(["api.example.com", "127.0.0.1", "[::1]", "xn--bcher-kva.example", "h"]),
    port=st.none() | st.integers(1, 65535),
    path=st.text(st.characters(codec="ascii", categories=["L", "N"]), max_size=20),
    kind=st.sampled_from([httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout]),
)
def test_the_reason_is_total_bounded_and_keeps_no_userinfo_or_query(message, host, port, path, kind):
    authority = f"{host}:{port}" if port else host
    url = f"https://ops:{SECRET}@{authority}/{path}?key={SECRET}"
    exc = kind(message, request=httpx.Request("POST", url))
    outcome, reason, _ = classify_exception(exc)
    assert outcome is Outcome.RETRY
    assert reason.startswith(f"{kind.__name__}: the request did not reach the provider")
    assert len(reason) <= 500 and "\n" not in reason
    if SECRET not in message:
        assert SECRET not in reason
