"""Issue 9, classes 1, 2 and 8, against real PostgreSQL, Redis and HTTP servers on 127.0.0.1:

1. a lease eroded by a lock or commit wait: the lease counts from when the row is held, no call
   starts with less than ``time_limit`` + a margin of lease left (measured on the worker's own
   monotonic clock from when it sent the claim), the call has a total deadline, and a lease the
   reconciler expires waits one ``time_limit`` before its first lookup;
2. two clocks: a worker or reconciler whose clock is an hour off changes nothing, since every
   instant compared in SQL is computed there from the database's clock;
3. (class 8) a lost reply to a committed claim: the worker fences the claim's token, then
   releases the claim it owns; a claim that never committed can no longer commit behind its back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from helpers import elapse, lookup_on, relay_once
from sqlalchemy.orm import Session

import outbox
from outbox import consumer as consumer_module
from outbox import policy, settlement, store
from outbox.consumer import RELEASE_ALERT_THRESHOLD, DeliveryResult, LostClaim
from outbox.handlers import Handler, close_http_clients, registry
from outbox.reconciler import Reconciler
from outbox.reconciler.jobs import resolve_unknown as resolve_unknown_job
from outbox.reconciler.jobs.expire_leases import expire_leases
from outbox.reconciler.jobs.resolve_unknown import resolve_unknown
from outbox.settings import libpq_url

DEST = "payments.charge"


# -- helpers ---------------------------------------------------------------------------------------


def declare_charge(provider: Any, **options: Any) -> Handler:
    @outbox.handler(DEST, **{"time_limit": 2, "backoff": (60, 120), **options})
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(
            f"{provider.url}/charges", json=d.payload, headers={"Idempotency-Key": d.idempotency_key}
        )
        r.raise_for_status()
        return outbox.Confirmed(ref=r.json()["id"], response={"id": r.json()["id"]})

    return lookup_on(charge, provider)


def write_rows(engine: Any, n: int = 1, *, prefix: str = "order", **kw: Any) -> list[int]:
    with Session(engine) as s, s.begin():
        return [
            outbox.write(
                s,
                key=f"{prefix}:{i}",
                step="charge",
                destination=DEST,
                payload={"amount_cents": 1000, "currency": "EUR"},
                **kw,
            ).id
            for i in range(n)
        ]


def row(services: Any, row_id: int) -> dict[str, Any]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        cur = conn.execute("SELECT *, now() AS db_now FROM outbox_message WHERE id = %s", (row_id,))
        names = [c.name for c in cur.description or ()]
        found = cur.fetchone()
        assert found is not None
        return dict(zip(names, found, strict=True))


def fence_rows(services: Any, row_id: int) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        return conn.execute(
            "SELECT attempt, outcome FROM outbox_attempt WHERE message_id = %s ORDER BY id", (row_id,)
        ).fetchall()


def db_now(services: Any) -> datetime:
    with psycopg.connect(libpq_url(services.database_url)) as conn:
        found = conn.execute("SELECT now()").fetchone()
        assert found is not None
        return found[0]


def seconds_from_now(r: dict[str, Any], column: str) -> float:
    return (r[column] - r["db_now"]).total_seconds()


@contextlib.contextmanager
def row_held(services: Any, row_id: int, how: str) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding the row: ``lock`` only (SELECT … FOR UPDATE, changing nothing), or
    ``update`` (what the relay does between its Redis push and its commit). Committed on exit."""
    with psycopg.connect(libpq_url(services.database_url)) as holder:
        if how == "lock":
            holder.execute("SELECT id FROM outbox_message WHERE id = %s FOR UPDATE", (row_id,))
        else:
            # The relay's own move; the row is the only one due.
            assert [r[0] for r in store.relay.dispatch_due(holder, limit=1)] == [row_id]
        yield holder
        holder.commit()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # reported by the test's own assertion
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def wait_until_waiting_on_a_lock(services: Any, timeout: float = 10.0) -> None:
    """Until some backend of the test database waits on a row lock (the claim arrived)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            found = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            if found and found[0]:
                return
            time.sleep(0.02)
    raise AssertionError("no claim ever waited on the row lock")


# -- class 1: the lease counts from when the row is held ---------------------------------------------


@pytest.mark.parametrize("how", ["lock", "update"])
def test_claim_lease_counts_from_when_the_row_is_held(clean, engine, how):
    (row_id,) = write_rows(engine)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        with row_held(clean, row_id, how) as holder:
            thread, out = in_thread(
                lambda: store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30)
            )
            wait_until_waiting_on_a_lock(clean)
            # Within the claim's own lock wait (LOCK_WAIT_MS, set inside the statement).
            time.sleep(0.1)
            (let_go,) = holder.execute("SELECT clock_timestamp()").fetchone()  # type: ignore[misc]
        thread.join(10)
    assert "error" not in out, out
    assert out["result"] is not None
    r = row(clean, row_id)
    # The lock wait is not taken off the lease: it starts once the row is held.
    assert r["claimed_at"] >= let_go
    assert r["lease_expires_at"] >= let_go + timedelta(seconds=30)


@pytest.mark.parametrize("how", ["lock", "update"])
def test_a_claim_refused_a_row_lock_waits_without_its_connection_then_claims_with_a_whole_lease(
    clean, engine, provider, consumer, how
):
    """A row locked by another transaction for longer than a lease: the claim is refused the lock
    after LOCK_WAIT_MS (rolled back, nothing claimed), gives its pooled connection back, waits,
    and claims again; the claim that gets the row counts its lease from its own sending, so the
    call is made once, with the whole lease (a claim that had waited out the lock holding its
    connection would have had to be released without a call)."""
    # time_limit 5 s, lease 7 s: a call needs 5 s + 1 s of margin.
    declare_charge(provider, time_limit=5, lease_seconds=7)
    (row_id,) = write_rows(engine)
    c = consumer()
    with row_held(clean, row_id, how):
        thread, out = in_thread(lambda: c.deliver(row_id, DEST))
        time.sleep(2.0)
        assert provider.stats()["requests"] == 0
        assert row(clean, row_id)["state"] == "pending"
        let_go = row(clean, row_id)["db_now"]
    thread.join(10)
    assert out.get("result") is DeliveryResult.SENT, out
    r = row(clean, row_id)
    assert (r["state"], r["attempts"], r["releases"]) == ("sent", 1, 0)
    assert r["claimed_at"] >= let_go
    assert fence_rows(clean, row_id) == [(1, "sent")]
    assert provider.stats()["effects"] == {"order:0:charge": 1}


@pytest.fixture
def slow_commits(clean: Any) -> Iterator[None]:
    """Commits of a claim on a row whose key starts with `slowcommit:` take 1.5 s after the claim
    statement ran (a deferred trigger sleeps at commit), as a stalled synchronous standby would."""
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION outbox_test_slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE CONSTRAINT TRIGGER outbox_test_slow_commit AFTER UPDATE ON outbox_message "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            "WHEN (NEW.state = 'in_flight' AND NEW.key LIKE 'slowcommit:%%') "
            "EXECUTE FUNCTION outbox_test_slow_commit()"
        )
        try:
            yield
        finally:
            conn.execute("DROP TRIGGER outbox_test_slow_commit ON outbox_message")
            conn.execute("DROP FUNCTION outbox_test_slow_commit()")


def test_a_slow_commit_of_the_claim_releases_it_and_repeated_releases_alert(
    clean, engine, provider, consumer, slow_commits, caplog
):
    declare_charge(provider, time_limit=5, lease_seconds=7)
    (row_id,) = write_rows(engine, prefix="slowcommit")
    c = consumer()
    with caplog.at_level(logging.WARNING, logger="outbox.consumer"):
        for n in range(1, RELEASE_ALERT_THRESHOLD + 1):
            assert c.deliver(row_id, DEST) is DeliveryResult.RELEASED
            assert (row(clean, row_id)["releases"], row(clean, row_id)["attempts"]) == (n, 0)
    assert provider.stats()["requests"] == 0
    levels = [r.levelno for r in caplog.records if getattr(r, "outbox_run", None) == "released"]
    assert levels == [logging.WARNING] * (RELEASE_ALERT_THRESHOLD - 1) + [logging.ERROR]
    alert = caplog.records[-1]
    assert f"released {RELEASE_ALERT_THRESHOLD} times without a call" in alert.getMessage()
    assert alert.releases == RELEASE_ALERT_THRESHOLD  # type: ignore[attr-defined]


# -- class 1: the call's total deadline -------------------------------------------------------------


class TricklingServer:
    """An HTTP server on 127.0.0.1 that answers `{"id":"ch_slow"}` one byte every 0.3 s: each read
    is well inside httpx's read timeout, the whole answer is not inside the time limit."""

    BODY = b'{"id":"ch_slow"}'  # 16 bytes: 4.8 s

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.finished = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    def _answer(self, client: socket.socket) -> None:
        with client:
            client.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += client.recv(4096)
            self.requests += 1
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.BODY)}\r\n\r\n"
            try:
                client.sendall(head.encode())
                for i in range(len(self.BODY)):
                    if self._stop.wait(0.3):
                        return
                    client.sendall(self.BODY[i : i + 1])
                self.finished += 1
            except OSError:
                pass  # the client went away

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def trickling() -> Iterator[TricklingServer]:
    server = TricklingServer()
    yield server
    server.close()


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_call_past_its_time_limit_is_recorded_at_the_limit_and_its_late_answer_ignored(
    clean, engine, consumer, trickling, idempotent
):
    @outbox.handler(DEST, time_limit=1, backoff=(60,), idempotent=idempotent)
    def charge(d: outbox.Delivery) -> outbox.Confirmed:
        r = d.http.post(f"{trickling.url}/charges", json=d.payload)
        return outbox.Confirmed(ref=r.json()["id"])

    (row_id,) = write_rows(engine)
    c = consumer()
    started = time.monotonic()
    result = c.deliver(row_id, DEST)
    elapsed = time.monotonic() - started
    # httpx's read timeout (0.55 s) never fires: only the total deadline (1 s + 2.5 s of grace
    # for the timeouts' own errors) stops the wait, well before the answer's 4.8 s.
    assert charge.call_deadline_seconds == 3.5
    assert elapsed < 4.5, elapsed
    r = row(clean, row_id)
    assert "time limit" in r["last_error"] and r["lease_expires_at"] is None
    if idempotent:
        assert result is DeliveryResult.PENDING and r["state"] == "pending"
        assert 58 <= seconds_from_now(r, "available_at") <= 61
    else:
        assert result is DeliveryResult.UNKNOWN and r["state"] == "unknown"
        # The abandoned request may still land: the first lookup waits one time_limit.
        assert 0 < seconds_from_now(r, "available_at") <= 1.5
    # The abandoned call never gets to record its (late) answer.
    time.sleep(len(TricklingServer.BODY) * 0.3 + 0.5 - elapsed)
    assert row(clean, row_id)["state"] == r["state"]
    assert row(clean, row_id)["provider_ref"] is None
    assert trickling.finished == 0
    # The thread that runs the calls was replaced: the next delivery runs normally.
    c.handlers[DEST] = dataclasses.replace(charge, fn=lambda d: outbox.Confirmed(ref="ch_next"))
    (other,) = write_rows(engine, prefix="next")
    assert c.deliver(other, DEST) is DeliveryResult.SENT


