"""``outbox chains --stalled`` and ``outbox repair`` (issue 14): a chain stopped at an `unknown`
step whose charge happened (the lookup finds it: sent, the chain goes on, no second call), one
whose charge did not (re-run once), a step failed for good (refused without ``--force``), a
confirmed step whose next steps are missing, and a failed step with an ambiguous history. Run
through ``outbox.cli.main`` against real PostgreSQL and the provider simulator on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import elapse, lookup_on, sql
from sqlalchemy.orm import Session

import outbox
from outbox import chains, ops, store
from outbox.cli import main
from outbox.consumer import Deliverer, DeliveryResult
from outbox.handlers import registry
from outbox.ops.repair import execute_repair, plan_repair
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.purge import purge
from outbox.settings import libpq_url

from .test_chains import KEY, declare, invoice_chain, steps, write_charge

#: The handler module `outbox repair MODULE` imports: this one (its handlers are declared per
#: test in the registry that load_module returns).
MODULE = __name__


@pytest.fixture
def deliver(clean: Any):
    made: list[Deliverer] = []

    def run(row_id: int, destination: str) -> DeliveryResult:
        if not made:
            made.append(Deliverer(clean.database_url, registry()))
        return made[0].deliver(row_id, destination)

    yield run
    for e in made:
        e.close()
    outbox.handlers.close_http_clients()


def cli(services: Any, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--database-url", services.database_url])
    out, err = capsys.readouterr()
    return code, out, err


def history(services: Any, row_id: int) -> list[dict[str, Any]]:
    return sql(services, "SELECT history FROM outbox_message WHERE id = %s", (row_id,))[0][0]


def test_an_unknown_step_whose_charge_happened_is_found_and_the_chain_goes_on(
    clean, engine, provider, deliver, capsys
):
    lookup_on(invoice_chain(provider), provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    # Asked at once, a provider still executing the call would say "not found": repair waits as
    # long as the reconciler would (a lease and a time_limit after the claim).
    assert code == 1 and "may still be landing at the provider" in err
    assert steps(clean)["charge"]["state"] == "unknown"
    elapse(clean, 60, [charge_id])

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY)
    assert code == 0, err
    assert "look up" in out and "nothing changed: this is the plan" in out
    assert set(steps(clean)) == {"charge"} and steps(clean)["charge"]["state"] == "unknown"

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes", "--by", "alice", "--reason", "INC-7")
    assert code == 0, err
    assert "the provider has it" in out and "no second call" in out
    rows = steps(clean)
    assert rows["charge"]["state"] == "sent"
    assert rows["export"]["state"] == "pending" and rows["export"]["parent_id"] == charge_id
    assert rows["export"]["payload"]["charge"] == rows["charge"]["provider_ref"]
    assert {"by": "alice", "action": "repair", "reason": "INC-7", "result": "sent"}.items() <= history(
        clean, charge_id
    )[-1].items()
    # The chain goes on from there; the charge was made once.
    assert deliver(rows["export"]["id"], "accounting.export") is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1, f"{KEY}:export": 1}
    # Repairing again finds nothing to do at the charge: the chain waits at notify.
    code, out, _ = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 0 and "notify is pending: under way" in out


def test_an_unknown_step_whose_charge_did_not_happen_is_re_run_once(clean, engine, provider, deliver, capsys):
    lookup_on(invoice_chain(provider), provider)
    charge_id = write_charge(engine)
    # The worker died after its claim, before its call: the lease runs out, the row is unknown.
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.claim(conn, row_id=charge_id, destination="payments.charge", lease_seconds=5)
        elapse(conn, 6, [charge_id])
        assert expire_leases(conn, registry()) == 1
    assert steps(clean)["charge"]["state"] == "unknown"
    elapse(clean, 60, [charge_id])  # no call of it can still land

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 0, err
    assert "no record of it: re-run" in out
    assert steps(clean)["charge"]["state"] == "pending"
    assert provider.stats()["effects"] == {}
    elapse(clean, 2, [charge_id])  # its retry's backoff
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}
    assert set(steps(clean)) == {"charge", "export"}


def test_a_step_failed_for_good_is_refused_without_force(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)
    charge_id = write_charge(engine, {"invoice": 7, "amount_cents": -1})  # the simulator declines
    assert deliver(charge_id, "payments.charge") is DeliveryResult.FAILED

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 1
    assert "failed for good" in out + err and "--force" in out + err
    assert steps(clean)["charge"]["state"] == "failed"

    # --force names one key, with a reason.
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "other:1", "--force", "--yes")
    assert code == 2 and "one KEY named alone" in err
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes")
    assert code == 2 and "--force needs --reason" in err

    sql(
        clean,
        "UPDATE outbox_message SET payload = %s WHERE id = %s",
        ('{"invoice": 7, "amount_cents": 5}', charge_id),
    )
    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes", "--reason", "card updated")
    assert code == 0, err
    assert "re-run (failed -> pending)" in out
    assert steps(clean)["charge"]["state"] == "pending"
    assert history(clean, charge_id)[-1]["action"] == "repair"
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_a_confirmed_step_without_its_next_steps_gets_them(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        ops.resolve(conn, charge_id, sent_ref="ch_by_hand")  # no module: steps not computed
    assert steps(clean)["charge"]["chain_problem"] == chains.NOT_COMPUTED

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["keys"][0]["action"] == "write_next_steps" and doc["results"][0]["done"] is True
    rows = steps(clean)
    assert rows["charge"]["chain_problem"] is None
    assert rows["export"]["payload"] == {"invoice": 7, "charge": "ch_by_hand"}
    # Never a second call: the charge stays as the operator settled it.
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_a_failed_step_with_an_ambiguous_history_asks_the_provider_first(
    clean, engine, provider, deliver, capsys
):
    # An idempotent destination out of attempts fails a row whose call may have taken effect.
    lookup_on(invoice_chain(provider, idempotent=True, max_attempts=1), provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    elapse(clean, 60, [charge_id])
    # replay alone would refuse it: the call may have taken effect.
    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 0, err
    assert "failed -> sent, no second call" in out
    rows = steps(clean)
    assert rows["charge"]["state"] == "sent" and set(rows) == {"charge", "export"}
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_without_a_lookup_an_ambiguous_failure_is_left_to_a_human(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)  # no lookup, not idempotent
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 1
    assert "neither a lookup nor idempotency" in out + err
    assert steps(clean)["charge"]["state"] == "unknown"


def test_chains_stalled_lists_the_stopped_keys(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)
    charge_id = write_charge(engine, {"invoice": 7, "amount_cents": -1})
    assert deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    with Session(engine) as s, s.begin():
        outbox.write(s, key="invoice:8", step="charge", destination="payments.charge", payload={"invoice": 8})

    # Just failed, just written: neither has been stopped for 15 minutes.
    code, out, _ = cli(clean, capsys, "chains", "--stalled")
    assert code == 0 and "no key stopped for 15m or more" in out
    code, out, _ = cli(clean, capsys, "chains", "--stalled", "--older-than", "0", "--json")
    doc = json.loads(out)
    assert {k["key"] for k in doc["keys"]} == {KEY, "invoice:8"}
    failed = next(k for k in doc["keys"] if k["key"] == KEY)
    assert failed["state"] == "failed" and "card declined" in failed["why"] and failed["chained"] is False
    elapse(clean, 3600)
    code, out, _ = cli(clean, capsys, "chains", "--stalled")
    assert code == 0 and KEY in out and "invoice:8" in out and "2 key(s) stopped for 15m" in out
    # repair --stalled plans them all: the failed one refused, the pending one under way.
    code, out, err = cli(clean, capsys, "repair", MODULE, "--stalled")
    assert code == 1  # the plan refuses a key
    assert "refused" in out and "under way" in out
    assert "nothing to act on" in out
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--destination", "payments.charge")
    assert code == 2 and "select among --stalled keys" in err
    code, _, err = cli(clean, capsys, "repair")
    assert code == 2 and err == (
        "outbox repair: error: MODULE is required, the handler module first: "
        "outbox repair myapp.handlers KEY… (outbox repair --help)\n"
    )
    # The former spelling, for one release: KEY --module M is the same repair, with one line saying so.
    code, out, err = cli(clean, capsys, "repair", KEY, "--module", MODULE)
    assert code == 1 and "refused" in out
    assert err.splitlines()[0] == (
        "outbox repair: --module is deprecated; pass MODULE as the first argument: "
        f"outbox repair {MODULE} KEY… (--module goes in the next release)"
    )
    code, _, err = cli(clean, capsys, "repair", MODULE, "--stalled", "--module", MODULE)
    assert code == 2 and "MODULE given twice" in err and len(err.splitlines()) == 1


def test_chains_without_stalled_lists_the_chains_under_way(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT  # export written, waiting
    with Session(engine) as s, s.begin():
        # A lone row is no chain; a failed key is stopped, not under way.
        outbox.write(s, key="invoice:8", step="charge", destination="payments.charge", payload={"invoice": 8})
        failed_id = outbox.write(
            s, key="invoice:9", step="charge", destination="payments.charge", payload={"amount_cents": -1}
        ).id
    assert deliver(failed_id, "payments.charge") is DeliveryResult.FAILED
    elapse(clean, 3600)

    code, out, err = cli(clean, capsys, "chains")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["key", "waiting", "at", "destination", "state", "for", "done"]
    assert lines[2].split()[:4] == [KEY, "export", "accounting.export", "pending"]
    assert lines[2].split()[-1] == "1/2"
    assert "invoice:8" not in out and "invoice:9" not in out
    # Stopped: the failed key, and the two waiting for an hour (the chain's export among them).
    assert lines[-1] == (
        "1 chain(s) under way; 3 key(s) stopped for 15m or more (outbox chains --stalled lists them)"
    )
    code, out, _ = cli(clean, capsys, "chains", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["under_way"] == 1 and doc["destination"] is None
    assert doc["stalled"] == {"older_than_seconds": 900.0, "matching": 3}
    [key] = doc["keys"]
    assert {k: key[k] for k in ("key", "step", "destination", "state", "steps", "done")} == {
        "key": KEY,
        "step": "export",
        "destination": "accounting.export",
        "state": "pending",
        "steps": 2,
        "done": 1,
    }
    assert key["age_seconds"] >= 3600
    # --destination names the waiting step's destination; a typo is exit 1, as with --stalled.
    code, out, _ = cli(clean, capsys, "chains", "--destination", "payments.charge", "--json")
    assert code == 0 and json.loads(out)["under_way"] == 0
    code, _, err = cli(clean, capsys, "chains", "--destination", "acounting.export")
    assert code == 1 and "no outbox rows for destination" in err
    code, _, err = cli(clean, capsys, "chains", "--older-than", "1h")
    assert code == 2 and err.startswith("outbox chains: error: --older-than goes with --stalled")
    # --stalled is unchanged: its document has no under_way.
    code, out, _ = cli(clean, capsys, "chains", "--stalled", "--json")
    assert code == 0 and set(json.loads(out)) == {"older_than_seconds", "destination", "matching", "keys"}


def _claimed_then_failed_by_hand(clean: Any, engine: Any, charge_id: int) -> None:
    """The worker died after its claim (no call reached the provider); the lease ran out and an
    operator gave up on the row: failed, with a call that may have taken effect. Repair acts on
    it only with --force and a reason (the operator's decision), and then as on any ambiguous
    failure: the provider first."""
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.claim(conn, row_id=charge_id, destination="payments.charge", lease_seconds=5)
        elapse(conn, 6, [charge_id])
        assert expire_leases(conn, registry()) == 1
    with engine.begin() as conn:
        assert ops.resolve(conn, charge_id, failed_reason="provider cannot tell").done


def test_an_ambiguous_failure_the_provider_has_no_record_of_is_re_run_once_no_call_can_land(
    clean, engine, provider, deliver, capsys
):
    lookup_on(invoice_chain(provider), provider)
    charge_id = write_charge(engine)
    _claimed_then_failed_by_hand(clean, engine, charge_id)
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes", "--reason", "INC-9")
    assert code == 1 and "may still be landing" in err
    assert steps(clean)["charge"]["state"] == "failed"

    elapse(clean, 60, [charge_id])
    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes", "--reason", "INC-9")
    assert code == 0, err
    assert "the provider has no record of it: re-run" in out
    assert history(clean, charge_id)[-1]["action"] == "repair"
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_an_ambiguous_failure_past_key_ttl_is_left_to_a_human(clean, engine, provider, deliver, capsys):
    charge = lookup_on(invoice_chain(provider), provider)
    charge_id = write_charge(engine)
    _claimed_then_failed_by_hand(clean, engine, charge_id)
    elapse(clean, charge.key_ttl + 60, [charge_id])
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes", "--reason", "INC-9")
    assert code == 1 and "older than key_ttl" in err
    assert steps(clean)["charge"]["state"] == "failed"
    assert provider.stats()["effects"] == {}


# -- what a reviewer found (issue 14's attack) -------------------------------------------------------


def _then_broken_until_fixed(provider: Any) -> dict[str, bool]:
    charge = declare(provider, "payments.charge")
    declare(provider, "accounting.export")
    broken = {"on": True, "slow": False}

    @charge.then
    def after(d: outbox.Delivery, c: outbox.Confirmed) -> list[outbox.Next]:
        if broken["on"]:
            raise RuntimeError("ledger account missing")
        if broken["slow"]:
            time.sleep(0.3)
        return [outbox.Next("export", "accounting.export", {"charge": c.ref})]

    return broken


def test_the_purge_keeps_a_sent_step_until_its_next_steps_are_written(
    clean, engine, provider, deliver, capsys
):
    broken = _then_broken_until_fixed(provider)
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    elapse(clean, 30 * 86400, [charge_id])
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        purge(conn, retention_seconds=7 * 86400)
    assert steps(clean)["charge"]["chain_problem"]  # still there, not in the ledger
    broken["on"] = False
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes")
    assert code == 0, err
    assert steps(clean)["export"]["payload"] == {"charge": steps(clean)["charge"]["provider_ref"]}


def test_two_repairs_writing_the_same_next_steps_both_succeed(clean, engine, provider, deliver):
    broken = _then_broken_until_fixed(provider)
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    broken.update(on=False, slow=True)
    with engine.connect() as conn:
        plan = plan_repair(conn, [KEY], handlers=registry())
    results: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(execute_repair(clean.database_url, plan, handlers=registry()))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(steps(clean)) == {"charge", "export"}
    assert [r[0].done for r in results] == [True, True], results


def test_two_repairs_at_once_re_run_an_ambiguous_failure_once(clean, engine, provider, deliver):
    lookup_on(invoice_chain(provider), provider)
    charge_id = write_charge(engine)
    _claimed_then_failed_by_hand(clean, engine, charge_id)
    elapse(clean, 120, [charge_id])
    with engine.connect() as conn:
        plan = plan_repair(conn, [KEY], handlers=registry(), force=True)
    assert plan.items[0].action == "ask_provider"
    results: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                execute_repair(clean.database_url, plan, handlers=registry(), reason="x")
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    messages = sorted(r[0].message for r in results)
    assert sum("re-run (failed -> pending)" in m for m in messages) == 1, messages
    elapse(clean, 2, [charge_id])
    assert deliver(charge_id, "payments.charge") is DeliveryResult.SENT
    assert deliver(charge_id, "payments.charge") is DeliveryResult.EMPTY
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_a_slow_lookup_cannot_outlast_the_landing_wait(clean, engine, provider, deliver, capsys):
    # The lookup reads the provider's records when asked and answers 2.5 s later; the first
    # call lands in between, inside the bound the design allows (lease + time_limit).
    charge = invoice_chain(provider)

    @charge.lookup
    def find(d: outbox.Delivery) -> outbox.Confirmed | None:
        seen = provider._state.lookup(d.idempotency_key)
        time.sleep(2.5)
        return None if seen is None else outbox.Confirmed(ref=seen["id"])

    charge_id = write_charge(engine)
    _claimed_then_failed_by_hand(clean, engine, charge_id)
    window = charge.lease_seconds + charge.time_limit
    elapse(clean, window - 6 - 1.5, [charge_id])  # 1.5 s of it left

    def the_first_call_lands() -> None:
        time.sleep(0.5)
        provider._state.charge(f"{KEY}:charge", {"invoice": 7, "amount_cents": 1200})

    landing = threading.Thread(target=the_first_call_lands)
    landing.start()
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--force", "--yes", "--reason", "r")
    landing.join()
    assert code == 1 and "may still be landing" in err
    assert steps(clean)["charge"]["state"] == "failed"
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_a_compensated_step_is_handled_and_its_compensation_is_what_stalls(
    clean, engine, provider, deliver, capsys
):
    charge = declare(provider, "payments.charge")
    declare(provider, "payments.refund")

    @charge.on_failure
    def undo(d: outbox.Delivery, error: str) -> list[outbox.Next]:
        return [outbox.Next("release-stock", "payments.refund", {"amount_cents": -5})]  # declined too

    charge_id = write_charge(engine, {"invoice": 7, "amount_cents": -1})
    assert deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    release = steps(clean)["release-stock"]
    assert deliver(release["id"], "payments.refund") is DeliveryResult.FAILED
    elapse(clean, 3600)
    code, out, _ = cli(clean, capsys, "chains", "--stalled", "--json")
    assert [(k["key"], k["step"], k["chained"]) for k in json.loads(out)["keys"]] == [
        (KEY, "release-stock", True)
    ]
    code, out, _ = cli(clean, capsys, "repair", MODULE, KEY)
    assert code == 1 and "step release-stock failed for good" in out
    code, out, _ = cli(clean, capsys, "show", KEY)
    assert "stopped at step release-stock (failed)" in out


def test_control_characters_in_a_key_are_escaped(clean, engine, provider, deliver, capsys):
    invoice_chain(provider)
    evil = "inv:1\n\x1b[31mFAKE  charge  sent\x1b[0m"
    sql(
        clean,
        "INSERT INTO outbox_message (key, step, destination, payload, state, completed_at, last_error)"
        " VALUES (%s, 'charge', 'payments.charge', '{}', 'failed', now() - interval '2 hours', 'x')",
        (evil,),
    )
    _, out, _ = cli(clean, capsys, "chains", "--stalled")
    _, out2, err2 = cli(clean, capsys, "repair", MODULE, "--stalled")
    for text in (out, out2, err2):
        assert "\x1b" not in text and "\nFAKE" not in text
    assert "inv:1\\n\\x1b[31mFAKE" in out


def test_named_keys_take_no_selection_flags_and_a_row_id_gets_a_hint(
    clean, engine, provider, deliver, capsys
):
    invoice_chain(provider)
    code, _, err = cli(clean, capsys, "repair", MODULE, KEY, "--older-than", "1h")
    assert code == 2 and "select among --stalled keys" in err
    code, out, _ = cli(clean, capsys, "repair", MODULE, "42")
    assert code == 1 and "42 reads as a row id: outbox show 42 gives its key" in out


# -- an operator's decision (issue 29, item 4) -----------------------------------------------------


def test_a_step_an_operator_failed_is_not_continued_without_force(clean, engine, provider, deliver, capsys):
    lookup_on(invoice_chain(provider), provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})  # the charge happened
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    code, _, err = cli(
        clean, capsys, "resolve", str(charge_id), "--failed", "refunded by hand", "--by", "sam"
    )
    assert code == 0, err
    elapse(clean, 60, [charge_id])

    for argv in (("repair", MODULE, KEY), ("repair", MODULE, "--stalled", "--older-than", "0")):
        code, out, err = cli(clean, capsys, *argv, "--yes", "--reason", "INC-3")
        assert code == 1
        assert "failed by an operator" in out + err and "refunded by hand" in out + err
        assert f"outbox repair {MODULE} {KEY} --force --reason WHY" in out + err
    rows = steps(clean)
    assert set(rows) == {"charge"} and rows["charge"]["state"] == "failed"
    assert history(clean, charge_id)[-1]["action"] == "resolve"
    with engine.connect() as conn:
        assert plan_repair(conn, [KEY], handlers=registry()).items[0].action == "refused"

    # Forced by name, with a reason: asked first, found, sent, the chain goes on; no second call.
    code, out, err = cli(
        clean,
        capsys,
        "repair",
        MODULE,
        KEY,
        "--force",
        "--yes",
        "--reason",
        "customer paid after all",
    )
    assert code == 0, err
    assert "failed -> sent, no second call" in out
    rows = steps(clean)
    assert rows["charge"]["state"] == "sent" and set(rows) == {"charge", "export"}
    last = history(clean, charge_id)[-1]
    assert (
        last["action"] == "repair" and last["forced"] is True and last["reason"] == "customer paid after all"
    )
    assert any("an operator failed it out of unknown" in o for o in last["overrode"])
    assert provider.stats()["effects"] == {f"{KEY}:charge": 1}


def test_a_step_an_operator_failed_is_not_re_run_without_force(clean, engine, provider, deliver, capsys):
    lookup_on(invoice_chain(provider), provider)
    charge_id = write_charge(engine)
    _claimed_then_failed_by_hand(clean, engine, charge_id)  # no call reached the provider
    elapse(clean, 60, [charge_id])

    code, out, err = cli(clean, capsys, "repair", MODULE, KEY, "--yes", "--reason", "INC-4")
    assert code == 1 and "failed by an operator" in out + err
    assert steps(clean)["charge"]["state"] == "failed"
    assert provider.stats()["effects"] == {}

    code, out, err = cli(
        clean,
        capsys,
        "repair",
        MODULE,
        KEY,
        "--force",
        "--yes",
        "--reason",
        "customer asked again",
    )
    assert code == 0, err
    assert "the provider has no record of it: re-run" in out
    last = history(clean, charge_id)[-1]
    assert last["action"] == "repair" and last["forced"] is True and last["to"] == "pending"
    # The operator's decision was overruled by name: a later certain failure is an ordinary one,
    # replayed without --force.
    sql(
        clean,
        "UPDATE outbox_message SET payload = %s WHERE id = %s",
        ('{"invoice": 7, "amount_cents": -1}', charge_id),
    )
    elapse(clean, 2, [charge_id])
    assert deliver(charge_id, "payments.charge") is DeliveryResult.FAILED
    code, out, err = cli(clean, capsys, "replay", str(charge_id))
    assert code == 0 and "replayed: failed -> pending" in out, out + err


def test_the_acting_statements_keep_an_operator_decision_made_after_the_plan(
    clean, engine, provider, deliver
):
    # A plan that saw an ambiguous failure by the worker acts on nothing once an operator failed
    # the row since: each action re-checks, in its own statement, what the plan saw.
    lookup_on(invoice_chain(provider, idempotent=True, max_attempts=1), provider)
    charge_id = write_charge(engine)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=charge_id, destination="payments.charge", lease_seconds=5)
        assert claimed is not None
        assert (
            store.delivery.record(
                conn,
                row_id=charge_id,
                token=claimed.token,
                state="failed",
                outcome="unknown",
                error="ReadTimeout",
            ).state
            == "failed"
        )
    elapse(clean, 120, [charge_id])
    with engine.connect() as conn:
        plan = plan_repair(conn, [KEY], handlers=registry())
    item = plan.items[0]
    assert item.action == "ask_provider"
    # The same failure (same completed_at), now carrying an operator's decision in its history.
    sql(
        clean,
        "UPDATE outbox_message SET history = history || jsonb_build_array(jsonb_build_object('action',"
        " 'resolve', 'from', 'unknown', 'to', 'failed', 'by', 'sam', 'reason', 'refunded')) WHERE id = %s",
        (charge_id,),
    )
    [result] = execute_repair(clean.database_url, plan, handlers=registry(), reason="r")
    assert not result.done
    assert steps(clean)["charge"]["state"] == "failed"


def test_the_dashboard_repair_keeps_an_operator_decision(clean, engine, provider, deliver):
    import re

    from starlette.testclient import TestClient

    from outbox.dashboard import create_app, hash_password

    lookup_on(invoice_chain(provider), provider)
    provider.configure(fault_keys={f"{KEY}:charge": "drop_after"})
    charge_id = write_charge(engine)
    assert deliver(charge_id, "payments.charge") is DeliveryResult.UNKNOWN
    with engine.begin() as conn:
        assert ops.resolve(conn, charge_id, failed_reason="refunded by hand", by="sam").done
    elapse(clean, 60, [charge_id])
    app = create_app(
        engine=engine,
        secret="s" * 40,
        users=f"olga operate {hash_password('pw')}",
        database_url=clean.database_url,
        handlers=registry(),
        module=MODULE,
    )
    client = TestClient(app, base_url="https://testserver", follow_redirects=False)
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text).group(1)  # type: ignore[union-attr]
    assert (
        client.post("/login", data={"user": "olga", "password": "pw", "csrf_token": token}).status_code == 303
    )
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/").text).group(1)  # type: ignore[union-attr]

    preview = client.post("/keys/repair", data={"key": KEY, "csrf_token": token})
    assert preview.status_code == 200 and "failed by an operator" in preview.text, preview.text
    fingerprint = re.search(r'name="fingerprint" value="([^"]+)"', preview.text)
    form = {"key": KEY, "confirm": "yes", "reason": "INC-5", "csrf_token": token}
    if fingerprint:
        form["fingerprint"] = fingerprint.group(1)
    client.post("/keys/repair", data=form)
    rows = steps(clean)
    assert set(rows) == {"charge"} and rows["charge"]["state"] == "failed"
    assert history(clean, charge_id)[-1]["action"] == "resolve"
