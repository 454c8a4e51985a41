"""A chain survives a worker SIGKILLed at each point of claim → call → record → ack of a step
with a ``then`` (issue 14): every step is called once (the provider does not deduplicate, so a
second call would be a second effect), exactly one next row exists per step, and the chain ends
with every step sent. Real processes: ``outbox worker``, ``outbox relay``, ``outbox reconcile``
with ``examples.invoicing.handlers``."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis
from helpers import relay_once, sql, wait_for
from sqlalchemy.orm import Session

from outbox import transport

from .support import Processes

pytestmark = pytest.mark.timeout(240)

MODULE = "examples.invoicing.handlers"
KEY = "invoice:INV-9"
STEPS = ("issue", "export", "notify")


def chain(services) -> list[tuple[str, str, int | None, str | None]]:
    return sql(
        services,
        "SELECT step, state, parent_id, via FROM outbox_message WHERE key = %s ORDER BY id",
        (KEY,),
    )


def start_invoice(engine) -> int:
    import examples.invoicing.handlers as invoicing

    with Session(engine) as s, s.begin():
        return invoicing.start_invoice(s, invoice="INV-9", customer="ada", amount_cents=4200).id


@pytest.mark.parametrize("point", ["after_claim", "after_call", "after_record"])
def test_a_chain_survives_a_worker_killed_at_each_point_of_a_step(clean, engine, provider, tmp_path, point):
    timings = {"INVOICING_API_URL": provider.url, "INVOICING_TIME_LIMIT": "2", "INVOICING_LEASE_SECONDS": "3"}
    procs = Processes(clean, provider.url, tmp_path, timings=timings)
    try:
        issue_id = start_invoice(engine)
        relay_once(clean)
        crashing = procs.start("worker", MODULE, "--concurrency", "1", OUTBOX_FAILPOINTS=point)
        assert crashing.wait(30) == -9
        written = [step for step, *_ in chain(clean)]
        # The next step exists exactly when the step was recorded sent: never before.
        assert written == (["issue", "export"] if point == "after_record" else ["issue"])
        assert provider.stats()["effects"] == ({} if point == "after_claim" else {f"{KEY}:issue": 1})

        if point == "after_record":
            # The broker's message was never acked: delivered again, it claims nothing.
            client = redis.Redis.from_url(clean.redis_url)
            try:
                transport.publish_rows(
                    client, clean.namespace, [(issue_id, "invoicing.issue", datetime.now(UTC))]
                )
            finally:
                client.close()
        procs.start("relay")
        procs.start("reconcile", MODULE, "--interval", "0.5")
        procs.start("worker", MODULE, "--concurrency", "2")
        wait_for(
            lambda: [(s, st) for s, st, *_ in chain(clean)] == [(s, "sent") for s in STEPS],
            90,
            f"the chain to end sent\n{procs.logs()}",
        )
        rows = chain(clean)
        ids = dict(sql(clean, "SELECT step, id FROM outbox_message WHERE key = %s", (KEY,)))
        assert [(s, parent, via) for s, _, parent, via in rows] == [
            ("issue", None, None),
            ("export", ids["issue"], "then"),
            ("notify", ids["export"], "then"),
        ]
        assert provider.stats()["effects"] == {f"{KEY}:{s}": 1 for s in STEPS}
    finally:
        procs.stop_all()
