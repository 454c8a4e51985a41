"""The web dashboard's actions, through its HTTP interface only: a confirmation acts on exactly the
rows (or the repair plan) its preview showed, never on rows moved or added since, and follows the
CLI's rules (no bulk where the CLI refuses it, a resolve of the episode the page showed, a
repair by an operator with a reason); pauses for a duration; two operators confirming one
preview at once act once."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from helpers import ids_by_state, relay_once, sql
from starlette.applications import Starlette

import outbox
from outbox.consumer import DeliveryResult
from outbox.dashboard import create_app

from .support import (
    DEST,
    SECRET,
    declare,
    login,
    token_of,
    write,
)


def confirm_form(preview_html: str) -> dict[str, Any]:
    form: dict[str, Any] = dict(
        re.findall(r'name="(action|fingerprint|csrf_token)" value="([^"]*)"', preview_html)
    )
    form["id"] = re.findall(r'name="id" value="(\d+)"', preview_html)
    return form


def _unknown_row(engine: Any, clean: Any, provider: Any, consumer: Any, key: str) -> int:
    row = write(engine, key)
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    return row


def _failed_rows(engine: Any, clean: Any, provider: Any, consumer: Any) -> tuple[int, int]:
    declare(provider)
    declined = write(engine, "order:100")
    ambiguous = write(engine, "order:101")
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(declined, DEST) is DeliveryResult.FAILED
    provider.drop_after_charge(times=1)
    assert consumer().deliver(ambiguous, DEST) is DeliveryResult.UNKNOWN
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, ambiguous, failed_reason="support gave up", by="test")
    return declined, ambiguous


def test_tampered_confirm_forms_act_on_nothing_unpreviewed(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declined, ambiguous = _failed_rows(engine, clean, provider, consumer)
    other = write(engine, "order:102")  # pending
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/preview", data={"action": "replay", "id": [str(declined)], "csrf_token": token})
    form = confirm_form(preview.text)
    # Another action with the same fingerprint.
    r = client.post("/apply", data={**form, "action": "cancel", "reason": "x"})
    assert "changed since the preview" in r.text
    # Extra ids: the refused one, a pending one, duplicates, unicode digits.
    r = client.post(
        "/apply",
        data={**form, "id": [str(declined), str(ambiguous), str(other), str(declined), "0"], "reason": "x"},
    )
    assert ids_by_state(clean)["failed"] >= {ambiguous}
    assert other in ids_by_state(clean)["pending"]
    # No id at all, empty fingerprint.
    r = client.post("/apply", data={**form, "id": [], "reason": "x"})
    assert r.status_code == 400
    r = client.post("/apply", data={**form, "fingerprint": "", "reason": "x"})
    assert "changed since the preview" in r.text
    # Cancel of the ambiguous failed row: not pending, refused.
    p = client.post("/preview", data={"action": "cancel", "id": str(ambiguous), "csrf_token": token})
    assert "0 row(s) will be acted on" in p.text
    # resolve-failed of a failed row: refused.
    p = client.post("/preview", data={"action": "resolve-failed", "id": str(ambiguous), "csrf_token": token})
    assert "0 row(s) will be acted on" in p.text
    assert ambiguous in ids_by_state(clean)["failed"]


def test_never_in_bulk_and_never_the_refused_replay(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    _declined, ambiguous = _failed_rows(engine, clean, provider, consumer)
    client = login(app, "olga")
    token = token_of(client)
    for action in ("resolve-sent", "resolve-not-sent", "replay-force", "force", "resolve", "skip", "repair"):
        r = client.post("/preview", data={"action": action, "state": "unknown", "csrf_token": token})
        assert r.status_code == 400, action
        r = client.post(
            "/apply",
            data={
                "action": action,
                "id": str(ambiguous),
                "fingerprint": "x",
                "reason": "x",
                "csrf_token": token,
            },
        )
        assert r.status_code in (400, 200) and ambiguous in ids_by_state(clean)["failed"], action
    # A force flag in the form is ignored.
    preview = client.post(
        "/preview", data={"action": "replay", "id": str(ambiguous), "force": "1", "csrf_token": token}
    )
    assert "0 row(s) will be acted on; 1 refused" in preview.text
    r = client.post(
        "/apply",
        data={
            "action": "replay",
            "id": str(ambiguous),
            "fingerprint": confirm_form(preview.text).get("fingerprint", ""),
            "force": "yes",
            "reason": "x",
            "csrf_token": token,
        },
    )
    assert ambiguous in ids_by_state(clean)["failed"]


def test_resolve_one_row_follows_the_cli_rules(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:300")
    pending = write(engine, "order:301")
    client = login(app, "olga")
    token = token_of(client)
    # Not unknown: refused.
    r = client.post(f"/rows/{pending}/resolve", data={"how": "not-sent", "reason": "x", "csrf_token": token})
    assert r.status_code == 409
    # sent with a blank ref: refused.
    r = client.post(
        f"/rows/{row}/resolve", data={"how": "sent", "ref": "  ", "reason": "x", "csrf_token": token}
    )
    assert r.status_code == 409
    # Two "how"s: only the first is read.
    r = client.post(
        f"/rows/{row}/resolve",
        data={"how": ["bogus", "sent"], "ref": "ch", "reason": "x", "csrf_token": token},
    )
    assert r.status_code == 400
    assert row in ids_by_state(clean)["unknown"]


# Without the guard: the row page's resolve form carries no version of the
# unknown episode it showed: a 'not sent' meant for one ambiguous call settles a later one (a second charge
# re-run)
def test_resolve_not_sent_from_a_stale_page_does_not_settle_a_newer_ambiguous_call(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider, max_attempts=5)
    row = _unknown_row(engine, clean, provider, consumer, "order:310")
    client = login(app, "olga")
    page = client.get(f"/rows/{row}")
    form_html = re.search(r'<form method="post" action="/rows/\d+/resolve".*?</form>', page.text, re.S).group(
        0
    )  # type: ignore[union-attr]
    hidden = dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form_html))
    # Meanwhile: another operator settles that call not-sent (CLI); the row runs again and its
    # new call is ambiguous too (the provider may have charged).
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, row, not_sent=True, by="cli", reason="provider has nothing")
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.UNKNOWN
    # The first operator now confirms what they saw on the old page.
    r = client.post(
        f"/rows/{row}/resolve", data={**hidden, "how": "not-sent", "reason": "provider has nothing"}
    )
    assert r.status_code == 409
    assert row in ids_by_state(clean)["unknown"]


def test_a_row_moved_between_preview_and_confirm_stops_the_cancel(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare(provider, idempotent=True, max_attempts=3, backoff=(600,))
    row = write(engine, "order:400")
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/preview", data={"action": "cancel", "id": str(row), "csrf_token": token})
    assert "1 row(s) will be acted on" in preview.text
    form = confirm_form(preview.text)
    # Published, claimed, ambiguous; retried: pending again, with a call that may have charged.
    relay_once(clean)
    provider.drop_after_charge(times=1)
    assert consumer().deliver(row, DEST) is DeliveryResult.PENDING
    r = client.post("/apply", data={**form, "reason": "customer left"})
    assert r.status_code in (200, 400)
    assert row in ids_by_state(clean)["pending"]


def test_a_filter_preview_of_another_destination_or_state_acts_only_on_what_it_named(
    app: Starlette, engine: Any, clean: Any
) -> None:
    a = write(engine, "order:500")
    b = write(engine, "order:501", destination="mail.send")
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post(
        "/preview", data={"action": "cancel", "state": "pending", "destination": DEST, "csrf_token": token}
    )
    assert "1 row(s) will be acted on; 0 refused" in preview.text
    form = confirm_form(preview.text)
    assert form["id"] == [str(a)]
    # New row written between preview and confirm, same filter: untouched.
    c = write(engine, "order:502")
    client.post("/apply", data={**form, "reason": "x"})
    assert ids_by_state(clean)["cancelled"] == {a}
    assert {b, c} <= ids_by_state(clean)["pending"]
    # A filter with a key prefix containing LIKE wildcards takes them literally.
    write(engine, "orderX500")
    p = client.post(
        "/preview", data={"action": "cancel", "state": "pending", "key_prefix": "order_", "csrf_token": token}
    )
    assert p.status_code == 400  # "order_" is a literal prefix: no row


def _repair_app(clean: Any, engine: Any, users_text: str) -> Starlette:
    from outbox.handlers import registry

    return create_app(
        engine=engine,
        secret=SECRET,
        users=users_text,
        database_url=clean.database_url,
        handlers=registry(),
        module=__name__,
    )


def _claimed_then_unknown(clean: Any, row: int) -> None:
    """The worker died after its claim (no call reached the provider); the lease ran out: unknown."""
    import psycopg
    from helpers import elapse

    from outbox import store
    from outbox.handlers import registry
    from outbox.reconciler.jobs.expire_leases import expire_leases
    from outbox.settings import libpq_url

    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.claim(conn, row_id=row, destination=DEST, lease_seconds=5)
        elapse(conn, 6, [row])
        assert expire_leases(conn, registry()) == 1
        elapse(conn, 120, [row])  # no call can still be landing


# Without the guard: POST /keys/repair confirm=yes re-plans from the key
# (app.py repair): the confirmation carries no fingerprint, so it acts on a plan the operator never saw
# (here it re-runs a row another operator failed on purpose)
def test_repair_confirm_acts_only_on_the_previewed_plan(
    clean: Any, engine: Any, users_text: str, provider: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare(provider), provider)
    row = write(engine, "order:700")
    _claimed_then_unknown(clean, row)
    app = _repair_app(clean, engine, users_text)
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/keys/repair", data={"key": "order:700", "csrf_token": token})
    assert preview.status_code == 200 and "Confirm the repair" in preview.text, preview.text
    assert "unknown" in preview.text or "ask the provider" in preview.text
    hidden = dict(
        re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', preview.text.split('class="confirm"')[1])
    )
    # Meanwhile another operator gives up on the row (support refunded the customer by hand).
    with engine.begin() as c:
        outbox.ops.actions.resolve(c, row, failed_reason="refunded by hand: never charge", by="cli")
    r = client.post("/keys/repair", data={**hidden, "reason": "INC-1"})
    assert r.status_code in (200, 400, 409)
    assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,)) == [("failed",)]


def test_repair_of_a_key_needs_an_operator_and_a_reason(
    clean: Any, engine: Any, users_text: str, provider: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare(provider), provider)
    row = write(engine, "order:701")
    _claimed_then_unknown(clean, row)
    app = _repair_app(clean, engine, users_text)
    reader = login(app, "rita")
    r = reader.post(
        "/keys/repair",
        data={"key": "order:701", "confirm": "yes", "reason": "x", "csrf_token": token_of(reader)},
    )
    assert r.status_code == 403
    olga = login(app, "olga")
    r = olga.post(
        "/keys/repair",
        data={"key": "order:701", "confirm": "yes", "reason": " ", "csrf_token": token_of(olga)},
    )
    assert r.status_code == 400
    assert sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,)) == [("unknown",)]


def declare_storing_answers(provider: Any, **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        if r.status_code == 402:
            raise outbox.PermanentError("card declined")
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response=r.json())

    return charge


def _resolve_hidden(page_html: str) -> dict[str, str]:
    form = re.search(r'<form method="post" action="[^"]*/resolve".*?</form>', page_html, re.S)
    assert form, "no resolve form on the page"
    return dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form.group(0)))


def state_of(clean: Any, row: int) -> str:
    return sql(clean, "SELECT state FROM outbox_message WHERE id = %s", (row,))[0][0]


# Without the guard: the CLI refuses `outbox pause D --until 0` ("must be a positive duration");
# the dashboard's pause takes for=0 (parse_duration -> 0.0), sets paused_until = now(): it reports
# "paused" while nothing is paused, and silently ends another operator's indefinite pause.
# In short: app.py pause: for=0 accepted (CLI refuses <= 0):
# ends a pause
@pytest.mark.parametrize("for_", ["0", "0s", "0.0m"])
def test_pause_for_zero_is_refused_and_keeps_an_outage_pause(
    app: Starlette, engine: Any, clean: Any, for_: str
) -> None:
    write(engine, "order:1")
    with engine.begin() as c:
        outbox.pauses.pause(c, DEST, by="otto", reason="provider outage INC-7")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "typo", "for": for_, "csrf_token": token_of(client)},
    )
    assert r.status_code == 400
    with engine.connect() as c:
        assert [p.destination for p in outbox.pauses.paused(c)] == [DEST]


def test_pause_for_a_short_time_is_a_pause(app: Starlette, engine: Any, clean: Any) -> None:
    write(engine, "order:1")
    client = login(app, "olga")
    r = client.post(
        "/destinations/pause",
        data={"destination": DEST, "reason": "x", "for": "15m", "csrf_token": token_of(client)},
    )
    assert r.status_code == 200
    with engine.connect() as c:
        assert [p.destination for p in outbox.pauses.paused(c)] == [DEST]


def _declined_row(engine: Any, clean: Any, provider: Any, consumer: Any, key: str) -> int:
    declare_storing_answers(provider)
    row = write(engine, key)
    relay_once(clean)
    provider.configure(fault_next=["decline"])
    assert consumer().deliver(row, DEST) is DeliveryResult.FAILED
    return row


def _at_once(calls: list[Any]) -> list[Any]:
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_two_operators_confirming_one_replay_preview_replay_it_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    row = _declined_row(engine, clean, provider, consumer, "order:1000")
    olga, otto = login(app, "olga"), login(app, "otto")
    forms = []
    for c in (olga, otto):
        p = c.post("/preview", data={"action": "replay", "id": str(row), "csrf_token": token_of(c)})
        forms.append(confirm_form(p.text))
    results = _at_once(
        [
            lambda c=c, f=f: c.post("/apply", data={**f, "reason": "card updated"})
            for c, f in zip((olga, otto), forms, strict=True)
        ]
    )
    assert all(r.status_code == 200 for r in results)
    [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
    assert [h["action"] for h in history].count("replay") == 1
    assert state_of(clean, row) == "pending"


def test_two_operators_resolving_one_row_at_once_settle_it_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare_storing_answers(provider)
    row = _unknown_row(engine, clean, provider, consumer, "order:1001")
    olga, otto = login(app, "olga"), login(app, "otto")
    hidden = [_resolve_hidden(c.get(f"/rows/{row}").text) for c in (olga, otto)]
    results = _at_once(
        [
            lambda: olga.post(
                f"/rows/{row}/resolve", data={**hidden[0], "how": "not-sent", "reason": "none"}
            ),
            lambda: otto.post(
                f"/rows/{row}/resolve", data={**hidden[1], "how": "sent", "ref": "ch_9", "reason": "seen"}
            ),
        ]
    )
    assert sorted(r.status_code for r in results) == [200, 409]
    [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
    assert [h["action"] for h in history].count("resolve") == 1


def test_two_operators_bulk_resolving_failed_at_once(
    app: Starlette, engine: Any, clean: Any, provider: Any, consumer: Any
) -> None:
    declare_storing_answers(provider)
    rows = [_unknown_row(engine, clean, provider, consumer, f"order:11{i}") for i in range(3)]
    olga, otto = login(app, "olga"), login(app, "otto")
    forms = []
    for c in (olga, otto):
        data = {"action": "resolve-failed", "state": "unknown", "csrf_token": token_of(c)}
        p = c.post("/preview", data=data)
        forms.append(confirm_form(p.text))
    _at_once(
        [
            lambda c=c, f=f: c.post("/apply", data={**f, "reason": "gave up"})
            for c, f in zip((olga, otto), forms, strict=True)
        ]
    )
    for row in rows:
        [(history,)] = sql(clean, "SELECT history FROM outbox_message WHERE id = %s", (row,))
        assert [h["action"] for h in history].count("resolve") == 1
        assert state_of(clean, row) == "failed"


def test_a_repair_fingerprint_of_one_key_does_not_confirm_another(
    clean: Any, engine: Any, users_text: str, provider: Any, consumer: Any
) -> None:
    from helpers import lookup_on

    lookup_on(declare_storing_answers(provider), provider)
    a = _unknown_row(engine, clean, provider, consumer, "order:1200")
    b = _unknown_row(engine, clean, provider, consumer, "order:1201")
    app = _repair_app(clean, engine, users_text)
    client = login(app, "olga")
    token = token_of(client)
    preview = client.post("/keys/repair", data={"key": "order:1200", "csrf_token": token})
    assert preview.status_code == 200
    fp = re.search(r'name="fingerprint" value="([^"]+)"', preview.text)
    assert fp
    r = client.post(
        "/keys/repair",
        data={
            "key": "order:1201",
            "confirm": "yes",
            "fingerprint": fp.group(1),
            "reason": "x",
            "csrf_token": token,
        },
    )
    assert r.status_code == 409
    assert state_of(clean, a) == state_of(clean, b) == "unknown"
