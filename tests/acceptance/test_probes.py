"""`outbox relay` and `outbox reconcile` with --metrics-port, as an orchestrator and Prometheus
see them: /healthz and /readyz answer, /metrics counts what the relay published, and the
reconciler's row gauges are what `outbox status --json` says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from helpers import free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

import outbox

from .support import HANDLERS, Processes, states
from .test_worker_process import _children

DESTINATION = "payments.charge"


@pytest.fixture
def procs(clean, provider, tmp_path):
    p = Processes(clean, provider.url, tmp_path)
    yield p
    p.stop_all()


def get(port: int, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    except httpx.TransportError:
        return None  # not listening yet


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = get(port, "/metrics")
    assert response is not None and response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def write(engine, n: int, first: int = 0) -> None:
    with Session(engine) as s, s.begin():
        for i in range(first, first + n):
            outbox.write(
                s, key=f"order:{i}", step="charge", destination=DESTINATION, payload={"amount_cents": 100}
            )


def test_relay_and_reconciler_serve_probes_and_metrics_that_agree_with_status(clean, engine, procs):
    relay_port, reconciler_port = free_port(), free_port()
    relay = procs.start("relay", "--metrics-port", str(relay_port))
    reconciler = procs.start(
        "reconcile", HANDLERS, "--interval", "0.5", "--metrics-port", str(reconciler_port)
    )
    for port in (relay_port, reconciler_port):
        healthz = wait_for(lambda p=port: get(p, "/healthz"), 30, f"/healthz on {port}")
        assert healthz.status_code == 200 and healthz.json()["status"] == "ok", healthz.text
        ready = get(port, "/readyz")
        assert ready is not None and ready.status_code == 200, ready.text if ready else None
        assert get(port, "/nothing").status_code == 404

    write(engine, 5)
    published = ("outbox_relay_rows_published_total", (("destination", DESTINATION),))
    wait_for(lambda: samples(relay_port).get(published) == 5, 30, "the relay's counter to reach 5", every=0.2)
    assert samples(relay_port)[("outbox_relay_batches_total", (("result", "published"),))] >= 1

    # No worker runs: the rows wait dispatched, and the destination has no consumer.
    def gauges() -> dict[str, float]:
        s = samples(reconciler_port)
        return {
            state: s.get(("outbox_rows", (("destination", DESTINATION), ("state", state))), -1)
            for state in ("pending", "dispatched", "in_flight", "unknown", "failed")
        }

    wait_for(lambda: gauges()["dispatched"] == 5, 30, "the reconciler's gauge to see 5 dispatched", every=0.2)
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--json"],
        env=procs.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    by_state = json.loads(status.stdout)["destinations"][DESTINATION]
    assert gauges() == {state: by_state[state] for state in gauges()}
    s = samples(reconciler_port)
    assert s[("outbox_destination_without_consumer", (("destination", DESTINATION),))] == 1
    age = s[("outbox_oldest_row_age_seconds", (("destination", DESTINATION), ("state", "dispatched")))]
    assert 0 <= age < 60
    runs = ("outbox_reconciler_job_runs_total", (("job", "database_metrics"), ("result", "ran")))
    assert s[runs] >= 1

    for proc in (relay, reconciler):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, procs.log_of(proc)


def sent(clean) -> int:
    return states(clean).get("sent", 0)


def test_a_worker_of_two_processes_serves_the_sum_of_its_childrens_counts(clean, engine, procs):
    port = free_port()
    # From the environment, as a compose file sets it: the children must not inherit it (they
    # would all bind the parent's port and die).
    worker = procs.start(
        "worker", HANDLERS, "--processes", "2", "--concurrency", "2", OUTBOX_METRICS_PORT=str(port)
    )
    healthz = wait_for(lambda: get(port, "/healthz"), 60, "the worker's /healthz")
    assert healthz.status_code == 200 and healthz.json()["process"] == "worker"
    assert get(port, "/readyz").status_code == 200
    wait_for(lambda: procs.log_of(worker).count("outbox worker started") == 2, 60, "both children to start")
    procs.relay()

    write(engine, 10)
    wait_for(lambda: sent(clean) == 10, 60, "10 rows sent")
    # A child dies: what it counted stays counted (a counter never goes down).
    os.kill(_children(worker.pid)[0], signal.SIGKILL)
    wait_for(lambda: "restarting it" in procs.log_of(worker), 30, "the supervisor to restart the child")
    wait_for(lambda: procs.log_of(worker).count("outbox worker started") == 3, 60, "the new child to start")
    write(engine, 10, first=10)
    wait_for(lambda: sent(clean) == 20, 60, "20 rows sent")

    s = samples(port)
    d = (("destination", DESTINATION),)
    assert s[("outbox_deliveries_total", (*d, ("outcome", "sent")))] == 20
    assert s[("outbox_provider_responses_total", (*d, ("status_class", "2xx")))] == 20
    assert s[("outbox_written_to_confirmed_seconds_count", d)] == 20
    assert s[("outbox_claim_to_confirmed_seconds_count", d)] == 20
    assert 0 < s[("outbox_written_to_confirmed_seconds_sum", d)] < 20 * 60

    # A child frozen (SIGSTOP) while its parent supervises on: the worker is not healthy.
    frozen = _children(worker.pid)[0]
    os.kill(frozen, signal.SIGSTOP)
    try:
        stale = wait_for(
            lambda: (r := get(port, "/healthz")) is not None and r.status_code == 503 and r,
            60,
            "/healthz to report the frozen child",
            every=1,
        )
        assert stale.json()["status"] == "stale"
    finally:
        os.kill(frozen, signal.SIGCONT)
    wait_for(lambda: get(port, "/healthz").status_code == 200, 30, "/healthz to recover", every=0.5)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0, procs.log_of(worker)
