"""Payload models, versions and upgrades (issue 15 part 3) against real PostgreSQL and the
provider simulator on 127.0.0.1: a deploy that renames a field, rows written by the old release
delivered by the new one, an invalid payload failed without a call, a payload newer than the
worker left for a newer one, and `outbox doctor MODULE --payloads` before the roll-out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pydantic
import pytest
from sqlalchemy.orm import Session

import outbox
from outbox.consumer import DeliveryResult
from outbox.exceptions import InvalidMessage
from outbox.settings import libpq_url

DEST = "payments.charge"


class ChargeV1(pydantic.BaseModel):
    amount: int


class ChargeV2(pydantic.BaseModel):
    """Release 2: ``amount`` (euros) became ``amount_cents``."""

    payload_version: ClassVar[int] = 2
    amount_cents: int
    currency: str = "EUR"


def to_cents(p: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in p.items() if k != "amount"}, "amount_cents": p["amount"] * 100}


def declare(provider: Any, seen: list[Any], **options: Any) -> outbox.Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (1,), "max_attempts": 2, **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        seen.append((d.payload, d.model))
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"])

    return charge


def write(engine: Any, key: str, payload: dict[str, Any], **options: Any) -> int:
    with Session(engine) as s, s.begin():
        return outbox.write(s, key=key, step="charge", destination=DEST, payload=payload, **options).id


def row(services: Any, row_id: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute(
            "SELECT *, date_part('epoch', available_at - now()) AS due_in FROM outbox_message WHERE id = %s",
            (row_id,),
        )
        names = [c.name for c in cur.description or []]
        found = cur.fetchone()
        assert found is not None
        return dict(zip(names, found, strict=True))


def test_rows_of_the_old_release_are_upgraded_and_delivered_by_the_new_one(clean, engine, provider, consumer):
    # Release 1 wrote these (no model imported in the writer: version 1).
    old = [write(engine, f"order:{i}", {"amount": 12 + i}) for i in range(3)]
    assert {row(clean, i)["payload_version"] for i in old} == {1}
    seen: list[Any] = []
    declare(provider, seen, payload_model=ChargeV2, upgrades={1: to_cents})
    # Release 2's writer imports the handler: its rows are version 2.
    new = write(engine, "order:9", {"amount_cents": 500})
    assert row(clean, new)["payload_version"] == 2
    worker = consumer()
    for row_id in [*old, new]:
        assert worker.deliver(row_id, DEST) is DeliveryResult.SENT
    assert [p for p, _ in seen] == [
        {"amount_cents": 1200},
        {"amount_cents": 1300},
        {"amount_cents": 1400},
        {"amount_cents": 500},
    ]
    assert all(isinstance(m, ChargeV2) and m.currency == "EUR" for _, m in seen)
    # The stored payload is what its writer wrote; the provider charged each key once.
    assert row(clean, old[0])["payload"] == {"amount": 12}
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in (0, 1, 2, 9)}


def test_an_invalid_payload_fails_without_a_call_and_is_never_retried(clean, engine, provider, consumer):
    seen: list[Any] = []
    declare(provider, seen, payload_model=ChargeV2)
    row_id = write(engine, "order:1", {"amount_cents": "twelve"}, payload_version=2)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.FAILED
    failed = row(clean, row_id)
    assert failed["state"] == "failed" and failed["attempts"] == 1
    assert "amount_cents" in failed["last_error"] and "no call was made" in failed["last_error"]
    assert "twelve" not in failed["last_error"]
    assert seen == [] and provider.stats()["effects"] == {}
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        assert conn.execute(
            "SELECT outcome FROM outbox_attempt WHERE message_id = %s", (row_id,)
        ).fetchall() == [("failed",)]


def test_an_invalid_payload_after_an_ambiguous_call_goes_unknown_not_failed(
    clean, engine, provider, consumer
):
    """A model deployed between an ambiguous call and its retry: the first call may have
    charged, so the row is not failed for certain; the lookup decides."""
    seen: list[Any] = []
    declare(provider, seen, idempotent=True)
    row_id = write(engine, "order:1", {"amount": 12})
    provider.configure(fault_next=["drop_after"])
    assert consumer().deliver(row_id, DEST) is DeliveryResult.PENDING  # idempotent: retried
    assert provider.stats()["effects"] == {"order:1:charge": 1}
    outbox.handlers.clear_registry()
    declare(provider, seen, idempotent=True, payload_model=ChargeV2)  # no upgrade: "amount" invalid
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        conn.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (row_id,))
        conn.commit()
    assert consumer().deliver(row_id, DEST) is DeliveryResult.UNKNOWN
    unknown = row(clean, row_id)
    assert unknown["state"] == "unknown" and "the lookup decides" in unknown["last_error"]
    assert provider.stats()["effects"] == {"order:1:charge": 1}


def test_a_payload_newer_than_the_worker_waits_for_a_newer_one(clean, engine, provider, consumer):
    seen: list[Any] = []
    # The old worker knows version 1 only; new writers already write version 2.
    declare(provider, seen, payload_model=ChargeV1)
    row_id = write(engine, "order:1", {"amount_cents": 100}, payload_version=2)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.RELEASED
    waiting = row(clean, row_id)
    assert waiting["state"] == "pending" and waiting["attempts"] == 0 and waiting["releases"] == 1
    assert 20 < waiting["due_in"] <= 30, "released for later, not for the same old worker at once"
    assert "newer than this handler's (1)" in waiting["last_error"]
    assert seen == [] and provider.stats()["effects"] == {}
    # The new release's worker delivers it.
    outbox.handlers.clear_registry()
    declare(provider, seen, payload_model=ChargeV2, upgrades={1: to_cents})
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        conn.execute("UPDATE outbox_message SET available_at = now() WHERE id = %s", (row_id,))
        conn.commit()
    assert consumer().deliver(row_id, DEST) is DeliveryResult.SENT
    assert provider.stats()["effects"] == {"order:1:charge": 1}


def test_write_validates_against_the_imported_model_when_asked(clean, engine, provider):
    declare(provider, [], payload_model=ChargeV2, upgrades={1: to_cents})
    with pytest.raises(InvalidMessage, match=r"amount_cents: Field required"):
        write(engine, "order:1", {"amount": "x"}, payload_version=2, validate=True)
    # An old-shape payload declared as version 1 passes through its upgrade.
    assert (
        row(clean, write(engine, "order:2", {"amount": 3}, payload_version=1, validate=True))[
            "payload_version"
        ]
        == 1
    )
    with pytest.raises(InvalidMessage, match=r"no handler of 'mail\.send' with a payload_model"):
        with Session(engine) as s, s.begin():
            outbox.write(s, key="k", step="s", destination="mail.send", payload={}, validate=True)
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_message").fetchone() == (1,)


def test_a_next_step_gets_the_version_of_its_imported_handler(clean, engine, provider, consumer):
    seen: list[Any] = []
    charge = declare(provider, seen)

    @outbox.handler("mail.receipt", time_limit=2, payload_model=ChargeV2)
    def receipt(d: outbox.Delivery) -> outbox.Confirmed:
        return outbox.Confirmed(ref="r")

    @charge.then
    def after(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        return [outbox.Next("receipt", "mail.receipt", {"amount_cents": 1})]

    row_id = write(engine, "order:1", {"amount": 1})
    assert consumer().deliver(row_id, DEST) is DeliveryResult.SENT
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        assert conn.execute(
            "SELECT payload_version FROM outbox_message WHERE step = 'receipt'"
        ).fetchone() == (2,)


def test_the_schema_refuses_a_version_below_one_from_plain_sql(clean):
    with psycopg.connect(libpq_url(clean.database_url)) as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "INSERT INTO outbox_message (key, step, destination, payload, payload_version) "
            "VALUES ('k', 's', 'd', '{}', 0)"
        )


MODULE_V2 = """
from typing import ClassVar
import pydantic
import outbox

