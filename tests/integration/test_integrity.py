"""Issue 9, classes 5, 9 and 11 against real PostgreSQL, Redis and the provider simulator: poison
from a provider never leaves a confirmed row in_flight, one unsettleable row never blocks the
others, keys an HTTP header cannot carry are refused (and old rows holding one fail clearly), and
no card number reaches the database or a log line."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from helpers import elapse, relay_once, wait_for, worker_thread
from sqlalchemy.orm import Session

import outbox
from outbox import store
from outbox.consumer import DeliveryResult
from outbox.handlers import registry
from outbox.reconciler import AlertRow
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown

DEST = "payments.charge"
OTHER = "mail.send"
PAN = "4242424242424242"  # passes Luhn, as a real card number does

# Raw JSON: json.dumps would refuse NaN and rewrite the rest; a real provider sends them as is.
POISON = (
    '{"note":"before\\u0000after","fee":NaN,"rate":1.10,"huge":1e400,'
    f'"card":"{PAN}","nested":{{"spaced":"4242 4242 4242 4242"}}}}'
)


def declare_poisoned(provider: Any, destination: str = DEST, *, with_lookup: bool = True) -> Any:
    @outbox.handler(destination, time_limit=5, max_attempts=3, backoff=(30, 60))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        # What a careful handler does with money: Decimal, not float; plus a datetime and a
        # non-string key, both of which json.dumps refuses.
        body = r.json(parse_float=Decimal)
        return outbox.Confirmed(
            ref=body["id"], response={**body, "seen": datetime(2026, 1, 2, tzinfo=UTC), 7: "seven"}
        )

    if with_lookup:

        @charge.lookup
        def find(d: outbox.Delivery) -> outbox.Confirmed | None:
            r = d.http.get(f"{provider.url}/charges", params={"idempotency_key": d.idempotency_key})
            if r.status_code == 404:
                return None
            r.raise_for_status()
            body = r.json(parse_float=Decimal)
            return outbox.Confirmed(ref=body["id"] + "\u0000", response=body)

    return charge


def write(engine: Any, key: str, destination: str = DEST) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step="charge", destination=destination, payload={"amount_cents": 1000}
        ).id


def row(db: psycopg.Connection[Any], row_id: int) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM outbox_message WHERE id = %s", (row_id,))
    names = [c.name for c in cur.description or ()]
    found = cur.fetchone()
    assert found is not None
    return dict(zip(names, found, strict=True))


def make_unknown(db: psycopg.Connection[Any], row_id: int, destination: str = DEST) -> None:
    claimed = store.delivery.claim(db, row_id=row_id, destination=destination, lease_seconds=30)
    assert claimed is not None
    assert store.delivery.record(
        db, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown"
    ).state
    elapse(db, 1, [row_id])  # its first lookup is due


# -- class 5: poison from the provider ---------------------------------------------------------------


def test_a_confirmed_answer_full_of_poison_is_recorded_sent(
    engine: Any, db: Any, provider: Any, consumer: Any
) -> None:
    provider.configure(response_extra=POISON)
    declare_poisoned(provider)
    row_id = write(engine, "order:1")

    assert consumer().deliver(row_id, DEST) is DeliveryResult.SENT

    r = row(db, row_id)
    assert r["state"] == "sent" and r["provider_ref"] == "ch_1"
    stored = r["response"]
    assert stored["note"] == "before\ufffdafter"
    assert stored["fee"] == "NaN"
    assert stored["rate"] == 1.1  # a Decimal kept as the number it is
    assert stored["huge"] == 10**400
    assert stored["7"] == "seven" and stored["seen"] == "2026-01-02T00:00:00+00:00"
    assert stored["card"] == "[card ****4242]"
    assert stored["nested"]["spaced"] == "[card ****4242]"
    assert PAN not in str(stored)
    assert provider.stats()["charges"] == 1
    outcome = db.execute("SELECT outcome FROM outbox_attempt WHERE message_id = %s", (row_id,)).fetchone()
    assert outcome == ("sent",)


def test_a_lookup_full_of_poison_settles_its_row_and_every_other(engine: Any, db: Any, provider: Any) -> None:
    provider.configure(response_extra=POISON)
    declare_poisoned(provider)
    declare_poisoned(provider, OTHER)
    ids = [write(engine, f"order:{i}", DEST if i % 2 else OTHER) for i in range(4)]
    for row_id, destination in zip(ids, [OTHER, DEST, OTHER, DEST], strict=True):
        make_unknown(db, row_id, destination)
    # The provider holds every charge: each lookup finds one, with a NUL in its reference.
    for i in range(4):
        with __import__("httpx").Client() as c:
            c.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": f"order:{i}:charge"})

    counts = resolve_unknown(db, registry())

    assert counts == {"sent": 4}
    for row_id in ids:
        r = row(db, row_id)
        assert r["state"] == "sent", r
        assert r["provider_ref"].endswith("\ufffd") and "\x00" not in r["provider_ref"]
        assert r["response"]["card"] == "[card ****4242]"


def test_one_row_that_cannot_be_settled_is_deferred_and_alerted_while_the_others_settle(
    engine: Any, db: Any, provider: Any
) -> None:
    declare_poisoned(provider)
    declare_poisoned(provider, OTHER)
    ids = [write(engine, f"order:{i}", DEST if i % 2 else OTHER) for i in range(4)]
    for row_id, destination in zip(ids, [OTHER, DEST, OTHER, DEST], strict=True):
        make_unknown(db, row_id, destination)
    for i in range(4):
        with __import__("httpx").Client() as c:
            c.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": f"order:{i}:charge"})
    # Something the database refuses for the first (oldest) row only: any statement that
    # settles it fails, whatever the sanitiser does.
    db.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_test_refuse() RETURNS trigger AS $$
        BEGIN
          IF NEW.id = %s AND NEW.state = 'sent' THEN
            RAISE EXCEPTION 'refused by a test trigger' USING ERRCODE = 'check_violation';
          END IF;
          RETURN NEW;
        END $$ LANGUAGE plpgsql
        """.replace("%s", str(ids[0]))
    )
    db.execute(
        "CREATE TRIGGER outbox_test_refuse BEFORE UPDATE ON outbox_message "
        "FOR EACH ROW EXECUTE FUNCTION outbox_test_refuse()"
    )
    alerts: list[AlertRow] = []
    try:
        counts = resolve_unknown(db, registry(), alert=alerts.append)
        first = row(db, ids[0])
    finally:
        db.execute("DROP TRIGGER outbox_test_refuse ON outbox_message")
        db.execute("DROP FUNCTION outbox_test_refuse()")

    assert counts == {"sent": 3, "unsettleable": 1}
    assert [row(db, i)["state"] for i in ids[1:]] == ["sent", "sent", "sent"]
    assert first["state"] == "unknown"
    assert "could not be recorded" in first["last_error"] and "CheckViolation" in first["last_error"]
    assert db.execute("SELECT now() < %s", (first["available_at"],)).fetchone() == (True,)
    assert [(a.id, a.state) for a in alerts] == [(ids[0], "unknown")]
    assert "could not be recorded" in alerts[0].reason


