"""The model-based interleaving test of issue 9: random schedules of the real components' steps
and faults against real PostgreSQL, real Redis and a provider that does not de-duplicate, then
the promise checked after quiescence. See tests/interleaving/README.md.

    OUTBOX_INTERLEAVING_SEED=1234            replay one seed (or a comma-separated list)
    OUTBOX_INTERLEAVING_EXAMPLES=50          run 50 seeds instead of the CI few
    OUTBOX_INTERLEAVING_STEPS=80             steps per seed
    OUTBOX_INTERLEAVING_FAULTS=lock,clock    only these fault kinds (default: all)
    OUTBOX_INTERLEAVING_VERBOSE=1            print the schedule's event log (with pytest -s)
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
from databases import fresh_database

from outbox import handlers
from outbox.db import make_engine
from outbox.migrate import upgrade
from outbox.testing.provider import ProviderSimulator

from .harness import FAULTS, Settings, World

pytestmark = pytest.mark.interleaving

CI_SEEDS = (1, 2, 3)
STEPS = int(os.environ.get("OUTBOX_INTERLEAVING_STEPS", "80"))


def _seeds() -> list[int]:
    raw = os.environ.get("OUTBOX_INTERLEAVING_SEED", "").strip()
    if raw:
        return [int(s) for s in raw.split(",") if s.strip()]
    examples = int(os.environ.get("OUTBOX_INTERLEAVING_EXAMPLES", "0") or 0)
    if examples:
        return [random.SystemRandom().randrange(1, 2**31) for _ in range(examples)]
    return list(CI_SEEDS)


def _faults() -> frozenset[str]:
    raw = os.environ.get("OUTBOX_INTERLEAVING_FAULTS", "").strip()
    if not raw:
        return FAULTS
    chosen = frozenset(f.strip() for f in raw.split(",") if f.strip())
    unknown = chosen - FAULTS
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {sorted(FAULTS)}")
    return chosen


@pytest.fixture
def database_url(services: Any) -> Iterator[str]:
    # A database per seed: nothing of an earlier seed (rows, ledger, locks) leaks into the next.
    with fresh_database(services.database_url, "outbox_interleaving") as url:
        engine = make_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        yield url


@pytest.mark.timeout(STEPS * 4 + 180)
@pytest.mark.parametrize("seed", _seeds())
def test_interleaving(seed: int, services: Any, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Settings(seed=seed, steps=STEPS, faults=_faults())
    with ProviderSimulator(dedupe=False) as provider:
        provider.configure(seed=seed)
        world = World(
            cfg,
            database_url=database_url,
            redis_url=services.redis_url,
            namespace=f"oxil{seed}",
            provider=provider,
            monkeypatch=monkeypatch,
        )
        try:
            findings = world.run()
            report = world.explain(findings) if findings else ""
            if os.environ.get("OUTBOX_INTERLEAVING_VERBOSE"):
                print(world.explain(findings) if findings else world.explain([]))
        finally:
            world.close()
            handlers.clear_registry()
    if findings and all(f.kind == "not terminal" for f in findings) and world.refused_connections:
        # Only unfinished rows, on a server that kept refusing connections: the environment, not
        # the product, is the likelier cause; a double charge or a wrong state still fails.
        pytest.skip(
            f"seed {seed}: {len(findings)} row(s) not terminal after PostgreSQL refused "
            f"{world.refused_connections} connection(s) (server full); rerun when it is not"
        )
    if findings:
        pytest.fail(
            f"interleaving seed {seed} broke the promise ({len(findings)} finding(s)); replay with "
            f"OUTBOX_INTERLEAVING_SEED={seed}"
            + (f" OUTBOX_INTERLEAVING_STEPS={STEPS}" if STEPS != 80 else "")
            + "\n"
            + "\n".join(f"  {f}" for f in findings)
            + "\n"
            + report,
            pytrace=False,
        )
