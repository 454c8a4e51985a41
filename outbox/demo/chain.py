"""``outbox demo``'s chain phase, after the charges' audit: three invoices, each
``issue`` then ``notify`` (the notify row is written by the statement that records the issue
``sent``), carried by real processes:

1. a worker is SIGKILLed right after its commit of the first invoice's issue, before the ack:
   between the two steps. The notify row was written in that commit; nothing else is needed.
2. the provider takes the second invoice's issue and drops the answer: ``unknown``. No
   reconciler runs in this phase: ``outbox repair outbox.demo.invoicing KEY --yes``
   (the real command) asks the provider through the lookup, finds the charge, records it
   ``sent`` and writes its notify step in the same statement: no second call.
3. every step ends ``sent``, and the provider's own counters show each step called once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox

from .base import CHAIN_INVOICES, CHAIN_ISSUE, CHAIN_KEY_PREFIX, INVOICING, DemoFailed
from .invoicing import LEASE_SECONDS, TIME_LIMIT_SECONDS
from .processes import Supervisor, start_relay

STEPS = ("issue", "notify")
PHASE_TIMEOUT_SECONDS = 60.0


@dataclass
class ChainResult:
    keys: list[str]
    #: key:step -> times the provider took it.
    effects: dict[str, int]
    states: dict[tuple[str, str], str]
    repaired: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _write(engine: Engine, key: str, invoice: int) -> None:
    with Session(engine) as s, s.begin():
        outbox.write(
            s,
            key=key,
            step="issue",
            destination=CHAIN_ISSUE,
            payload={"invoice": invoice, "amount_cents": 990},
        )


def _states(engine: Engine, keys: list[str]) -> dict[tuple[str, str], str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT key, step, state FROM outbox_message WHERE key = ANY(:keys)"), {"keys": keys}
        ).all()
    return {(r.key, r.step): r.state for r in rows}


def _wait(what: str, check: Callable[[], bool], timeout: float = PHASE_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise DemoFailed(f"chain phase: timed out waiting for {what}")
        time.sleep(0.2)


def run_chain_phase(
    sup: Supervisor, engine: Engine, provider: httpx.Client, say: Callable[[str], None], started_at: datetime
) -> ChainResult:
    run = started_at.strftime("%Y%m%d%H%M%S")
    keys = [f"{CHAIN_KEY_PREFIX}:{run}-{n}" for n in range(1, CHAIN_INVOICES + 1)]
    # The phase is about the chain: no random fault of the charges' run gets in its way.
    provider.post("/_config", json={"drop_after_rate": 0.0, "fail_before_rate": 0.0}).raise_for_status()
    say(
        f"\nchain: {len(keys)} invoices, each `issue` then `notify`; the notify row is written by the "
        "commit that records the issue sent (outbox.demo.invoicing)"
    )
    relay = start_relay(sup, name="chain-relay")

    # 1. A worker killed between the two steps.
    _write(engine, keys[0], 1)
    killed = sup.start(
        "worker",
        ["-m", "outbox", "worker", INVOICING, "--threads", "1"],
        name="chain-worker-killed",
        env={"OUTBOX_FAILPOINTS": "after_record"},
    )
    try:
        killed.proc.wait(PHASE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise DemoFailed("chain phase: the worker meant to die after its record did not") from None
    after_kill = _states(engine, keys[:1])
    if after_kill.get((keys[0], "issue")) != "sent" or (keys[0], "notify") not in after_kill:
        raise DemoFailed(f"chain phase: after the kill, {keys[0]} is {after_kill}")
    say(
        f"  {keys[0]}: the worker was SIGKILLed right after committing `issue` sent, before the ack; "
        "`notify` was written by that same commit"
    )

    # 2. An issue whose answer is lost: unknown, then repaired through the lookup.
    provider.post("/_config", json={"fault_keys": {f"{keys[1]}:issue": "drop_after"}}).raise_for_status()
    for n, key in enumerate(keys[1:], start=2):
        _write(engine, key, n)
    sup.start("worker", ["-m", "outbox", "worker", INVOICING, "--threads", "2"], name="chain-worker")
    _wait(
        f"{keys[1]} issue to be unknown", lambda: _states(engine, keys).get((keys[1], "issue")) == "unknown"
    )
    say(
        f"  {keys[1]}: the provider took the issue and dropped the answer: unknown. No reconciler "
        "runs now; an operator repairs it"
    )
    # A lookup's "not found" proves nothing while the call may still land: repair waits a lease
    # and a time_limit after the claim itself; the demo waits them out rather than be refused.
    time.sleep(LEASE_SECONDS + TIME_LIMIT_SECONDS + 0.5)
    command = [sys.executable, "-m", "outbox", "repair", INVOICING, keys[1], "--yes"]
    command += ["--by", "outbox demo", "--reason", "demo: the answer was lost"]
    done = subprocess.run(command, env=sup.env, capture_output=True, text=True, timeout=60, check=False)
    repaired = (done.stdout + done.stderr).strip().splitlines()
    result_line = next((line for line in repaired if line.startswith(f"{keys[1]}: ")), "")
    if done.returncode != 0 or "the provider has it" not in result_line:
        raise DemoFailed(
            f"chain phase: outbox repair {keys[1]} exited {done.returncode}:\n" + "\n".join(repaired)
        )
    say(f"  $ outbox repair {INVOICING} {keys[1]} --yes\n  {result_line}")

    # 3. Every step sent, each called once.
    every = {(k, s) for k in keys for s in STEPS}
    _wait(
        "every step to be sent", lambda: {k for k, v in _states(engine, keys).items() if v == "sent"} == every
    )
    effects = {k: v for k, v in provider.get("/_stats").raise_for_status().json()["effects"].items()}
    mine = {f"{k}:{s}": effects.get(f"{k}:{s}", 0) for k in keys for s in STEPS}
    result = ChainResult(keys, mine, _states(engine, keys), repaired=result_line)
    result.problems = [f"{ks} taken {n} times by the provider" for ks, n in mine.items() if n != 1]
    sup.stop([relay, *sup.running("worker")], 5.0)
    if result.ok:
        say(
            f"  every step of the {len(keys)} invoices is sent and the provider took each exactly once "
            f"({sum(mine.values())} calls for {len(mine)} steps)"
        )
    return result