# -- class 1: an expired lease waits one time_limit before its first lookup -------------------------


def test_an_expired_lease_is_looked_up_only_one_time_limit_later(clean, engine, provider):
    lookups: list[int] = []
    handler = declare_charge(provider, time_limit=5)
    original = handler.lookup_fn
    assert original is not None

    def counting(d: outbox.Delivery) -> outbox.Confirmed | None:
        lookups.append(d.id)
        return original(d)

    handler.lookup(counting)
    (row_id,) = write_rows(engine)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        assert store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30) is not None
        elapse(conn, 31, [row_id])  # the lease runs out
    with Reconciler(
        database_url=clean.database_url,
        redis_url=clean.redis_url,
        namespace=clean.namespace,
        handlers=registry(),
        module="tests",
    ) as reconciler:
        result = reconciler.run_once()
    # The worker may still be in its call: a lookup now could miss a charge that is landing.
    assert result["expire_leases"] == {"expired": 1} and result["resolve_unknown"] == {}
    assert lookups == []
    r = row(clean, row_id)
    assert r["state"] == "unknown"
    assert 4 <= seconds_from_now(r, "available_at") <= 5.5


# -- class 2: one clock ------------------------------------------------------------------------------


@pytest.fixture(params=[timedelta(hours=-1), timedelta(0), timedelta(hours=1)], ids=["behind", "on", "ahead"])
def skewed_clock(request, monkeypatch) -> timedelta:
    """This process's wall clock, as the product's code would read it, moved by an hour (or not:
    the control). The database's clock is untouched."""
    offset: timedelta = request.param

    class Skewed(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + offset

    for module in (consumer_module, policy, store.delivery, store.recovery, settlement, resolve_unknown_job):
        monkeypatch.setattr(module, "datetime", Skewed, raising=False)
    return offset


def test_a_worker_whose_clock_is_off_computes_every_instant_on_the_database_clock(
    clean, engine, provider, consumer, skewed_clock
):
    declare_charge(provider, time_limit=2, backoff=(60, 120), max_attempts=3)
    ambiguous, refused = write_rows(engine, 2)
    half_hour = db_now(clean) + timedelta(minutes=30)
    due_soon, refused_due_soon = write_rows(engine, 2, prefix="deadline", deadline=half_hour)
    provider.configure(
        fault_keys={
            "order:0:charge": "drop_after",
            "order:1:charge": "fail_before",
            "deadline:1:charge": "fail_before",
        }
    )
    c = consumer()
    assert c.deliver(ambiguous, DEST) is DeliveryResult.UNKNOWN
    assert c.deliver(refused, DEST) is DeliveryResult.PENDING
    # Its deadline is 30 minutes away on the database's clock, whatever this process thinks.
    assert c.deliver(due_soon, DEST) is DeliveryResult.SENT
    assert c.deliver(refused_due_soon, DEST) is DeliveryResult.PENDING

    # The first lookup waits one time_limit; the retry waits its backoff: both from the
    # database's now.
    assert 1.0 <= seconds_from_now(row(clean, ambiguous), "available_at") <= 2.5
    assert 58 <= seconds_from_now(row(clean, refused), "available_at") <= 61
    assert 58 <= seconds_from_now(row(clean, refused_due_soon), "available_at") <= 61
    assert row(clean, due_soon)["state"] == "sent"


def test_a_retry_past_the_deadline_fails_on_the_database_clock(
    clean, engine, provider, consumer, skewed_clock
):
    declare_charge(provider, time_limit=2, backoff=(60, 120), max_attempts=3)
    # 30 s left on the database's clock: a 60 s backoff would fall past it.
    (row_id,) = write_rows(engine, deadline=db_now(clean) + timedelta(seconds=30))
    provider.configure(fail_before_rate=1.0)
    assert consumer().deliver(row_id, DEST) is DeliveryResult.FAILED
    r = row(clean, row_id)
    assert r["state"] == "failed" and r["last_error"].startswith("deadline ")
    assert fence_rows(clean, row_id) == [(1, "failed")]


def test_a_reconciler_whose_clock_is_off_computes_every_instant_on_the_database_clock(
    clean, engine, provider, skewed_clock
):
    handler = declare_charge(provider, time_limit=2, backoff=(60, 120), max_attempts=3)
    not_found, expired = write_rows(engine, 2)
    # 30 minutes left on the database's clock: a retry after the backoff still fits.
    (not_found_near_deadline,) = write_rows(
        engine, prefix="near", deadline=db_now(clean) + timedelta(minutes=30)
    )
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        for row_id in (not_found, not_found_near_deadline, expired):
            claimed = store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=30)
            assert claimed is not None
            if row_id != expired:
                assert store.delivery.record(
                    conn, row_id=row_id, token=claimed.token, state="unknown", outcome="unknown", error="x"
                ).state
        # The lookups find nothing at the provider: both rows are retried after their backoff.
        assert resolve_unknown(conn, {DEST: handler}) == {"pending": 2}
        for row_id in (not_found, not_found_near_deadline):
            r = row(clean, row_id)
            assert r["state"] == "pending" and 58 <= seconds_from_now(r, "available_at") <= 61

        elapse(conn, 31, [expired])  # its lease runs out
        assert expire_leases(conn, {DEST: handler}) == 1
    r = row(clean, expired)
    assert r["state"] == "unknown" and 1.0 <= seconds_from_now(r, "available_at") <= 2.5