class Charge(pydantic.BaseModel):
    payload_version: ClassVar[int] = 2
    amount_cents: int

UPGRADES = {UPGRADES}

@outbox.handler("payments.charge", payload_model=Charge, upgrades=UPGRADES)
def charge(d):
    return outbox.Confirmed(ref="x")
"""


def test_doctor_payloads_catches_a_renamed_field_before_the_deploy(clean, engine, tmp_path: Path):
    old = write(engine, "order:1", {"amount": 12})  # release 1's shape, version 1
    write(engine, "order:2", {"amount_cents": 5}, payload_version=2)
    sent = write(engine, "order:3", {"amount": 1})
    with psycopg.connect(libpq_url(clean.database_url)) as conn:
        conn.execute(
            "UPDATE outbox_message SET state = 'cancelled', completed_at = now() WHERE id = %s", (sent,)
        )
        conn.commit()

    def doctor(upgrades: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "shop_v2.py").write_text(textwrap.dedent(MODULE_V2).replace("{UPGRADES}", upgrades))
        env = clean.env(PYTHONPATH=f"{tmp_path}:{clean.env()['PYTHONPATH']}")
        return subprocess.run(
            [sys.executable, "-m", "outbox", "doctor", "shop_v2", "--payloads"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    # Release 2 renamed the field and forgot the upgrade: the old row is named, with its field.
    result = doctor("{}")
    assert result.returncode == 1, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("FAIL") and "payloads" in x)
    assert f"row {old} order:1:charge" in line and "amount_cents: Field required" in line
    assert "order:2" not in line and "order:3" not in line  # fits; not waiting
    assert "redis" not in result.stdout.lower(), "--payloads needs the database only"
    # With the upgrade, every waiting row fits.
    result = doctor("{1: lambda p: {'amount_cents': p['amount'] * 100}}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 waiting row(s) fit the handlers of shop_v2" in result.stdout


def test_doctor_payloads_needs_a_module(clean):
    result = subprocess.run(
        [sys.executable, "-m", "outbox", "doctor", "--payloads"],
        env=clean.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "--payloads needs MODULE" in result.stderr
