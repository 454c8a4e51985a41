"""The outbox side of ``bench/soak.py``: ``bench/e2e.py``'s handler, and a clock on the statements.

Imported by ``outbox worker bench.soak_handlers`` (in every worker process) and ``outbox reconcile
bench.soak_handlers``; the relay, which imports no handler module, runs as ``python -m
bench.soak_handlers relay …`` (this module, then outbox's command line).

With ``BENCH_SOAK_TIMES=DIR`` each such process times, on the client side, the statements it
sends that ``bench/soak.py`` reports (:data:`KINDS`: the worker's claim and record, the relay's
take, the purge's move into the ledger and the horizon's drop), from ``execute`` to its return
(round trip, planning, lock waits and execution: what the process waits for), into histograms
of :data:`EDGES` with their sum, and writes them, cumulative, to ``DIR/<pid>.json`` every
:data:`DUMP_SECONDS` and at exit. Without the variable it is ``bench.e2e_handlers`` and nothing
more. The timing is a dictionary lookup and two clock reads per statement.
"""

from __future__ import annotations

import atexit
import bisect
import json
import math
import os
import sys
import threading
import time
from typing import Any

from bench.e2e_handlers import payments_charge  # noqa: F401  (registers the handler)

#: (kind, a piece of its SQL that no other statement of these processes has).
KINDS: tuple[tuple[str, str], ...] = (
    ("claim", "INSERT INTO outbox_attempt"),
    ("record", "'superseded:' ||"),
    ("take", "SET state = 'dispatched', dispatched_at = now()"),
    ("purge", "INSERT INTO outbox_key_ledger"),
    ("ledger_drop", "DELETE FROM outbox_key_ledger"),
)
#: Bucket upper edges in seconds: 10 µs to ~10 min, 10 % apart (a quantile is read to within 10 %).
EDGES: tuple[float, ...] = tuple(1e-5 * 1.1**i for i in range(int(math.log(6e7) / math.log(1.1)) + 2))
DUMP_SECONDS = 5.0


def quantile(counts: list[int], q: float) -> float:
    """The ``q`` quantile, in seconds, of a histogram over :data:`EDGES` (the bucket's upper edge);
    0.0 when it is empty."""
    total = sum(counts)
    if total == 0:
        return 0.0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return EDGES[min(i, len(EDGES) - 1)]
    return EDGES[-1]


def read_dumps(directory: str) -> tuple[dict[str, list[int]], dict[str, float]]:
    """The histograms and sums of every process that wrote to ``directory``, added up."""
    counts = {kind: [0] * (len(EDGES) + 1) for kind, _ in KINDS}
    sums = dict.fromkeys(counts, 0.0)
    for name in os.listdir(directory):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                dumped = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced this moment: read at the next interval
        for kind, histogram in dumped["counts"].items():
            counts[kind] = [a + b for a, b in zip(counts[kind], histogram, strict=True)]
            sums[kind] += dumped["seconds"][kind]
    return counts, sums


def _install(directory: str) -> None:
    import psycopg

    if getattr(psycopg.Cursor.execute, "_soak_timed", False):
        return  # run as __main__ and imported by name in the same process
    counts = {kind: [0] * (len(EDGES) + 1) for kind, _ in KINDS}
    sums = dict.fromkeys(counts, 0.0)
    kind_of: dict[Any, str | None] = {}
    lock = threading.Lock()
    original = psycopg.Cursor.execute

    def classify(query: Any) -> str | None:
        try:
            return kind_of[query]
        except (KeyError, TypeError):
            pass
        sql = query if isinstance(query, str) else str(query)
        kind = next((k for k, needle in KINDS if needle in sql), None)
        if isinstance(query, str) and len(kind_of) < 10_000:
            kind_of[query] = kind
        return kind

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        kind = classify(query)
        if kind is None:
            return original(self, query, params, **kwargs)
        start = time.perf_counter()
        try:
            return original(self, query, params, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            i = bisect.bisect_left(EDGES, seconds)
            with lock:
                counts[kind][i] += 1
                sums[kind] += seconds

    execute._soak_timed = True  # type: ignore[attr-defined]
    psycopg.Cursor.execute = execute  # type: ignore[method-assign]

    path = os.path.join(directory, f"{os.getpid()}.json")

    def dump() -> None:
        with lock:
            text = json.dumps({"counts": counts, "seconds": sums})
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def loop() -> None:
        while True:
            time.sleep(DUMP_SECONDS)
            dump()

    threading.Thread(target=loop, name="soak-times", daemon=True).start()
    atexit.register(dump)


if os.environ.get("BENCH_SOAK_TIMES"):
    _install(os.environ["BENCH_SOAK_TIMES"])


if __name__ == "__main__":
    from outbox.cli import main

    raise SystemExit(main(sys.argv[1:]))
