"""Job ``held_destinations`` (issue 13 part 4): a pause or a breaker trip is alerted once per
episode through the alert hook, not once per row, and the mark is cleared when the episode ends,
so that the next one alerts again. Real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from outbox import pauses
from outbox.alerts import AlertRow
from outbox.reconciler.jobs.held_destinations import held_destinations

from .support import DEST, declare_charge, write_rows


class Hook:
    def __init__(self, *, fail: bool = False) -> None:
        self.alerts: list[AlertRow] = []
        self.fail = fail

    def __call__(self, row: AlertRow) -> None:
        if self.fail:
            raise RuntimeError("pager down")
        self.alerts.append(row)


def pause(engine: Any, **kw: Any) -> None:
    with engine.begin() as conn:
        pauses.pause(conn, DEST, by="ana", reason="INC-42", **kw)


def resume(engine: Any) -> None:
    with engine.begin() as conn:
        pauses.resume(conn, DEST, by="ana")


def trip(engine: Any) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_destination (destination, breaker_opened_at, breaker_open_until, "
                "breaker_open_seconds, breaker_reason) VALUES (:d, now(), now() + interval '1 minute', 10, "
                "'HTTP 503 from 127.0.0.1 (row 1)') ON CONFLICT (destination) DO UPDATE SET "
                "breaker_opened_at = now(), breaker_open_until = now() + interval '1 minute', "
                "breaker_open_seconds = 10, breaker_reason = EXCLUDED.breaker_reason"
            ),
            {"d": DEST},
        )


def test_a_pause_is_alerted_once_and_again_after_it_ended_and_began_anew(clean, engine, db, provider):
    declare_charge(provider)
    ids = write_rows(engine, 3)
    hook = Hook()
    pause(engine)
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    [alert] = hook.alerts
    assert alert.state == "paused" and alert.destination == DEST and alert.id == ids[0]
    assert (
        alert.key == "order:0"
        and "paused since" in alert.reason
        and "by ana, until resumed: INC-42" in alert.reason
    )
    assert "3 row(s) wait" in alert.reason
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1}, "once per episode"
    pause(engine, for_seconds=3600)  # the same episode, a new end: not a new alert
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1}
    assert len(hook.alerts) == 1

    resume(engine)
    assert held_destinations(db, hook, alert_after_seconds=0) == {"ended": 1}
    assert held_destinations(db, hook, alert_after_seconds=0) == {}
    pause(engine)
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    assert len(hook.alerts) == 2


def test_a_breaker_trip_is_alerted_once_and_its_end_clears_the_mark(clean, engine, db, provider):
    declare_charge(provider)
    hook = Hook()
    trip(engine)
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    [alert] = hook.alerts
    assert alert.state == "breaker_open" and alert.id == 0 and alert.key == ""
    assert "circuit breaker open since" in alert.reason and "HTTP 503" in alert.reason
    assert "0 row(s) wait" in alert.reason
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1}
    db.execute("UPDATE outbox_destination SET breaker_opened_at = NULL, breaker_open_until = NULL")
    assert held_destinations(db, hook, alert_after_seconds=0) == {"ended": 1}
    trip(engine)
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    assert [a.state for a in hook.alerts] == ["breaker_open", "breaker_open"]


def test_a_short_episode_is_not_alerted_and_a_failing_hook_is_tried_again(clean, engine, db, provider):
    declare_charge(provider)
    pause(engine)
    trip(engine)
    assert held_destinations(db, Hook(), alert_after_seconds=3600) == {"held": 2}
    failing = Hook(fail=True)
    assert held_destinations(db, failing, alert_after_seconds=0) == {"held": 2, "hook_errors": 2}
    hook = Hook()
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 2, "alerts": 2}
    assert sorted(a.state for a in hook.alerts) == ["breaker_open", "paused"]


@pytest.mark.parametrize("kind", ["pause", "breaker"])
def test_the_reconciler_runs_it_with_its_alert_hook(clean, engine, db, provider, kind):
    from outbox.handlers import registry
    from outbox.reconciler.scheduler import Reconciler

    declare_charge(provider)
    pause(engine) if kind == "pause" else trip(engine)
    db.execute(
        "UPDATE outbox_destination SET paused_at = now() - interval '2 minutes', "
        "breaker_opened_at = breaker_opened_at - interval '2 minutes'"
    )
    hook = Hook()
    reconciler = Reconciler(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        handlers=registry(),
        module="tests",
        namespace=clean.namespace,
        alert_hook=hook,
    )
    try:
        done = reconciler.run_once()
    finally:
        reconciler.close()
    assert done["held_destinations"] == {"held": 1, "alerts": 1}
    assert [a.state for a in hook.alerts] == ["paused" if kind == "pause" else "breaker_open"]


def test_rows_whose_deadline_passes_while_held_back_are_failed_without_a_call(clean, engine, db, provider):
    """(attack on part 3, F4) Behind an open breaker (or a pause) no claim comes to fail a row
    whose deadline passed: the job does, so the failure is reported when it happens."""
    from datetime import UTC, datetime, timedelta

    from .support import get

    declare_charge(provider)
    soon = datetime.now(UTC) + timedelta(seconds=1)
    late = write_rows(engine, 2, deadline=soon)
    later = write_rows(engine, 1, start=2, deadline=datetime.now(UTC) + timedelta(hours=1))
    other = write_rows(engine, 1, start=3, destination="mail.send", deadline=soon)
    trip(engine)
    db.execute(
        "UPDATE outbox_message SET state = 'dispatched', dispatched_at = now() WHERE id = %s", (late[0],)
    )
    db.execute("SELECT pg_sleep(1.1)")
    assert held_destinations(db, Hook(), alert_after_seconds=3600) == {"held": 1, "past_deadline": 2}
    for row_id in late:
        moved = get(db, row_id)
        assert moved["state"] == "failed" and moved["attempts"] == 0
        assert "passed while its destination was held back (its breaker open)" in moved["last_error"]
    assert get(db, later[0])["state"] == "pending", "its deadline has not passed"
    assert get(db, other[0])["state"] == "pending", "not held back: its claim fails it"
    assert provider.stats()["requests"] == 0


def _idempotent_charge_held_past_its_deadline(engine: Any, db: Any, provider: Any, consumer: Any) -> Any:
    """An idempotent destination's row whose first call charged and answered 500 (ambiguous):
    retried, so `pending` with the charge at the provider; then its destination is paused
    past the row's deadline."""
    from datetime import UTC, datetime, timedelta

    from helpers import elapse

    from outbox.consumer import DeliveryResult

    handler = declare_charge(provider, idempotent=True)
    [row] = write_rows(engine, 1, deadline=datetime.now(UTC) + timedelta(hours=2))
    provider.configure(fault_next=["fail_after"])
    assert consumer().deliver(row, DEST) is DeliveryResult.PENDING
    assert provider.charges("order:0:charge") == 1
    pause(engine)
    elapse(db, 3 * 3600)
    return handler, row