# -- class 11: no card number at rest, none in a log line --------------------------------------------


def test_error_text_with_a_card_number_is_masked_in_the_row_the_fence_and_the_log(
    engine: Any, db: Any, consumer: Any, caplog: Any
) -> None:
    @outbox.handler(DEST, time_limit=5, max_attempts=1, backoff=(30,))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise outbox.PermanentError(f"card {PAN[:4]} {PAN[4:8]} {PAN[8:12]} {PAN[12:]} declined")

    row_id = write(engine, "order:9")
    with caplog.at_level(logging.INFO):
        assert consumer().deliver(row_id, DEST) is DeliveryResult.FAILED

    r = row(db, row_id)
    assert r["last_error"] == "card [card ****4242] declined"
    error = db.execute("SELECT error FROM outbox_attempt WHERE message_id = %s", (row_id,)).fetchone()
    assert error == ("card [card ****4242] declined",)
    from outbox.logs import KeyValueFormatter

    formatted = "\n".join(KeyValueFormatter().format(rec) for rec in caplog.records)
    assert "****4242" in formatted
    assert PAN[8:12] + " " + PAN[12:] not in formatted


# -- class 9: keys an HTTP header cannot carry -------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "step"),
    [("commande:Zoë-42", "charge"), ("order:42\n", "charge"), ("order:42", "charge\t"), (" order:42", "x")],
)
def test_write_refuses_a_key_an_http_header_cannot_carry(
    engine: Any, clean: Any, key: str, step: str
) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(outbox.InvalidMessage, match="Idempotency-Key"):
            outbox.write(s, key=key, step=step, destination=DEST, payload={})
        # The caller's transaction is still usable: nothing was sent to the database.
        assert outbox.write(s, key="order:42", step="charge", destination=DEST, payload={}).created


