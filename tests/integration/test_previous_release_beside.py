"""An older release of outbox, running beside this code during a rolling deploy, cannot break the
rules of the features it does not know (issue 30).

The older release is extracted from git (``git archive``) and runs as real subprocesses, its
relay and its worker (``python -m outbox …`` from its own tree). As in a rolling deploy, the
database starts at the older release's head with those processes running, and this code migrates
it to its newest schema under them; this code then writes, relays, reconciles and acts as the
operator in-process, beside them.
Each test runs against two releases: FLOOR_RELEASE, the oldest code the schema still lets start
(it knows pauses and the breaker, not chains, batches, payload versions or ordering), and
test_schema_compat's PREVIOUS_RELEASE (the last release, which knows them all: for it the tests
guard against a regression; deduplicated when it is the same commit). What each test proves:

* ordering: rows of one ordering key are called one at a time, in write order, each once, while
  the older relay publishes every row at once and the older worker claims without looking at
  the order (the database refuses a claim behind a head; this code's reconciler puts the refused
  rows back, its relay publishes them when their turn comes);
* payload versions: a row (or a batch step) with ``payload_version <> 1`` is refused,
  ``outbox.write`` and plain SQL alike, while the feature is off; ``outbox features enable``
  refuses while an older worker lives, naming it, and once it works the release that does not
  know payload versions no longer starts; nor does it on a database whose migration enabled
  them by itself;
* chains and batches settled by an older worker continue exactly once through this code's
  reconciler jobs (next step and then row written once, from the stored confirmation), and
  running the jobs again adds nothing;
* failed rows stand: an operator's ``resolve --failed``, a row that let its ordering key go on
  and a compensated row stay failed whatever the older release does (its ``outbox replay``, its
  ``outbox repair`` where it has one, a late confirmation of its worker); a forced replay by this
  code still moves them;
* limits, priority and fairness: an operator's in-flight limit holds against the older worker
  (the provider never sees more calls at once), and rows written with a priority and fairness
  key are each charged once while the older relay publishes them unwindowed beside this code's;
* and what the others stand on: the older relay and worker deliver on this code's head, fed by
  this code's relay too.

Real PostgreSQL, Redis and provider simulator; a throwaway database and Redis namespace each.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psycopg
import pytest
import redis
from databases import fresh_database
from helpers import elapse, relay_once, wait_for, worker_thread
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import features, limits
from outbox.cli import main
from outbox.db import make_engine
from outbox.exceptions import FeatureNotEnabled, FeatureRefused
from outbox.handlers import Handler, registry
from outbox.migrate import FLOOR_TABLE, head_revision, upgrade
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.scheduler import Reconciler
from outbox.settings import libpq_url
from outbox.transport import delete_namespace

# FLOOR_RELEASE: the oldest code revision 0022 lets start (schema range 0010 to 0011): pauses and
# the breaker, no chains (0012), batches (0014), payload versions (0016) or ordering (0017).
from .test_schema_compat import FLOOR_RELEASE, PREVIOUS_RELEASE, ROOT, url_of

# The last tier of a run (tests/conftest.py): two releases' processes, minutes of it.
pytestmark = pytest.mark.previous_release

RELEASES = list(dict.fromkeys([FLOOR_RELEASE, PREVIOUS_RELEASE]))

#: Revisions that brought what the older release may not know.
PAYLOAD_VERSIONS, ORDERING = 16, 17

#: Every wait of this module is bounded by this (seconds).
WAIT = 60
#: A reconciler job acts at its first run once its rows are there: a few runs are plenty.
CONTINUE_WAIT = 15


# -- the older release -----------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    commit: str
    tree: Path

    @property
    def head(self) -> int:
        """The newest schema revision the release ships."""
        versions = self.tree / "outbox" / "migrations" / "versions"
        return max(int(p.name[:4]) for p in versions.glob("[0-9][0-9][0-9][0-9]_*.py"))

    def knows(self, revision: int) -> bool:
        return self.head >= revision

    def has_command(self, name: str) -> bool:
        registry_py = self.tree / "outbox" / "cli" / "registry.py"
        return registry_py.exists() and f'"{name}",' in registry_py.read_text()


def extract(commit: str, directory: Path) -> Path:
    """``commit``'s tree in ``directory``, its migrations where an install has them (as
    test_schema_compat's ``previous_release``); skips when git or the commit is absent."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: cannot extract the older release")
    probe = subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"no git history with commit {commit} (not a clone of the repository?)")
    archive = subprocess.run(
        [git, "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    # Without this copy the old code would import this tree's migrations (editable install).
    if not (directory / "outbox" / "migrations").exists():  # releases before v0.31 (no link)
        shutil.copytree(directory / "migrations", directory / "outbox" / "migrations")
    return directory


@pytest.fixture(
    scope="module",
    params=RELEASES,
    ids=[f"floor-{c}" if c == FLOOR_RELEASE else f"previous-{c}" for c in RELEASES],
)
def release(request, tmp_path_factory) -> Release:
    commit = request.param
    return Release(commit, extract(commit, tmp_path_factory.mktemp(f"release-{commit}")))


# -- handlers both releases load -------------------------------------------------------------

HANDLER_MODULE = "compat_handlers"

#: One module for the older worker and for this code: a release without chains skips the
#: @then/@on_failure declarations, which this code (and a release with chains) makes.
HANDLERS = '''"""Handlers of test_previous_release_beside: every call charges the provider simulator."""
import os

import outbox
from outbox import Confirmed, PermanentError

URL = os.environ.get("COMPAT_PROVIDER_URL", "http://127.0.0.1:9")
OPTIONS = dict(time_limit=10, max_attempts=3, backoff=(1,), breaker=None)


def call(d):
    r = d.http.post(URL + "/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key})
    if r.status_code == 402:
        raise PermanentError("card declined")
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})


def find(d):
    r = d.http.get(URL + "/charges", params={"idempotency_key": d.idempotency_key})
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})


@outbox.handler("compat.ordered", **OPTIONS)
def ordered(d):
    return call(d)


@outbox.handler("compat.chained", **OPTIONS)
def chained(d):
    return call(d)


@outbox.handler("compat.member", **OPTIONS)
def member(d):
    return call(d)


@outbox.handler("compat.followup", **OPTIONS)
def followup(d):
    return call(d)


for h in (ordered, chained, member, followup):
    h.lookup(find)

if hasattr(outbox, "Next"):

    @chained.then
    def receipt(d, c):
        return [outbox.Next("receipt", "compat.followup", {"of": d.key, "charge": c.ref})]

    @chained.on_failure
    def refund(d, error):
        return [outbox.Next("refund", "compat.followup", {"of": d.key})]
'''


@pytest.fixture(scope="module")
def handler_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("compat-handlers")
    (directory / f"{HANDLER_MODULE}.py").write_text(HANDLERS)
    return directory


@pytest.fixture
def handlers(handler_dir: Path, provider, monkeypatch) -> dict[str, Handler]:
    """The module declared in this process (forgotten after the test, with the registry)."""
    monkeypatch.setenv("COMPAT_PROVIDER_URL", provider.url)
    spec = importlib.util.spec_from_file_location(HANDLER_MODULE, handler_dir / f"{HANDLER_MODULE}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[HANDLER_MODULE] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[HANDLER_MODULE]
    return registry()


# -- a database, a namespace, the processes --------------------------------------------------


@pytest.fixture
def database(release, services) -> Iterator[Engine]:
    """A throwaway database at the older release's head, as before the deploy: each test starts
    the older processes, then :func:`deploy`."""
    with fresh_database(services.database_url, "outbox_beside") as url:
        engine = make_engine(url)
        try:
            upgrade(engine, f"{release.head:04d}")
            yield engine
        finally:
            engine.dispose()


def deploy(engine: Engine) -> None:
    """This code's ``outbox migrate``, the first step of a rolling deploy: the older processes
    already running keep going on the new head (docs/production.md)."""
    upgrade(engine)
    assert one(engine, "SELECT version_num FROM outbox_alembic_version") == head_revision()


@pytest.fixture
def namespace(services) -> Iterator[str]:
    name = f"beside{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(services.redis_url)
    try:
        delete_namespace(client, name)
    finally:
        client.close()


@dataclass
class Old:
    """A process of the older release; its output goes to a file (a pipe nobody reads would
    fill and stop it)."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (a clean stop: a worker marks its heartbeat stopped), then its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"{self.proc.args} did not stop on SIGTERM:\n{self.output()}") from None


class OldRelease:
    """Runs the older release's commands against one database and namespace."""

    def __init__(self, release: Release, env: dict[str, str], logs: Path) -> None:
        self.release = release
        self.env = env
        self.logs = logs
        self.started: list[Old] = []

    def spawn(self, *args: str) -> Old:
        log = self.logs / f"{len(self.started):02d}-{args[0]}.log"
        with log.open("wb") as out:
            # cwd: `python -m` puts the working directory first on sys.path; not this tree.
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox", *args],
                cwd=self.release.tree,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.started.append(Old(proc, log))
        return self.started[-1]

    def run(self, *args: str, timeout: float = WAIT) -> tuple[int, str]:
        """An older command to its end: its exit status and output."""
        old = self.spawn(*args)
        try:
            code = old.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            old.proc.kill()
            old.proc.wait(10)
            raise AssertionError(
                f"outbox {' '.join(args)} did not end in {timeout} s:\n{old.output()}"
            ) from None
        return code, old.output()

    def worker(self, threads: int = 1) -> Old:
        return self.spawn("worker", HANDLER_MODULE, "--threads", str(threads))

    def relay(self) -> Old:
        return self.spawn("relay")

    def close(self) -> None:
        for old in self.started:
            if old.proc.poll() is None:
                old.proc.kill()
                old.proc.wait(10)


@pytest.fixture
def old(release, database, services, namespace, provider, handler_dir, tmp_path) -> Iterator[OldRelease]:
    env = services.env(
        OUTBOX_DATABASE_URL=url_of(database),
        OUTBOX_NAMESPACE=namespace,
        PYTHONPATH=os.pathsep.join([str(release.tree), str(handler_dir)]),
        COMPAT_PROVIDER_URL=provider.url,
        OUTBOX_HEARTBEAT_INTERVAL="1",
        OUTBOX_POLL_INTERVAL="0.5",
    )
    logs = tmp_path / "old-logs"
    logs.mkdir()
    runner = OldRelease(release, env, logs)
    try:
        yield runner
    finally:
        # Before the database fixture drops the database.
        runner.close()


@pytest.fixture
def svc(database, services, namespace) -> SimpleNamespace:
    """This code's view of the services: the throwaway database, the test's namespace."""
    return SimpleNamespace(database_url=url_of(database), redis_url=services.redis_url, namespace=namespace)


@pytest.fixture
def reconciler(svc, handlers) -> Iterator[Reconciler]:
    """This code's reconciler on the handler module; a dispatched row whose message is gone is
    re-queued at once (no grace)."""
    rec = Reconciler(
        database_url=svc.database_url,
        redis_url=svc.redis_url,
        handlers=handlers,
        module=HANDLER_MODULE,
        namespace=svc.namespace,
        redispatch_after_seconds=2,
        redispatch_grace_seconds=0,
    )
    try:
        yield rec
    finally:
        rec.close()


# -- small helpers ---------------------------------------------------------------------------


def q(engine: Engine, statement: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(statement), params).all())


def one(engine: Engine, statement: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(statement), params).scalar()


def state_of(engine: Engine, row_id: int) -> str:
    return str(one(engine, "SELECT state FROM outbox_message WHERE id = :i", i=row_id))


def history_of(engine: Engine, row_id: int) -> list[dict[str, Any]]:
    return list(
        one(engine, "SELECT COALESCE(history, '[]'::jsonb) FROM outbox_message WHERE id = :i", i=row_id)
    )


def count_rows(engine: Engine, key: str, step: str) -> int:
    return int(one(engine, "SELECT count(*) FROM outbox_message WHERE key = :k AND step = :s", k=key, s=step))


def write(engine: Engine, key: str, destination: str, **kw: Any) -> int:
    payload = kw.pop("payload", {"amount_cents": 100, "currency": "EUR"})
    with Session(engine) as s, s.begin():
        return outbox.write(
            s, key=key, step=kw.pop("step", "charge"), destination=destination, payload=payload, **kw
        ).id


def cli(capsys, engine: Engine, *argv: str) -> tuple[int, str]:
    """This code's ``outbox`` command, in-process: exit status and output."""
    capsys.readouterr()
    code = main([*argv, "--database-url", url_of(engine)])
    out, err = capsys.readouterr()
    return code, out + err


def table(engine: Engine) -> str:
    """The rows as they stand, for a failure's message."""
    rows = q(engine, "SELECT id, key, step, state, attempts, last_error FROM outbox_message ORDER BY id")
    return "\n".join(
        f"  {r.id} {r.key} {r.step} {r.state} attempts={r.attempts} {r.last_error or ''}" for r in rows
    )


def wait_rows(engine: Engine, predicate: Callable[[], Any], what: str, *, every: float = 0.1) -> Any:
    """:func:`wait_for`, whose timeout shows the rows."""
    try:
        return wait_for(predicate, WAIT, what, every=every)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the rows:\n{table(engine)}") from None


def live_workers(engine: Engine) -> list[Any]:
    return q(
        engine,
        "SELECT id, pid, hostname FROM outbox_process WHERE kind = 'worker' AND stopped_at IS NULL "
        "AND last_seen_at > now() - interval '10 seconds'",
    )


def wait_beating(engine: Engine, worker: Old) -> list[Any]:
    def beating() -> list[Any]:
        if worker.proc.poll() is not None:
            raise AssertionError(f"the older worker exited {worker.proc.returncode}:\n{worker.output()}")
        return live_workers(engine)

    return wait_for(beating, WAIT, "the older worker's heartbeat", every=0.2)


def start_refused(engine: Engine, old: OldRelease) -> str:
    """The older worker's output once it refused to start; fails as soon as it beats instead."""
    worker = old.worker()

    def ended() -> bool:
        if worker.proc.poll() is not None:
            return True
        if live_workers(engine):
            raise AssertionError(f"the older worker started:\n{worker.output()}")
        return False

    wait_for(ended, WAIT, "the older worker to refuse to start", every=0.2)
    assert worker.proc.returncode != 0, worker.output()
    return worker.output()


def wait_state(engine: Engine, row_id: int, states: set[str], *, worker: Old | None = None) -> str:
    def reached() -> str | None:
        if worker is not None and worker.proc.poll() is not None:
            raise AssertionError(f"the older worker exited {worker.proc.returncode}:\n{worker.output()}")
        state = state_of(engine, row_id)
        return state if state in states else None

    return wait_rows(engine, reached, f"row {row_id} to be {' or '.join(sorted(states))}")


def charge_number(provider, idempotency_key: str) -> int:
    """The provider's charge id ``ch_N`` for the key: N counts charges in the order made."""
    r = httpx.get(f"{provider.url}/charges", params={"idempotency_key": idempotency_key}, timeout=10)
    r.raise_for_status()
    return int(r.json()["id"].removeprefix("ch_"))


def run_jobs(reconciler: Reconciler, *names: str) -> dict[str, dict[str, int]]:
    counts = {name: reconciler.run_job(name) for name in names}
    assert not any("error" in c for c in counts.values()), counts
    return counts


# -- (a) ordering ----------------------------------------------------------------------------

KEYS, ROWS_PER_KEY = 3, 5


def test_ordering_holds_against_an_older_relay_and_worker(
    release, database, old, svc, reconciler, provider
) -> None:
    provider.slow(150)  # a call long enough that a second claim of its key would overlap it
    worker = old.worker(threads=4)
    relay = old.relay()
    wait_beating(database, worker)
    deploy(database)
    written: dict[str, list[int]] = {f"customer:{k}": [] for k in range(KEYS)}
    for n in range(ROWS_PER_KEY):
        for k, ordering_key in enumerate(written):
            row = write(database, f"order:{k}-{n}", "compat.ordered", ordering_key=ordering_key)
            written[ordering_key].append(row)
    every = [row for rows in written.values() for row in rows]

    requeued = 0

    def all_sent() -> bool:
        nonlocal requeued
        for proc in (worker, relay):
            assert proc.proc.poll() is None, f"an older process exited:\n{proc.output()}"
        counts = run_jobs(reconciler, "redispatch")["redispatch"]
        requeued += counts.get("missing", 0) + counts.get("unacked", 0)
        relay_once(svc)
        states = q(database, "SELECT state FROM outbox_message WHERE id = ANY(:ids)", ids=every)
        return all(s == "sent" for (s,) in states)

    wait_rows(database, all_sent, "every ordered row to be sent", every=0.3)

    # Each row called once, by one claim.
    effects = provider.stats()["effects"]
    keys = q(database, "SELECT key FROM outbox_message WHERE id = ANY(:ids)", ids=every)
    assert effects == {f"{key}:charge": 1 for (key,) in keys}, effects
    attempts = q(
        database,
        "SELECT message_id, started_at, finished_at, outcome FROM outbox_attempt "
        "WHERE message_id = ANY(:ids) ORDER BY message_id",
        ids=every,
    )
    assert sorted(a.message_id for a in attempts) == sorted(every), "one attempt row a row"
    assert {a.outcome for a in attempts} == {"sent"}
    started = {a.message_id: a.started_at for a in attempts}
    completed = dict(
        q(database, "SELECT id, completed_at FROM outbox_message WHERE id = ANY(:ids)", ids=every)
    )
    for ordering_key, rows in written.items():
        assert rows == sorted(rows)
        for before, after in itertools.pairwise(rows):
            # No call of a row started before the row ahead of it had settled.
            assert started[after] >= completed[before], (ordering_key, before, after)
        # The provider saw them in the same order.
        numbers = [charge_number(provider, f"{key}:charge") for key in _keys_of(database, rows)]
        assert numbers == sorted(numbers), (ordering_key, numbers)
    if not release.knows(ORDERING):
        # The older relay published rows behind their heads, the older worker's claims of them
        # moved nothing, and this code's reconciler put them back: the case under test happened.
        assert requeued > 0


def _keys_of(engine: Engine, rows: list[int]) -> list[str]:
    by_id = dict(q(engine, "SELECT id, key FROM outbox_message WHERE id = ANY(:ids)", ids=rows))
    return [by_id[r] for r in rows]


# -- (b) payload versions --------------------------------------------------------------------


def enable_payload_versions(engine: Engine) -> None:
    features.enable(engine, "payload_versions", by="test", reason="issue 30", settle_seconds=0)


INSERT_V2 = (
    "INSERT INTO outbox_message (key, step, destination, payload, payload_version) "
    "VALUES ('order:sql', 'charge', 'compat.ordered', '{}', 2)"
)


def test_payload_versions_stay_off_while_an_older_worker_lives(release, database, old, capsys) -> None:
    if release.knows(PAYLOAD_VERSIONS):
        # Its workers accept versioned payloads: they hold nothing off (and its own migration
        # to 0022, with no process beating, already enabled the feature).
        pytest.skip(f"{release.commit} knows payload versions")
    worker = old.worker()
    [(_, pid, _)] = wait_beating(database, worker)
    # Migrated while an older worker lives, the database keeps payload versions off.
    deploy(database)
    assert one(database, "SELECT count(*) FROM outbox_feature WHERE name = 'payload_versions'") == 0

    # A versioned row is refused, by outbox.write and by plain SQL alike, and so is a batch
    # whose then step is versioned.
    engine = make_engine(url_of(database))  # write checks the schema once per engine
    try:
        with pytest.raises(FeatureNotEnabled, match="payload_versions"):
            write(engine, "order:v2", "compat.ordered", payload_version=2)
        with pytest.raises(FeatureNotEnabled, match="payload_versions"), Session(engine) as s, s.begin():
            outbox.batch(s, name="import:v2", then=outbox.Next("report", "compat.followup", {}, 2))
    finally:
        engine.dispose()
    with psycopg.connect(libpq_url(url_of(database)), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(INSERT_V2)
    assert refused.value.sqlstate == "OB001", refused.value
    assert count_rows(database, "order:v2", "charge") == count_rows(database, "order:sql", "charge") == 0
    assert one(database, "SELECT count(*) FROM outbox_batch") == 0

    # Enabling is refused while the older worker lives, naming it.
    with pytest.raises(FeatureRefused) as why:
        enable_payload_versions(database)
    assert str(pid) in str(why.value), why.value
    code, out = cli(
        capsys, database, "features", "enable", "payload_versions", "--reason", "issue 30", "--settle", "0"
    )
    assert code != 0 and str(pid) in out, out
    assert one(database, "SELECT count(*) FROM outbox_feature WHERE name = 'payload_versions'") == 0

    # Stopped cleanly, the worker is no longer live: enabling works, and records a floor.
    assert worker.stop() == 0, worker.output()
    assert one(database, "SELECT bool_and(stopped_at IS NOT NULL) FROM outbox_process WHERE pid = :p", p=pid)
    assert live_workers(database) == []
    floors = set(q(database, f"SELECT migration, needs_code FROM {FLOOR_TABLE}"))
    code, out = cli(
        capsys, database, "features", "enable", "payload_versions", "--reason", "issue 30", "--settle", "0"
    )
    assert code == 0, out
    added = set(q(database, f"SELECT migration, needs_code FROM {FLOOR_TABLE}")) - floors
    assert any(int(needs) >= PAYLOAD_VERSIONS for _, needs in added), (floors, added)

    # The older release now refuses to start, unless it knows payload versions.
    if release.knows(PAYLOAD_VERSIONS):
        restarted = old.worker()
        wait_beating(database, restarted)
        assert restarted.stop() == 0, restarted.output()
    else:
        assert "needs outbox code from revision" in start_refused(database, old)

    row = write(database, "order:v2", "compat.ordered", payload_version=2)
    assert one(database, "SELECT payload_version FROM outbox_message WHERE id = :i", i=row) == 2


def test_a_database_migrated_with_no_older_process_refuses_an_older_release_that_ignores_versions(
    release, database, old
) -> None:
    """0022 on a database no process beats on enables payload versions by itself; an older
    release started after it (a pod of the old deployment restarting mid-deploy) would hand a
    versioned payload to a handler that reads it as version 1."""
    if release.knows(PAYLOAD_VERSIONS):
        pytest.skip(f"{release.commit} knows payload versions")
    deploy(database)
    assert one(database, "SELECT count(*) FROM outbox_feature WHERE name = 'payload_versions'") == 1
    assert "needs outbox code from revision" in start_refused(database, old)


# -- (c) chains and batches ------------------------------------------------------------------


def test_chains_and_batches_settled_by_an_older_worker_continue_once(
    database, old, svc, reconciler, provider
) -> None:
    worker = old.worker(threads=2)
    old.relay()
    wait_beating(database, worker)
    deploy(database)
    chain = write(database, "order:c1", "compat.chained")
    with Session(database) as s, s.begin():
        batch = outbox.batch(
            s,
            name="import:c1",
            then=outbox.Next("report", "compat.followup", {"import": "c1"}),
            catch=outbox.Next("alert", "compat.followup", {"import": "c1", "failed": True}),
        )
        members = [
            outbox.write(
                s,
                key=f"import:c1:{n}",
                step="chunk",
                destination="compat.member",
                payload={"n": n},
                batch=batch,
            ).id
            for n in range(3)
        ]
    for row in (chain, *members):
        wait_state(database, row, {"sent"}, worker=worker)

    # This code's reconciler continues them: one run of each job is enough once they settled.
    ran: list[dict[str, dict[str, int]]] = []

    def written(key: str, step: str) -> Callable[[], bool]:
        def done() -> bool:
            ran.append(run_jobs(reconciler, "chains", "batches"))
            relay_once(svc)
            return count_rows(database, key, step) == 1

        return done

    for key, step, what in (
        ("import:c1", "report", "the batch's then row (batches job)"),
        ("order:c1", "receipt", "the chain's next step (chains job)"),
    ):
        try:
            wait_for(written(key, step), CONTINUE_WAIT, what, every=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; job counts: {ran[-3:]}; the rows:\n{table(database)}") from None
    receipt = one(database, "SELECT id FROM outbox_message WHERE key = 'order:c1' AND step = 'receipt'")
    report = one(database, "SELECT id FROM outbox_message WHERE key = 'import:c1' AND step = 'report'")
    for row in (receipt, report):
        wait_state(database, row, {"sent"}, worker=worker)

    # Computed from the confirmation as stored, whoever settled the step; no problem left.
    [(ref, problem)] = q(
        database, "SELECT provider_ref, chain_problem FROM outbox_message WHERE id = :i", i=chain
    )
    assert (ref, problem) == (f"ch_{charge_number(provider, 'order:c1:charge')}", None)
    assert one(database, "SELECT payload FROM outbox_message WHERE id = :i", i=receipt) == {
        "of": "order:c1",
        "charge": ref,
    }

    # Again and again: nothing more is written (a run may still clear the mark of a row the older
    # worker settled since, the receipt and the report, which have no next steps), then nothing.
    before = one(database, "SELECT count(*) FROM outbox_message")
    for _ in range(3):
        counts = run_jobs(reconciler, "chains", "batches")
        written_now = {
            k: c[k] for c in counts.values() for k in ("steps", "then", "catch", "written") if k in c
        }
        assert not written_now, counts
    assert counts == {"chains": {}, "batches": {}}
    assert one(database, "SELECT count(*) FROM outbox_message") == before
    assert count_rows(database, "order:c1", "receipt") == count_rows(database, "import:c1", "report") == 1
    assert count_rows(database, "import:c1", "alert") == 0
    effects = provider.stats()["effects"]
    assert effects == {
        "order:c1:charge": 1,
        "order:c1:receipt": 1,
        "import:c1:report": 1,
        **{f"import:c1:{n}:chunk": 1 for n in range(3)},
    }, effects


# -- (d) failed rows stand -------------------------------------------------------------------


def old_replay_and_repair(old: OldRelease, row_id: int, key: str) -> list[str]:
    """What the older release offers to move a failed row on: its ``outbox replay``, and its
    ``outbox repair`` when it has one. Their outputs, for the assertion messages."""
    outputs = [old.run("replay", str(row_id))[1]]
    if old.release.has_command("repair"):
        outputs.append(
            old.run("repair", key, "--module", HANDLER_MODULE, "--yes", "--reason", "older repair")[1]
        )
    return outputs


def forced_replay(capsys, engine: Engine, row_id: int) -> None:
    code, out = cli(capsys, engine, "replay", str(row_id))
    assert code != 0 and state_of(engine, row_id) == "failed", out
    code, out = cli(capsys, engine, "replay", str(row_id), "--force", "--reason", "checked with the provider")
    assert code == 0, out
    assert state_of(engine, row_id) != "failed"
    last = history_of(engine, row_id)[-1]
    assert last["action"] == "replay" and last.get("forced") is True, last


def test_an_operators_failure_stands_against_the_older_release(database, old, provider, capsys) -> None:
    worker = old.worker()
    old.relay()
    wait_beating(database, worker)
    deploy(database)
    provider.configure(fault_keys={"order:d1:charge": "drop_after"})  # charged, unanswered
    row = write(database, "order:d1", "compat.chained")
    wait_state(database, row, {"unknown"}, worker=worker)
    code, out = cli(
        capsys, database, "resolve", str(row), "--failed", "refunded by hand", "--reason", "ticket 7"
    )
    assert code == 0 and state_of(database, row) == "failed", out
    history = history_of(database, row)

    outputs = old_replay_and_repair(old, row, "order:d1")
    assert state_of(database, row) == "failed", outputs
    assert history_of(database, row) == history, outputs
    assert count_rows(database, "order:d1", "receipt") == 0, outputs
    assert provider.charges("order:d1:charge") == 1

    forced_replay(capsys, database, row)


def test_a_late_answer_of_an_older_worker_leaves_an_operators_failure(
    database, old, handlers, provider, capsys
) -> None:
    provider.slow(4000)  # the call is under way while the lease expires and the operator acts
    worker = old.worker()
    old.relay()
    wait_beating(database, worker)
    deploy(database)
    row = write(database, "order:d2", "compat.chained")
    wait_state(database, row, {"in_flight"}, worker=worker)
    wait_for(lambda: provider.stats()["requests"] >= 1, WAIT, "the call to reach the provider")
    with psycopg.connect(libpq_url(url_of(database)), autocommit=True) as conn:
        elapse(conn, handlers["compat.chained"].lease_seconds + 1, [row])
        assert expire_leases(conn, handlers) == 1
    code, out = cli(
        capsys, database, "resolve", str(row), "--failed", "refunded by hand", "--reason", "ticket 8"
    )
    assert code == 0, out

    # The provider answers; the older worker records its confirmation with its claim token (the
    # attempt row said lease_expired since the reconciler expired it).
    wait_for(
        lambda: (
            one(database, "SELECT outcome FROM outbox_attempt WHERE message_id = :i", i=row)
            != "lease_expired"
        ),
        WAIT,
        "the older worker's late record",
    )
    assert provider.charges("order:d2:charge") == 1
    assert q(database, "SELECT state, provider_ref FROM outbox_message WHERE id = :i", i=row) == [
        ("failed", None)
    ]
    assert q(database, "SELECT outcome FROM outbox_attempt WHERE message_id = :i", i=row) == [
        ("superseded:sent",)
    ]
    assert count_rows(database, "order:d2", "receipt") == 0
    assert worker.proc.poll() is None, worker.output()


def test_the_older_release_cannot_replay_a_row_out_of_line_or_compensated(
    database, old, svc, handlers, provider, capsys
) -> None:
    # The older worker serves the ordered rows and the compensations; the chain step is this
    # code's worker's, so that its failure writes the compensation.
    worker = old.spawn(
        "worker", HANDLER_MODULE, "--threads", "1", "--queues", "compat.ordered", "compat.followup"
    )
    old.relay()
    wait_beating(database, worker)
    deploy(database)

    # A chain step that failed for certain, settled by this code: its compensation is written.
    provider.configure(fault_keys={"order:d3c:charge": "decline"})
    compensated = write(database, "order:d3c", "compat.chained")
    with worker_thread(svc, threads=1, handlers={"compat.chained": handlers["compat.chained"]}):
        relay_once(svc)
        wait_state(database, compensated, {"failed"})
    refund = one(database, "SELECT id FROM outbox_message WHERE key = 'order:d3c' AND step = 'refund'")
    assert refund is not None, table(database)
    wait_state(database, refund, {"sent"}, worker=worker)

    # An ordering key's head that failed for certain, skipped by an operator, the next row sent.
    provider.configure(fault_keys={"order:d3a:charge": "decline"})
    head = write(database, "order:d3a", "compat.ordered", ordering_key="customer:d3")
    wait_state(database, head, {"failed"}, worker=worker)
    code, out = cli(capsys, database, "skip", str(head), "--reason", "address fixed by hand")
    assert code == 0, out
    behind = write(database, "order:d3b", "compat.ordered", ordering_key="customer:d3")
    wait_state(database, behind, {"sent"}, worker=worker)

    histories = {row: history_of(database, row) for row in (head, compensated)}
    outputs = old_replay_and_repair(old, head, "order:d3a") + old_replay_and_repair(
        old, compensated, "order:d3c"
    )
    assert {row: state_of(database, row) for row in histories} == dict.fromkeys(histories, "failed"), outputs
    assert {row: history_of(database, row) for row in histories} == histories, outputs
    assert provider.charges("order:d3a:charge") == provider.charges("order:d3c:charge") == 0

    for row in (head, compensated):
        forced_replay(capsys, database, row)


# -- the harness itself ------------------------------------------------------------------------


def test_the_older_release_relays_and_delivers_beside_this_code(database, old, svc, provider) -> None:
    """What every test above stands on: the older relay and worker run on this code's head, and
    this code's relay feeds the older worker."""
    worker = old.worker()
    relay = old.relay()
    wait_beating(database, worker)
    deploy(database)
    by_old_relay = write(database, "order:h1", "compat.ordered")
    wait_state(database, by_old_relay, {"sent"}, worker=worker)
    assert relay.stop() == 0, relay.output()
    by_this_relay = write(database, "order:h2", "compat.ordered")
    assert relay_once(svc) == 1
    wait_state(database, by_this_relay, {"sent"}, worker=worker)
    assert provider.stats()["effects"] == {"order:h1:charge": 1, "order:h2:charge": 1}
    assert worker.stop() == 0, worker.output()


# -- (e) limits, priority and fairness (issue 33) ------------------------------------------------


def test_limits_hold_beside_an_older_relay_and_worker_and_fairness_waits_for_them(
    release, database, old, svc, reconciler, provider, capsys
) -> None:
    """An operator's in-flight limit holds against the older worker's claims (the claim trigger
    refuses them; this code's reconciler puts the refused rows back) while the older relay
    publishes the limited rows past the window, and the provider never sees more calls at once
    than the limit. Priority and fairness keys, which the older relay would ignore, are refused
    until ``outbox features enable fairness``, which refuses while the older processes live."""
    provider.slow(100)
    worker = old.worker(threads=6)
    relay = old.relay()
    wait_beating(database, worker)
    deploy(database)
    with database.begin() as conn:
        limits.set_limit(conn, "compat.ordered", in_flight=2, by="test", reason="the provider's quota")
    if not release.knows(25):
        # A release that knows the feature migrated its database with no process live: on.
        with pytest.raises(FeatureNotEnabled, match="fairness"):
            write(database, "order:lim-high", "compat.ordered", priority="high")
        with pytest.raises(FeatureNotEnabled, match="fairness"):
            write(database, "order:lim-tenant", "compat.ordered", fairness_key="tenant:1")
        code, out = cli(
            capsys, database, "features", "enable", "fairness", "--reason", "deploy", "--settle", "0"
        )
        assert code != 0 and "fairness" in out, out
    every = [write(database, f"order:lim-{n}", "compat.ordered") for n in range(16)]

    def all_sent() -> bool:
        for proc in (worker, relay):
            assert proc.proc.poll() is None, f"an older process exited:\n{proc.output()}"
        run_jobs(reconciler, "redispatch", "expire_leases")
        relay_once(svc)
        states = q(database, "SELECT state FROM outbox_message WHERE id = ANY(:ids)", ids=every)
        return all(s == "sent" for (s,) in states)

    wait_rows(database, all_sent, "every limited row to be sent", every=0.3)
    stats = provider.stats()
    keys = q(database, "SELECT key FROM outbox_message WHERE id = ANY(:ids)", ids=every)
    assert stats["effects"] == {f"{key}:charge": 1 for (key,) in keys}, stats["effects"]
    assert stats["most_in_flight"] <= 2, stats["most_in_flight"]