def test_a_row_that_may_have_charged_goes_unknown_not_failed_past_its_deadline(
    clean, engine, db, provider, consumer
):
    """(attack on issue 13, F1) Failed, the row would hide the provider's charge: it goes to
    `unknown` and the lookup finds the charge."""
    from outbox.reconciler.jobs.resolve_unknown import resolve_unknown

    from .support import get

    handler, row = _idempotent_charge_held_past_its_deadline(engine, db, provider, consumer)
    counts = held_destinations(db, Hook(), alert_after_seconds=3600)
    assert counts == {"held": 1, "past_deadline_unknown": 1}
    moved = get(db, row)
    assert moved["state"] == "unknown" and "the lookup decides" in moved["last_error"]
    assert resolve_unknown(db, {DEST: handler}) == {"sent": 1}
    final = get(db, row)
    assert final["state"] == "sent" and final["provider_ref"] == "ch_1"
    assert provider.charges("order:0:charge") == 1


def test_a_claim_past_the_deadline_of_a_row_that_may_have_charged_sends_it_unknown(
    clean, engine, db, provider, consumer
):
    """The same row claimed after the resume (the reconciler did not run meanwhile): no call,
    and not failed either: `unknown`, for the lookup."""
    from outbox.consumer import DeliveryResult

    from .support import get

    _, row = _idempotent_charge_held_past_its_deadline(engine, db, provider, consumer)
    resume(engine)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    moved = get(db, row)
    assert moved["state"] == "unknown" and "deadline passed before the call" in moved["last_error"]
    assert provider.stats()["requests"] == 1, "no second call"