# -- class 8: a lost reply to a committed claim ------------------------------------------------------


class PgProxy:
    """A TCP proxy on 127.0.0.1 in front of PostgreSQL that, once armed, breaks the connection
    that sends the next claim statement:

    - ``after_commit``: the claim reaches the server and commits; its reply is swallowed and the
      connection closed once the server said it is ready again (so, after the commit);
    - ``before_reply``: the claim reaches the server; the connection is closed 0.3 s later while
      the statement is still running there (waiting on a row lock).
    """

    TRIGGER = b"INSERT INTO outbox_attempt"
    READY = b"Z\x00\x00\x00\x05"

    def __init__(self, database_url: str) -> None:
        parts = urlsplit(database_url)
        params = dict(parse_qsl(parts.query))
        socket_dir = params.pop("host", "")
        self.upstream: tuple[str, int] | str
        if socket_dir.startswith("/"):  # the embedded server listens on a Unix socket only
            (self.upstream,) = (p for p in glob.glob(f"{socket_dir}/.s.PGSQL.*") if not p.endswith(".lock"))
        else:
            self.upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.sock = socket.create_server(("127.0.0.1", 0))
        port = self.sock.getsockname()[1]
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        # Plain text, so that the proxy can see which statement is a claim.
        query = urlencode({**params, "sslmode": "disable", "gssencmode": "disable"})
        self.url = urlunsplit(
            (parts.scheme, f"{netloc[0]}@{host}" if len(netloc) == 2 else host, parts.path, query, "")
        )
        self.mode: str | None = None
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.upstream)
            return conn
        return socket.create_connection(self.upstream)

    def arm(self, mode: str) -> None:
        self.mode = mode

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            server = self._upstream()
            with self._lock:
                self._socks += [client, server]
            state = {"broken": False, "reply": b""}
            threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _up(self, client: socket.socket, server: socket.socket, state: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.mode is not None and self.TRIGGER in data:
                    mode, self.mode = self.mode, None
                    state["broken"] = mode
                    server.sendall(data)
                    if mode == "before_reply":
                        time.sleep(0.3)
                        self.fired.set()
                        self._close(client, server)
                    continue
                server.sendall(data)
        self._close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, state: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if state["broken"] == "after_commit":
                    state["reply"] += data
                    if state["reply"][-6:-1] == self.READY:
                        self.fired.set()
                        self._close(client, server)
                        return
                    continue
                if state["broken"]:
                    continue
                client.sendall(data)
        self._close(client, server)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            self._close(self.sock, *self._socks)


@pytest.fixture
def pg_proxy(clean: Any) -> Iterator[PgProxy]:
    proxy = PgProxy(clean.database_url)
    yield proxy
    proxy.close()


def test_a_lost_reply_to_a_committed_claim_releases_the_row_and_it_is_delivered_again(
    clean, engine, provider, consumer, pg_proxy
):
    declare_charge(provider)
    (row_id,) = write_rows(engine)
    assert relay_once(clean) == 1
    pg_proxy.arm("after_commit")
    c = consumer(pg_proxy.url)
    assert c.deliver(row_id, DEST) is DeliveryResult.RELEASED
    assert pg_proxy.fired.is_set()
    assert provider.stats()["requests"] == 0
    r = row(clean, row_id)
    # Not in_flight waiting for its lease to expire into `unknown` with no call made.
    assert (r["state"], r["attempts"], r["releases"]) == ("pending", 0, 1)
    assert "reply to the claim was lost" in r["last_error"]
    assert fence_rows(clean, row_id) == [(1, "released")]

    # Re-published by the relay and delivered: one charge.
    assert relay_once(clean) == 1
    assert c.deliver(row_id, DEST) is DeliveryResult.SENT
    assert provider.stats()["effects"] == {"order:0:charge": 1}
    assert row(clean, row_id)["state"] == "sent"


def test_a_claim_cut_off_while_it_waited_can_no_longer_commit(clean, engine, provider, consumer, pg_proxy):
    declare_charge(provider)
    (row_id,) = write_rows(engine)
    assert relay_once(clean) == 1
    pg_proxy.arm("before_reply")
    c = consumer(pg_proxy.url)
    with row_held(clean, row_id, "lock"):
        thread, out = in_thread(lambda: c.deliver(row_id, DEST))
        assert pg_proxy.fired.wait(30)
        # The fence waits for the row (its insert checks the row's key) like the claim did.
        time.sleep(1.0)
        assert "result" not in out
    # The lock is free now: a claim still waiting for it would commit here.
    thread.join(30)
    time.sleep(0.5)
    r = row(clean, row_id)
    assert (r["state"], r["attempts"], r["claim_token"]) == ("dispatched", 0, None)
    # The worker fenced the claim's token before it answered: the claim can never commit; the
    # row waits for the reconciler's re-dispatch (its message was taken).
    assert fence_rows(clean, row_id) == [(0, "released")]
    assert provider.stats()["requests"] == 0
    assert out.get("result") is DeliveryResult.EMPTY, out


# -- a pause between the start check and the call (attacker A2) ------------------------------------


def _reconcile_once(services: Any) -> tuple[int, dict[str, int]]:
    with psycopg.connect(libpq_url(services.database_url), autocommit=True) as conn:
        return expire_leases(conn, registry()), resolve_unknown(conn, registry())


def test_a_worker_paused_after_its_start_check_makes_no_call(clean, engine, provider, consumer, monkeypatch):
    """A worker passes the start check, then stops (SIGSTOP, a VM stall) for longer than its
    lease: the reconciler expires the lease, the lookup finds nothing, another worker charges.
    When the first one resumes it must not call: its call would start on a lease long gone."""
    charge = declare_charge(provider, time_limit=1, lease_seconds=3, backoff=(0.5,), max_attempts=3)
    lookup_on(charge, provider)
    real_delivery_for = consumer_module.delivery_for
    paused = threading.Event()

    def pausing_delivery_for(claimed: Any, handler: Any, deliveries: Any, **kw: Any) -> Any:
        if not paused.is_set() and threading.current_thread().name == "worker-A":
            paused.set()
            time.sleep(6.5)
        return real_delivery_for(claimed, handler, deliveries, **kw)

    monkeypatch.setattr(consumer_module, "delivery_for", pausing_delivery_for)
    (row_id,) = write_rows(engine)
    a, b = consumer(), consumer()
    results: dict[str, DeliveryResult] = {}
    worker_a = threading.Thread(
        target=lambda: results.setdefault("a", a.deliver(row_id, DEST)), name="worker-A"
    )
    worker_a.start()
    try:
        assert paused.wait(5)
        time.sleep(3.3)  # the lease (3 s) runs out while A is stopped
        assert _reconcile_once(clean)[0] == 1
        time.sleep(1.2)  # the first lookup waits one time_limit; the provider has nothing
        assert _reconcile_once(clean)[1] == {"pending": 1}
        time.sleep(0.7)
        assert b.deliver(row_id, DEST) is DeliveryResult.SENT
    finally:
        worker_a.join(15)
    assert results["a"] in (DeliveryResult.EMPTY, DeliveryResult.RELEASED)
    stats = provider.stats()
    assert stats["charges"] == 1 and stats["double_charged"] == []
    assert row(clean, row_id)["state"] == "sent"


def test_delivery_http_sends_nothing_past_the_calls_send_bound(provider):
    """The last line against a pause inside the call: past its bound, `d.http` refuses to send
    (certainly not sent, so a retry is safe) and the provider sees no request."""
    from outbox.exceptions import RetryableError
    from outbox.handlers import Deliveries, set_send_bound

    charge = declare_charge(provider, time_limit=1)
    client = Deliveries().client(charge)
    set_send_bound(time.monotonic() - 0.1)
    try:
        with pytest.raises(RetryableError, match="not sent"):
            client.post(f"{provider.url}/charges", json={}, headers={"Idempotency-Key": "k:1"})
    finally:
        set_send_bound(None)
        close_http_clients()
    assert provider.stats()["charges"] == 0


def test_a_confirmed_answer_settles_a_row_the_lookup_sent_back_under_the_same_claim(clean, engine, provider):
    """The call was slow to reach the provider: the lease expired, the lookup found nothing and
    sent the row back to `pending`, still under this claim's token. The worker's confirmed answer
    then arrives: it must settle the row `sent`, not be thrown away as superseded (the next claim
    would charge again)."""
    charge = declare_charge(provider, time_limit=1, lease_seconds=3, backoff=(0.5,), max_attempts=3)
    lookup_on(charge, provider)
    (row_id,) = write_rows(engine)
    with psycopg.connect(libpq_url(clean.database_url), autocommit=True) as conn:
        claimed = store.delivery.claim(conn, row_id=row_id, destination=DEST, lease_seconds=3)
        assert claimed is not None
        # Three seconds pass (the lease), then one time_limit (the first lookup's wait).
        elapse(conn, 3 + 1, [row_id])
        assert expire_leases(conn, registry()) == 1
        elapse(conn, 1, [row_id])
        assert resolve_unknown(conn, registry()) == {"pending": 1}
        state = store.delivery.record(
            conn, row_id=row_id, token=claimed.token, state="sent", outcome="sent", ref="ch_late"
        ).state
    assert state == "sent"
    found = row(clean, row_id)
    assert (found["state"], found["provider_ref"]) == ("sent", "ch_late")


# -- group claims: a lost reply is every row's; the lease counts from the group's send -----------


def test_a_lost_reply_to_a_committed_group_claim_is_every_rows(clean, engine, provider, consumer, pg_proxy):
    declare_charge(provider)
    ids = write_rows(engine, 3)
    assert relay_once(clean) == 3
    c = consumer(pg_proxy.url)
    c.warm_thread()
    pg_proxy.arm("after_commit")
    taken = c.claim_group(ids, DEST)
    assert pg_proxy.fired.is_set()
    assert sorted(taken) == ids and all(isinstance(t, LostClaim) for t in taken.values())
    # The claim had committed: each row is released (its own token), none called.
    for row_id in ids:
        assert c.deliver(row_id, DEST, taken[row_id]) is DeliveryResult.RELEASED
    assert provider.stats()["requests"] == 0
    assert [(row(clean, i)["state"], row(clean, i)["attempts"]) for i in ids] == [("pending", 0)] * 3
    assert relay_once(clean) == 3
    for row_id in ids:
        assert c.deliver(row_id, DEST) is DeliveryResult.SENT
    assert provider.stats()["effects"] == {f"order:{i}:charge": 1 for i in range(3)}


def test_a_group_claim_whose_commit_ate_the_lease_calls_none_of_its_rows(
    clean, engine, provider, consumer, slow_commits
):
    """The lease of every row counts from when the group's claim was sent: a commit that took
    1.5 s of a 7 s lease leaves less than time_limit (5 s) + the margin, so no row is called."""
    declare_charge(provider, time_limit=5, lease_seconds=7)
    ids = write_rows(engine, 3, prefix="slowcommit")
    assert relay_once(clean) == 3
    c = consumer()
    taken = c.claim_group(ids, DEST)
    assert sorted(taken) == ids
    for row_id in ids:
        assert c.deliver(row_id, DEST, taken[row_id]) is DeliveryResult.RELEASED
    assert provider.stats()["requests"] == 0
    assert [(row(clean, i)["state"], row(clean, i)["attempts"]) for i in ids] == [("pending", 0)] * 3
