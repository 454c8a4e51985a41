"""The payment provider simulator behaves as documented, faults included."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.testing.provider import ProviderSimulator

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def provider() -> Iterator[ProviderSimulator]:
    with ProviderSimulator() as sim:
        yield sim


@pytest.fixture
def client(provider: ProviderSimulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=5.0) as c:
        yield c


def charge(client: httpx.Client, key: str, **body: Any) -> httpx.Response:
    payload = {"amount_cents": 1000, "currency": "eur", **body}
    return client.post("/charges", json=payload, headers={"Idempotency-Key": key})


def test_charge_creates_one_effect(provider: ProviderSimulator, client: httpx.Client) -> None:
    response = charge(client, "order-1")

    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("ch_")
    assert body == {
        "id": body["id"],
        "idempotency_key": "order-1",
        "amount_cents": 1000,
        "currency": "eur",
        "status": "succeeded",
    }
    stats = provider.stats()
    assert stats["effects"] == {"order-1": 1}
    assert stats["charges"] == 1
    assert stats["requests"] == 1
    assert stats["double_charged"] == []


def test_repeated_key_without_dedupe_double_charges(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    first = charge(client, "order-1").json()
    second = charge(client, "order-1").json()

    assert first["id"] != second["id"]
    stats = provider.stats()
    assert stats["effects"] == {"order-1": 2}
    assert stats["charges"] == 2
    assert stats["double_charged"] == ["order-1"]
    assert stats["deduplicated"] == 0


def test_repeated_key_with_dedupe_returns_same_charge(client: httpx.Client) -> None:
    client.post("/_config", json={"dedupe": True}).raise_for_status()

    first = charge(client, "order-1").json()
    second = charge(client, "order-1", amount_cents=5).json()

    assert second == first
    stats = client.get("/_stats").json()
    assert stats["effects"] == {"order-1": 1}
    assert stats["requests"] == 2
    assert stats["deduplicated"] == 1
    assert stats["double_charged"] == []


def test_constructor_dedupe_survives_reset() -> None:
    with ProviderSimulator(dedupe=True) as sim, httpx.Client(base_url=sim.url) as c:
        charge(c, "k")
        sim.reset()
        assert sim.stats()["effects"] == {}
        charge(c, "k")
        charge(c, "k")
        assert sim.stats()["effects"] == {"k": 1}


def test_lookup_finds_latest_charge_or_404(provider: ProviderSimulator, client: httpx.Client) -> None:
    charge(client, "order-1")
    latest = charge(client, "order-1").json()

    found = client.get("/charges", params={"idempotency_key": "order-1"})
    missing = client.get("/charges", params={"idempotency_key": "order-2"})

    assert found.status_code == 200
    assert found.json() == latest
    assert missing.status_code == 404
    assert missing.json() == {"error": "no such charge"}
    assert provider.stats()["requests"] == 2  # lookups are not charge requests


def test_lookup_fail_answers_503(provider: ProviderSimulator, client: httpx.Client) -> None:
    charge(client, "order-1")
    provider.configure(lookup_fail=True, fail_before_rate=1.0)

    assert client.get("/charges", params={"idempotency_key": "order-1"}).status_code == 503
    provider.configure(lookup_fail=False)
    # Charge faults do not apply to lookups.
    assert client.get("/charges", params={"idempotency_key": "order-1"}).status_code == 200


def test_negative_amount_is_declined_without_charging(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    response = charge(client, "order-1", amount_cents=-1)

    assert response.status_code == 402
    assert response.json() == {"error": "card declined"}
    stats = provider.stats()
    assert stats["effects"] == {}
    assert stats["charges"] == 0
    assert stats["declined"] == 1
    assert client.get("/charges", params={"idempotency_key": "order-1"}).status_code == 404


@pytest.mark.parametrize(
    ("headers", "content"),
    [
        ({}, b'{"amount_cents": 1}'),
        ({"Idempotency-Key": "k"}, b"[1, 2]"),
        ({"Idempotency-Key": "k"}, b"not json"),
    ],
    ids=["missing-key", "not-an-object", "not-json"],
)
def test_malformed_charge_is_400(
    provider: ProviderSimulator, client: httpx.Client, headers: dict[str, str], content: bytes
) -> None:
    response = client.post(
        "/charges", content=content, headers={"Content-Type": "application/json", **headers}
    )

    assert response.status_code == 400
    assert "error" in response.json()
    assert provider.stats()["charges"] == 0


@pytest.mark.parametrize(
    ("mode", "status", "effects"),
    [("fail_before", 503, 0), ("fail_after", 500, 1)],
)
def test_status_faults(
    provider: ProviderSimulator, client: httpx.Client, mode: str, status: int, effects: int
) -> None:
    provider.configure(fault_keys={"order-1": mode})

    response = charge(client, "order-1")

    assert response.status_code == status
    assert "error" in response.json()
    stats = provider.stats()
    assert stats["charges"] == effects
    assert stats["faults"][mode] == 1


def test_garbage_fault_charges_then_answers_unparseable_200(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    provider.configure(fault_keys={"order-1": "garbage"})

    response = charge(client, "order-1")

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == b"not json{"
    assert provider.stats()["effects"] == {"order-1": 1}


def test_drop_after_fault_charges_then_closes_connection(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    provider.configure(fault_keys={"order-1": "drop_after"})

    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        charge(client, "order-1")

    assert provider.stats()["effects"] == {"order-1": 1}
    # The client recovers on a fresh connection.
    assert charge(client, "order-2").status_code == 200


def test_hang_after_fault_charges_then_times_out_client(provider: ProviderSimulator) -> None:
    provider.configure(fault_keys={"order-1": "hang_after"}, hang_seconds=6)

    started = time.monotonic()
    with httpx.Client(base_url=provider.url, timeout=httpx.Timeout(5.0, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            charge(c, "order-1")
    # Bounded by the client's 0.5 s read timeout, far from the 6 s hang (margin for a busy machine).
    assert time.monotonic() - started < 3.0

    assert provider.stats()["effects"] == {"order-1": 1}
    # stop() (fixture teardown) must not wait out the hang either.


def test_fault_key_applies_once(provider: ProviderSimulator, client: httpx.Client) -> None:
    assert provider.configure(fault_keys={"order-1": "fail_before"})["fault_keys"] == {
        "order-1": "fail_before"
    }

    assert charge(client, "order-1").status_code == 503
    assert charge(client, "order-1").status_code == 200
    assert provider.configure()["fault_keys"] == {}
    assert provider.stats()["effects"] == {"order-1": 1}


def test_random_faults_follow_rates(provider: ProviderSimulator, client: httpx.Client) -> None:
    provider.configure(fail_before_rate=1.0, seed=7)
    assert all(charge(client, f"k{i}").status_code == 503 for i in range(5))
    provider.configure(fail_before_rate=0.0, fail_after_rate=1.0)
    assert all(charge(client, f"k{i}").status_code == 500 for i in range(5))

    stats = provider.stats()
    assert stats["faults"]["fail_before"] == 5
    assert stats["faults"]["fail_after"] == 5
    assert stats["charges"] == 5


def test_config_over_http_returns_whole_config(client: httpx.Client) -> None:
    config = client.post("/_config", json={"latency_ms": 1, "dedupe": True}).json()

    assert config["latency_ms"] == 1.0
    assert config["dedupe"] is True
    assert config["hang_seconds"] == 30.0
    assert config["fault_keys"] == {}


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"bogus": 1}, "bogus"),
        ({"dedupe": "yes"}, "dedupe"),
        ({"fail_after_rate": 1.5}, "fail_after_rate"),
        ({"latency_ms": -1}, "latency_ms"),
        ({"seed": "x"}, "seed"),
        ({"fault_keys": {"k": "explode"}}, "fault_keys"),
    ],
)
def test_invalid_config_is_rejected_without_effect(
    provider: ProviderSimulator, client: httpx.Client, update: dict[str, Any], named: str
) -> None:
    before = provider.configure()

    response = client.post("/_config", json={"dedupe": True, **update})
    assert response.status_code == 400
    assert named in response.json()["error"]
    with pytest.raises(ValueError, match=named):
        provider.configure(**update)

    assert provider.configure() == before


def test_config_body_must_be_object(client: httpx.Client) -> None:
    assert client.post("/_config", json=[1]).status_code == 400


def test_reset_clears_state_and_config(provider: ProviderSimulator, client: httpx.Client) -> None:
    provider.configure(dedupe=True, fault_keys={"x": "garbage"})
    charge(client, "order-1")

    assert client.post("/_reset").status_code == 200

    assert provider.stats()["effects"] == {}
    assert provider.stats()["requests"] == 0
    config = provider.configure()
    assert config["dedupe"] is False
    assert config["fault_keys"] == {}
    assert charge(client, "order-1").json()["id"] == "ch_1"


def test_unknown_path_is_404(client: httpx.Client) -> None:
    assert client.get("/nope").status_code == 404
    assert client.post("/charges/extra", json={}).status_code == 404


def test_keep_alive_reuses_one_connection(provider: ProviderSimulator) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(provider.url.rsplit(":", 1)[1]), timeout=5)
    try:
        for i in range(3):
            conn.request("POST", "/charges", body=b"{}", headers={"Idempotency-Key": f"k{i}"})
            response = conn.getresponse()
            assert response.status == 200
            assert not response.will_close
            response.read()
        sock = conn.sock
        conn.request("GET", "/_stats")
        conn.getresponse().read()
        assert conn.sock is sock
    finally:
        conn.close()


def test_stop_cuts_idle_keep_alive_connections_promptly() -> None:
    sim = ProviderSimulator().start()
    try:
        with httpx.Client(base_url=sim.url) as c:
            charge(c, "k")  # leaves a pooled keep-alive connection open
            started = time.monotonic()
            sim.stop()
            assert time.monotonic() - started < 3.0
    finally:
        sim.stop()


def test_server_is_quiet(capfd: pytest.CaptureFixture[str], client: httpx.Client) -> None:
    for i in range(3):
        charge(client, f"k{i}")
    client.get("/nope")

    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err == ""


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.com", ""])
def test_refuses_non_loopback_host(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        ProviderSimulator(host)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_binds_loopback_names(host: str) -> None:
    with ProviderSimulator(host) as sim, httpx.Client(base_url=sim.url) as c:
        assert sim.url.startswith("http://127.0.0.1:")
        assert c.get("/_stats").status_code == 200


def test_command_line_serves_until_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "provider.url"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    with subprocess.Popen(
        [sys.executable, "-m", "outbox.testing.provider", "--dedupe", "--ready-file", str(ready)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            deadline = time.monotonic() + 10
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "provider did not become ready"
                time.sleep(0.02)
            url = ready.read_text()
            assert url.startswith("http://127.0.0.1:")

            with httpx.Client(base_url=url, timeout=5) as c:
                charge(c, "order-1")
                charge(c, "order-1")
                assert c.get("/_stats").json()["effects"] == {"order-1": 1}

            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    assert proc.returncode == 0, err
    assert out == f"provider listening on {url}\n"
    assert err == ""


# -- named faults: the switches the pytest plugin's users reach for -----------------------------


def test_decline_answers_402_without_charging_until_healthy(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    provider.decline()
    assert [charge(client, f"k{i}").status_code for i in range(3)] == [402, 402, 402]
    provider.healthy()
    assert charge(client, "k0").status_code == 200
    stats = provider.stats()
    assert stats["declined"] == 3 and stats["faults"]["decline"] == 3
    assert provider.charges() == 1 and provider.charges("k0") == 1 and provider.charges("k1") == 0


def test_times_applies_to_the_next_charges_whatever_their_key(
    provider: ProviderSimulator, client: httpx.Client
) -> None:
    provider.unavailable(times=2)
    provider.drop_after_charge(times=1)
    assert charge(client, "a").status_code == 503
    assert charge(client, "b").status_code == 503
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        charge(client, "c")
    assert charge(client, "d").status_code == 200
    assert provider.stats()["effects"] == {"c": 1, "d": 1}
    assert provider.configure()["fault_next"] == []


def test_unavailable_until_healthy(provider: ProviderSimulator, client: httpx.Client) -> None:
    provider.unavailable()
    provider.configure(fault_keys={"x": "garbage"})
    assert all(charge(client, f"k{i}").status_code == 503 for i in range(4))
    provider.healthy()  # keyed faults go too: "healthy" means every call goes through
    assert provider.configure()["fault_keys"] == {}
    assert charge(client, "x").status_code == 200
    assert charge(client, "x").json()["status"] == "succeeded"
    assert provider.charges("x") == 2


def test_slow_delays_each_answer(provider: ProviderSimulator, client: httpx.Client) -> None:
    provider.slow(300)
    started = time.monotonic()
    assert charge(client, "k").status_code == 200
    assert time.monotonic() - started >= 0.29
    provider.healthy()
    assert provider.configure()["latency_ms"] == 0


@pytest.mark.parametrize("times", [0, -1, 1.5, True])
def test_times_must_be_a_positive_integer(provider: ProviderSimulator, times: Any) -> None:
    with pytest.raises(ValueError, match="times must be a positive integer"):
        provider.decline(times=times)
    assert provider.configure()["fault_next"] == []


def test_fault_next_is_validated(provider: ProviderSimulator) -> None:
    with pytest.raises(ValueError, match="fault_next"):
        provider.configure(fault_next=["explode"])
