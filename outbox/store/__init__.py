"""The store: every statement that writes an ``outbox_*`` table, one guarded statement per move,
in one module per caller.

The product's safety rests on this: a row moves only if it is still where the mover saw it (its
state, its claim token, its dispatch time or failure time), in ONE statement, so two movers
acting at once cannot both win. To check that, a reviewer reads this package alone: nothing
else in ``outbox`` writes ``outbox_message`` (tests/unit/test_store_home.py greps for it). The
state table in :mod:`outbox.states` names the function behind each move.

==============  =============================================================================
module          its caller
==============  =============================================================================
application     the application: ``outbox.write``, ``outbox.cancel``, ``outbox.batch``
relay           the relay (outbox.relay)
delivery        the worker's delivery of one message (outbox.consumer)
recovery        the reconciler's jobs (outbox.reconciler), and settlement (outbox.settlement)
operator        the operator's commands and the dashboard (outbox.ops, outbox.features, failover)
processes       every process, about itself: its heartbeat, the database identity it checks
counts          ``outbox status``, the dashboard's overview, the metrics (outbox.metrics): rows
                by destination and state, the one read model they share (reads only)
sql             (what the statements share; no statement of its own)
==============  =============================================================================

==================================  ==============================  =============================
statement                           move                            called by
==================================  ==============================  =============================
``application.insert``              (none) -> pending               ``outbox.write``
``application.cancel_by_key``       pending/dispatched -> cancelled ``outbox.cancel``
``application.insert_batch``        (a batch: ``outbox_batch``)     ``outbox.batch``
``application.insert_member``       (none) -> pending, in a batch   ``outbox.write(batch=)``
``recovery.finish_batch``           (a batch's then/catch row)      reconciler (batches)
``recovery.strip_batches``          (a finished batch's payloads)   reconciler (purge)
``recovery.drop_batches``           (a finished batch, at horizon)  reconciler (purge)
``relay.dispatch_due``              pending -> dispatched           relay (a batch)
``relay.dispatch_window``           pending -> dispatched           relay (a limited destination)
``relay.undispatch``                dispatched -> pending           relay (Redis refused)
``delivery.claim``                  pending/dispatched -> in_flight consumer
``delivery.claim_group``            pending/dispatched -> in_flight consumer (a fetch's rows at once)
``delivery.record``                 in_flight/unknown -> any        consumer (the outcome, next steps)
``delivery.release``                in_flight/unknown -> pending    consumer (no call was made)
``delivery.fail_unhandled``         pending/dispatched -> failed    consumer (no handler)
``recovery.expire_leases``          in_flight -> unknown            reconciler
``recovery.settle_unknown``         unknown -> sent/pending/failed  reconciler (a lookup)
``recovery.defer_unknown``          unknown (asked again later)     reconciler
``recovery.park_unknown``           unknown (waits for a human)     reconciler
``recovery.park_past_key_ttl``      unknown (waits for a human)     reconciler
``recovery.requeue``                dispatched -> pending           reconciler (message lost)
``recovery.fail_past_deadline``     pending/dispatched -> failed    reconciler (held back; ->
                                                                    unknown if it may have charged)
``recovery.write_next_steps``       (a sent row's next steps)       reconciler, ``outbox repair``
``recovery.clear_uncomputed``       (a sent row needs none)         reconciler
``operator.repair_found``           failed -> sent                  ``outbox repair`` (a lookup)
``operator.note_history``           (history only)                  ``outbox repair``
``recovery.purge``                  sent/cancelled -> key ledger    reconciler
``recovery.mark_alerted``           failed/unknown (alerted once)   reconciler
``operator.replay_planned``         failed -> pending               ``outbox replay``
``operator.replay_forced``          failed -> pending               ``outbox replay --force``
``operator.resolve_sent``           unknown -> sent                 ``outbox resolve --sent``
``operator.resolve_not_sent``       unknown -> pending              ``outbox resolve --not-sent``
``operator.resolve_failed``         unknown -> failed               ``outbox resolve --failed``
``operator.skip_head``              failed (its ordering key goes)  ``outbox skip``
``operator.cancel_rows``            pending/dispatched -> cancelled ``outbox cancel``
``testing.clock.elapse``            (instants only)                 tests: time passes
==================================  ==============================  =============================

The other tables: destinations, the key ledger, processes, features. Each is one statement too,
guarded where two writers may meet (a breaker's count and its probe, an episode marked once).

======================================  ==================================  ================================
statement                               writes                              called by
======================================  ==================================  ================================
``delivery.count_breaker_failure``      ``outbox_destination`` (a breaker)  consumer (outbox.breaker)
``delivery.reset_breaker``              ``outbox_destination`` (a breaker)  consumer (outbox.breaker)
``delivery.settle_breaker_probe``       ``outbox_destination`` (a breaker)  consumer (outbox.breaker)
``delivery.free_breaker_probe``         ``outbox_destination`` (a breaker)  consumer (outbox.breaker)
``delivery.close_breaker``              ``outbox_destination`` (a breaker)  consumer (outbox.breaker)
``delivery.hold_destination``           ``outbox_destination`` (a pause)    consumer (outbox.pauses)
``delivery.fence_lost_claim``           ``outbox_attempt`` (a fence)        consumer (a claim's reply lost)
``operator.pause_destination``          ``outbox_destination`` (a pause)    ``outbox pause``
``operator.resume_destination``         ``outbox_destination``              ``outbox resume``
``operator.set_limit``                  ``outbox_destination`` (a limit)    ``outbox limit D --in-flight N``
``operator.clear_limit``                ``outbox_destination`` (a limit)    ``outbox limit D --clear``
``operator.limits``                     nothing (reads the limits)          ``outbox limit``
``delivery.held_by_limit``              nothing (reads a limit)             consumer (outbox.limits)
``relay.limited_destinations``          nothing (reads limits, locks)       relay (outbox.windows)
``processes.in_flight_limited``         nothing (reads limits)              worker (outbox.wakes)
``recovery.mark_destination_alerted``   ``outbox_destination`` (alerted)    reconciler (held)
``recovery.clear_destination_alert``    ``outbox_destination`` (alerted)    reconciler (held)
``recovery.drop_ledger``                ``outbox_key_ledger``               reconciler (purge)
``recovery.count_no_consumer_episode``  ``outbox_no_consumer``              reconciler (no_consumer)
``recovery.end_no_consumer_episodes``   ``outbox_no_consumer``              reconciler (no_consumer)
``recovery.mark_no_consumer_alerted``   ``outbox_no_consumer``              reconciler (no_consumer)
``recovery.purge_heartbeats``           ``outbox_process``                  reconciler (no_consumer)
``processes.beat``                      ``outbox_process``                  every process (outbox.heartbeat)
``processes.stopped``                   ``outbox_process``                  every process (outbox.heartbeat)
``processes.record_identity``           ``outbox_db_identity``              every process (outbox.failover)
``processes.note_identity_mismatch``    ``outbox_db_identity``              every process (outbox.failover)
``operator.accept_identity``            ``outbox_db_identity``              ``outbox failover --accept``
``operator.enable_feature``             ``outbox_feature``                  ``outbox features enable``
``operator.set_floor``                  ``outbox_schema_floor``             ``outbox features enable``
``operator.drop_floor``                 ``outbox_schema_floor``             ``outbox features enable``
``operator.end_dashboard_session``      ``outbox_dashboard_session_end``    the dashboard's sign-out
``counts.rows_by_destination``          nothing (rows by destination and    ``outbox status`` (exact), the
                                        state, their oldest's age)          dashboard (estimates above a
                                                                            size), the reconciler (metrics)
``counts.exact_sql``                    nothing (the exact statement)       ``rows_by_destination``, metrics
======================================  ==================================  ================================

Connections: the application's moves take the caller's SQLAlchemy ``Session``/``Connection``
(the caller owns the transaction: nothing here commits), as do the operator's; the relay's,
the consumer's and the reconciler's take psycopg connections, in autocommit mode unless said.

One clock: every instant these statements compare is computed in SQL from the database's clock.
Python passes intervals (a lease, a backoff, a wait before the first lookup), never a timestamp
of its own; only the application's own ``available_at``/``deadline`` come from outside.
"""

from . import application, counts, delivery, operator, processes, recovery, relay, sql

__all__ = ["application", "counts", "delivery", "operator", "processes", "recovery", "relay", "sql"]
