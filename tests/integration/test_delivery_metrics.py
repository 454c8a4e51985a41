"""The worker's delivery metrics, counted by the real delivery path (through the pytest plugin's
in-process ``deliver``) against the provider simulator's faults."""

from __future__ import annotations

import outbox
from outbox import metrics
from outbox.testing.delivery import deliver, pass_time

from .test_consumer import charge_handler

D = "payments.charge"


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"destination": D, **labels}) or 0.0


def snapshot() -> dict[str, float]:
    out = {}
    for outcome in ("sent", "failed", "pending", "unknown", "empty"):
        out[outcome] = sample("outbox_deliveries_total", outcome=outcome)
    for cls in ("2xx", "4xx", "5xx", "none"):
        out[cls] = sample("outbox_provider_responses_total", status_class=cls)
    for h in ("written_to_confirmed", "claim_to_confirmed", "published_to_claimed"):
        out[f"{h}_count"] = sample(f"outbox_{h}_seconds_count")
        out[f"{h}_sum"] = sample(f"outbox_{h}_seconds_sum")
    return out


def test_each_outcome_and_answer_class_is_counted_and_the_latency_measured_from_the_write(
    clean, engine, provider
):
    charge = charge_handler(provider, backoff=(30,))  # the consumer tests' own: 402 fails at once

    from sqlalchemy.orm import Session

    with Session(engine) as s, s.begin():
        ids = [
            outbox.write(s, key=f"order:{i}", step="charge", destination=D, payload={}).id for i in range(4)
        ]
    provider.decline(times=1)
    provider.unavailable(times=1)
    provider.drop_after_charge(times=1)
    pass_time(100, database_url=clean.database_url)  # written 100 s ago, still claimed in id order
    before = snapshot()

    results = deliver({D: charge}, database_url=clean.database_url)

    assert [results[i] for i in ids] == ["failed", "pending", "unknown", "sent"]
    after = snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert {k: delta[k] for k in ("sent", "failed", "pending", "unknown", "empty")} == {
        "sent": 1,
        "failed": 1,
        "pending": 1,
        "unknown": 1,
        "empty": 0,
    }
    assert {k: delta[k] for k in ("2xx", "4xx", "5xx", "none")} == {"2xx": 1, "4xx": 1, "5xx": 1, "none": 1}
    # Only the sent row is confirmed; it was written 100 s before its claim.
    assert delta["written_to_confirmed_count"] == 1 and 100 <= delta["written_to_confirmed_sum"] < 160
    assert delta["claim_to_confirmed_count"] == 1 and 0 < delta["claim_to_confirmed_sum"] < 2
    # Never published (delivered in-process from pending): no publication to measure from.
    assert delta["published_to_claimed_count"] == 0