def test_a_chain_of_short_retry_after_holds_is_one_episode_alerted_once(clean, engine, db, provider):
    """(attack on issue 13, F3) A provider answering "503, Retry-After: 55" to every probe makes
    holds shorter than the alert threshold, one after the other: one episode, alerted once it
    has lasted the threshold, cleared once over for good."""
    import time

    declare_charge(provider)
    hook = Hook()

    def hold() -> Any:
        pauses.hold(db, DEST, seconds=0.3, by="worker h:1", reason="HTTP 503 with Retry-After 0.3 s")
        return db.execute("SELECT paused_at FROM outbox_destination").fetchone()[0]

    first = hold()
    time.sleep(0.4)  # it ran out; the next probe got a 503 again
    assert hold() == first, "the same episode"
    time.sleep(0.2)
    assert held_destinations(db, hook, alert_after_seconds=0.5) == {"held": 1, "alerts": 1}
    time.sleep(0.2)
    assert hold() == first
    assert held_destinations(db, hook, alert_after_seconds=0.5) == {"held": 1}, "alerted once"
    time.sleep(0.4)
    assert held_destinations(db, hook, alert_after_seconds=0.5) == {}, "a gap, not the end yet"
    assert held_destinations(db, hook, alert_after_seconds=0.5, episode_gap_seconds=0.1) == {"ended": 1}
    assert len(hook.alerts) == 1


def test_a_resume_ends_the_episode_at_once(clean, engine, db, provider):
    declare_charge(provider)
    pause(engine)
    first = db.execute("SELECT paused_at FROM outbox_destination").fetchone()[0]
    resume(engine)
    pause(engine)
    assert db.execute("SELECT paused_at FROM outbox_destination").fetchone()[0] > first


def test_a_resume_ends_a_breaker_episode_and_the_next_trip_alerts_again(clean, engine, db, provider):
    """(user review) The on-call who resumed by hand must hear of a re-trip; a breaker that closes
    by its own probe and trips again soon after is the same outage, alerted once."""
    import outbox
    from outbox import breaker

    declare_charge(provider)
    hook = Hook()
    one = outbox.Breaker(failures=1)
    assert breaker.count_not_processed(db, DEST, one, reason="HTTP 503 (row 1)")
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    resume(engine)
    assert breaker.count_not_processed(db, DEST, one, reason="HTTP 503 (row 2)")
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}

    # Closed by a probe (not by hand), then tripped again: the same episode.
    db.execute(
        "UPDATE outbox_destination SET breaker_opened_at = NULL, breaker_open_until = NULL, "
        "breaker_open_seconds = NULL, breaker_closed_at = now()"
    )
    assert breaker.count_not_processed(db, DEST, one, reason="HTTP 503 (row 3)")
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1}
    assert len(hook.alerts) == 2


def test_a_breaker_alert_keeps_the_status_never_the_providers_text(clean, engine, db, provider):
    """The breaker's reason is the latest delivery's error, a handler's or a provider's text that
    may echo a payload: the alert says the status and where to read the rest."""
    declare_charge(provider)
    trip(engine)
    db.execute(
        "UPDATE outbox_destination SET breaker_reason = %s WHERE destination = %s",
        ('busy: {"email": "alice@example.com", "amount_cents": 1000} (HTTP 503) (row 7)', DEST),
    )
    hook = Hook()
    assert held_destinations(db, hook, alert_after_seconds=0) == {"held": 1, "alerts": 1}
    [alert] = hook.alerts
    assert "the latest calls were not processed (HTTP 503)" in alert.reason
    assert "withheld from alerts" in alert.reason and "outbox status" in alert.reason
    assert "alice" not in alert.reason and "amount_cents" not in alert.reason and "busy" not in alert.reason
