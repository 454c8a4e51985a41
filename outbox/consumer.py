"""One consumer run: claim → call → record. The broker ack comes after, in the worker.

Every outcome is logged as one structured line naming the row, never its payload.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg

from . import fence
from .db import connect_raw
from .failover import FailoverGuard
from .failpoints import failpoint
from .handlers import Delivery, Handler, idempotency_key
from .policy import Decision, Outcome, decide_exception, decide_result, next_state
from .validation import header_safe

logger = logging.getLogger(__name__)


class RunResult(enum.StrEnum):
    EMPTY = "empty"  # nothing to claim: a duplicate or stale message
    SENT = "sent"
    PENDING = "pending"  # retry scheduled
    FAILED = "failed"
    UNKNOWN = "unknown"
    SUPERSEDED = "superseded"  # a newer claim owns the row; our recording only went to the fence
    UNHANDLED = "unhandled"
    HALTED = "halted"  # not claimed: the database is on another history (outbox.failover)


class Consumer:
    """Runs deliveries for the handlers of one deploy; one instance is shared by all threads.

    Each thread keeps two connections: one for claims (synchronous commit: the claim must survive
    a database crash before the call starts) and one for records (asynchronous commit).
    """

    def __init__(
        self,
        database_url: str,
        handlers: Mapping[str, Handler],
        *,
        limit_call: Callable[[float], None] | None = None,
        failover_guard: FailoverGuard | None = None,
    ) -> None:
        self.database_url = database_url
        #: Read before every claim (an attribute, no I/O); set by the worker.
        self.failover_guard = failover_guard
        self.handlers = dict(handlers)
        # Set by the worker: arms a per-thread timer that interrupts a handler running past
        # the given number of seconds (Dramatiq's TimeLimit), so the call ends inside the lease.
        self._limit_call = limit_call
        self._local = threading.local()
        self._all: list[psycopg.Connection[Any]] = []
        self._all_lock = threading.Lock()

    # -- connections ---------------------------------------------------------------------------

    def _conn(self, name: str) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, name, None)
        if conn is None or conn.closed:
            options = "-c synchronous_commit=off" if name == "record_conn" else ""
            conn = connect_raw(self.database_url, autocommit=True, options=options)
            setattr(self._local, name, conn)
            with self._all_lock:
                self._all.append(conn)
            if name == "claim_conn" and self.failover_guard is not None:
                self.failover_guard.check_now()
        return conn

    def _drop(self, name: str) -> None:
        conn = getattr(self._local, name, None)
        if conn is not None:
            conn.close()
            setattr(self._local, name, None)

    def close(self) -> None:
        """Close every thread's connections (call once the worker threads have stopped)."""
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    def _halted(self) -> bool:
        if self.failover_guard is None:
            return False
        # Opening the claim connection (after a drop: perhaps to a new server) re-checks the
        # database identity first; otherwise this is an attribute read.
        self._conn("claim_conn")
        return self.failover_guard.halted

    # -- the run -------------------------------------------------------------------------------

    def deliver(self, row_id: int, destination: str) -> RunResult:
        if self._halted():
            # Nothing claimed, nothing written: the row stays `dispatched`, and the reconciler
            # re-queues it once an operator accepted the new database history.
            logger.warning(
                "outbox row %s not claimed: stopped after a database failover",
                row_id,
                extra={"outbox_id": row_id, "destination": destination, "outbox_run": "halted"},
            )
            return RunResult.HALTED
        handler = self.handlers.get(destination)
        if handler is None:
            reason = f"no handler for destination {destination!r} in this deploy"
            fence.fail_unhandled(self._conn("claim_conn"), row_id=row_id, error=reason)
            logger.error(
                "outbox row %s failed: %s",
                row_id,
                reason,
                extra={"outbox_id": row_id, "destination": destination},
            )
            return RunResult.UNHANDLED
        try:
            claimed = fence.claim(
                self._conn("claim_conn"),
                row_id=row_id,
                destination=destination,
                lease_seconds=handler.lease_seconds,
            )
        except psycopg.OperationalError:
            self._drop("claim_conn")
            raise
        if claimed is None:
            logger.info(
                "outbox row %s: nothing to claim (already claimed, settled or not due)",
                row_id,
                extra={"outbox_id": row_id, "destination": destination, "outbox_run": "empty"},
            )
            return RunResult.EMPTY
        failpoint("after_claim")

        now = datetime.now(UTC)
        if claimed.deadline is not None and claimed.deadline <= now:
            decision = Decision(Outcome.FAILED, error="deadline passed before the call")
        elif not header_safe(idempotency_key(claimed.key, claimed.step)):
            # Only rows written before `write` refused such keys get here. Failing before the
            # call is certain and clear; the call could only fail to encode its header, and go
            # `unknown` for lookups that cannot name it either.
            decision = Decision(
                Outcome.FAILED,
                error=(
                    f"key {claimed.key!r} cannot be sent as an Idempotency-Key header (not printable "
                    "ASCII); no call was made. Write the operation again under an ASCII key"
                ),
            )
        else:
            decision = self._call(handler, claimed)
        failpoint("after_call")

        nxt = next_state(
            handler,
            decision,
            attempt=claimed.attempt,
            deadline=claimed.deadline,
            now=datetime.now(UTC),
        )
        moved = self._record(claimed, decision, nxt.state, nxt.available_at, nxt.error)
        failpoint("after_record")
        result = RunResult(nxt.state) if moved else RunResult.SUPERSEDED
        log = logger.info if result in (RunResult.SENT, RunResult.PENDING) else logger.warning
        log(
            "outbox %s:%s -> %s (attempt %s)%s",
            claimed.key,
            claimed.step,
            result.value,
            claimed.attempt,
            f": {nxt.error}" if nxt.error else "",
            extra={
                "outbox_id": claimed.id,
                "key": claimed.key,
                "step": claimed.step,
                "destination": destination,
                "attempt": claimed.attempt,
                "outbox_run": result.value,
                "provider_ref": decision.ref,
            },
        )
        return result

    def _call(self, handler: Handler, claimed: fence.Claimed) -> Decision:
        delivery = delivery_for(claimed, handler)
        if self._limit_call is not None:
            self._limit_call(handler.time_limit)
        try:
            return decide_result(handler(delivery))
        except Exception as exc:
            return decide_exception(handler, exc)
        except BaseException as exc:
            # Dramatiq's TimeLimitExceeded and shutdown interrupts: the call may have happened.
            if type(exc).__name__ in ("TimeLimitExceeded", "Shutdown"):
                return decide_exception(handler, exc)
            raise
        finally:
            if self._limit_call is not None:
                # Room for the record; the lease still bounds the whole run.
                self._limit_call(handler.lease_seconds)

    def _record(
        self,
        claimed: fence.Claimed,
        decision: Decision,
        state: str,
        available_at: datetime | None,
        error: str | None,
    ) -> bool:
        # A failed record is not a lost outcome (the lease and the lookup recover it), but a
        # short database blip should not cost a lookup: try a few times within the lease.
        # An ambiguous call stays "unknown" on its fence row even when the row fails (an
        # idempotent destination out of attempts): a later replay must see it (outbox.outcomes).
        ambiguous = decision.outcome is Outcome.UNKNOWN
        outcome = decision.outcome.value if state != "failed" or ambiguous else "failed"
        for attempt in range(3):
            try:
                return fence.record(
                    self._conn("record_conn"),
                    row_id=claimed.id,
                    token=claimed.token,
                    state=state,
                    outcome=outcome,
                    ref=decision.ref,
                    response=decision.response,
                    error=error,
                    http_status=decision.http_status,
                    available_at=available_at,
                )
            except psycopg.OperationalError:
                self._drop("record_conn")
                if attempt == 2:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")


def delivery_for(claimed: fence.Claimed, handler: Handler) -> Delivery:
    """What the handler sees of a claimed row."""
    return Delivery(
        id=claimed.id,
        key=claimed.key,
        step=claimed.step,
        destination=claimed.destination,
        payload=claimed.payload,
        attempt=claimed.attempt,
        idempotency_key=idempotency_key(claimed.key, claimed.step),
        deadline=claimed.deadline,
        handler=handler,
    )