def test_an_old_row_with_a_non_ascii_key_fails_clearly_through_the_worker_and_calls_nothing(
    engine: Any, db: Any, clean: Any, provider: Any
) -> None:
    declare_poisoned(provider)
    # Written before this version: straight into the table, as the old `write` allowed.
    legacy = db.execute(
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('commande:Zoë-42', 'charge', %s, '{}') RETURNING id",
        (DEST,),
    ).fetchone()[0]
    ascii_id = write(engine, "commande:Zoe-42")

    relay_once(clean)
    with worker_thread(clean, threads=2):
        wait_for(
            lambda: {row(db, legacy)["state"], row(db, ascii_id)["state"]} == {"failed", "sent"},
            20,
            "both rows settled",
        )

    failed = row(db, legacy)
    assert failed["state"] == "failed"
    assert "Idempotency-Key" in failed["last_error"] and "no call was made" in failed["last_error"]
    # Claimed and failed before any call, as a row past its deadline is: the fence shows it.
    fence_rows = db.execute(
        "SELECT outcome, error FROM outbox_attempt WHERE message_id = %s", (legacy,)
    ).fetchall()
    assert [o for o, _ in fence_rows] == ["failed"] and "no call was made" in fence_rows[0][1]
    stats = provider.stats()
    # The ASCII key reached the provider byte for byte, the other one never left.
    assert stats["effects"] == {"commande:Zoe-42:charge": 1} and stats["requests"] == 1


def test_an_old_unknown_row_with_a_non_ascii_key_waits_for_a_human_without_lookups(
    engine: Any, db: Any, provider: Any
) -> None:
    calls: list[int] = []

    @outbox.handler(DEST, time_limit=5, max_attempts=3, backoff=(30, 60))
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        raise AssertionError("never called")

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        calls.append(d.id)
        r = d.http.get(f"{provider.url}/charges", headers={"Idempotency-Key": d.idempotency_key})
        return None if r.status_code == 404 else outbox.Confirmed(ref="x")

    legacy = db.execute(
        "INSERT INTO outbox_message (key, step, destination, payload) "
        "VALUES ('commande:Zoë-42', 'charge', %s, '{}') RETURNING id",
        (DEST,),
    ).fetchone()[0]
    make_unknown(db, legacy)

    counts = resolve_unknown(db, registry())

    assert counts == {"needs_human": 1}
    assert calls == []
    r = row(db, legacy)
    assert r["state"] == "unknown" and "Idempotency-Key" in r["last_error"]
    assert db.execute("SELECT now() + interval '30 minutes' < %s", (r["available_at"],)).fetchone() == (True,)


def test_resolve_stores_what_it_is_given_by_the_same_rules(engine: Any, db: Any) -> None:
    from outbox import ops

    declare_poisoned(None)
    sent, failed = write(engine, "order:1"), write(engine, "order:2")
    make_unknown(db, sent)
    make_unknown(db, failed)
    with engine.begin() as conn:
        ops.resolve(conn, sent, sent_ref="ch_1\x00", by="test")
        ops.resolve(conn, failed, failed_reason=f"refunded card {PAN} by hand", by="test")
    assert row(db, sent)["provider_ref"] == "ch_1\ufffd"
    assert row(db, failed)["last_error"] == "refunded card [card ****4242] by hand"


def test_a_summary_the_database_still_refuses_is_dropped_not_the_charge(
    engine: Any, db: Any, provider: Any, consumer: Any
) -> None:
    declare_poisoned(provider)
    row_id = write(engine, "order:1")
    # Stands for whatever a database may refuse that the sanitiser did not foresee (an encoding
    # other than UTF-8, a size limit): only the full summary is refused.
    db.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_test_refuse() RETURNS trigger AS $$
        BEGIN
          IF NEW.response ? 'status' THEN
            RAISE EXCEPTION 'summary refused by a test trigger' USING ERRCODE = 'data_exception';
          END IF;
          RETURN NEW;
        END $$ LANGUAGE plpgsql
        """
    )
    db.execute(
        "CREATE TRIGGER outbox_test_refuse BEFORE UPDATE ON outbox_message "
        "FOR EACH ROW EXECUTE FUNCTION outbox_test_refuse()"
    )
    try:
        assert consumer().deliver(row_id, DEST) is DeliveryResult.SENT
    finally:
        db.execute("DROP TRIGGER outbox_test_refuse ON outbox_message")
        db.execute("DROP FUNCTION outbox_test_refuse()")
    r = row(db, row_id)
    assert (r["state"], r["provider_ref"]) == ("sent", "ch_1")
    assert r["response"] == {"unstorable_response": "DataException"}  # the database's error class
