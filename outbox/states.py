"""The row states of ``outbox_message``, who moves a row out of each, and by which function.

Every move is one guarded statement in :mod:`outbox.store` (the function named below, in the
module of its caller); nothing else in the product writes ``outbox_message``. A paused
destination's rows (:mod:`outbox.pauses`), and those behind an open breaker
(:mod:`outbox.breaker`) but for its probe, move no further than ``dispatched``: ``claim``
refuses them and ``requeue`` leaves them alone until the pause ends (the breaker closes);
``fail_past_deadline`` fails those whose deadline passes meanwhile.

==============  ==================================  =================================================
state           meaning                             moved out by (``outbox.store`` function)
==============  ==================================  =================================================
``pending``     committed, waiting to be published  relay: ``dispatch_due`` -> dispatched (a
                (or retried at ``available_at``)    limited destination's rows: ``dispatch_window``,
                                                    while its window has room; outbox.windows);
                                                    consumer: ``claim`` -> in_flight (a redelivered
                                                    message; -> unknown when an idempotent row's
                                                    earlier call is older than key_ttl; the rows
                                                    of one fetch at once: ``claim_group``),
                                                    ``fail_unhandled`` -> failed; reconciler:
                                                    ``fail_past_deadline`` -> failed (held back);
                                                    application: ``cancel_by_key``; operator:
                                                    ``cancel_rows`` -> cancelled
``dispatched``  published to the broker, not yet    consumer: ``claim``/``claim_group`` -> in_flight
                claimed                             (or unknown, as for pending),
                                                    ``fail_unhandled`` -> failed; relay:
                                                    ``undispatch`` -> pending (Redis refused);
                                                    reconciler: ``requeue`` -> pending (message
                                                    lost), ``fail_past_deadline`` -> failed;
                                                    ``cancel_by_key``/``cancel_rows``
``in_flight``   claimed; the external call may be   consumer: ``record`` -> sent/pending/failed/
                under way                           unknown, ``release`` -> pending (no call made);
                                                    reconciler: ``expire_leases`` -> unknown
``unknown``     the call may or may not have taken  reconciler: ``settle_unknown`` -> sent/pending/
                effect                              failed (``defer_unknown``, ``park_unknown``,
                                                    ``park_past_key_ttl`` keep it unknown); consumer:
                                                    ``record``/``release`` (its own late answer);
                                                    operator: ``resolve_sent``/``resolve_not_sent``/
                                                    ``resolve_failed``
``sent``        confirmed, ``provider_ref`` stored  terminal; reconciler: ``purge`` -> key ledger
``failed``      permanent error, attempts or        operator: ``replay_planned``/``replay_forced``
                deadline exhausted                  -> pending (``outbox repair`` too);
                                                    ``repair_found`` -> sent (its lookup found the
                                                    call); consumer: ``record`` -> sent (a late
                                                    confirmation under the same claim)
``cancelled``   cancelled before any call could     terminal; reconciler: ``purge`` -> key ledger
                have taken effect
==============  ==================================  =================================================

Rows are created ``pending`` by ``insert`` (``outbox.write``), and by the statement that settles
another row of the same key (:mod:`outbox.chains`): ``record`` (the consumer's
``record`` with the next steps), ``settle_unknown`` and ``resolve_sent`` write the settled row's
"then" steps when it moves to ``sent`` (``record`` its "on_failure" steps when it
fails for a certain reason); ``write_next_steps`` writes a ``sent`` row's missing ones later
(``clear_uncomputed`` takes the mark off rows that need none),
``repair_found`` a failed row's when its lookup finds the call. A batch's members are created
``pending`` by ``insert_member`` (``outbox.write(batch=)``, in the transaction whose
``insert_batch`` created the batch); ``finish_batch`` writes the batch's then or catch row once
every member is terminal (the reconciler); once its members are purged, the purge's
``strip_batches`` drops its then/catch payloads and ``drop_batches`` the batch itself (rows
unmoved). ``note_history`` only appends
who asked and why to a row's history (``outbox repair``).
Rows of an ordering key (:mod:`outbox.ordering`) move as above, one at a time: ``dispatch_due``
and ``claim`` pass over a row while an earlier row of its key holds it back; ``skip_head`` (an
operator's ``outbox skip``) only marks a ``failed`` head as no longer holding its key.
``mark_alerted`` only marks a ``failed`` or long-``unknown`` row (or a ``sent`` one whose next
steps are missing) as reported.
"""

from __future__ import annotations

PENDING = "pending"
DISPATCHED = "dispatched"
IN_FLIGHT = "in_flight"
UNKNOWN = "unknown"
SENT = "sent"
FAILED = "failed"
CANCELLED = "cancelled"

ALL = (PENDING, DISPATCHED, IN_FLIGHT, UNKNOWN, SENT, FAILED, CANCELLED)
TERMINAL = (SENT, FAILED, CANCELLED)
CLAIMABLE = (PENDING, DISPATCHED)
#: On their way to the provider: someone (relay, worker, reconciler) moves them without a human.
WAITING = (PENDING, DISPATCHED, IN_FLIGHT)
