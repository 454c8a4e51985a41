"""The row states of ``outbox_message`` and who moves a row out of each.

==============  ==========================================================  =====================
state           meaning                                                     moved out by
==============  ==========================================================  =====================
``pending``     committed, waiting to be published (or retried at           relay
                ``available_at``)
``dispatched``  published to the broker, not yet claimed                    consumer claim;
                                                                            reconciler re-queues
``in_flight``   claimed; the external call may be under way                 consumer; reconciler
                                                                            when the lease expires
``unknown``     the call may or may not have taken effect                   reconciler lookup;
                                                                            ``outbox resolve``
``sent``        confirmed, ``provider_ref`` stored                          terminal (purged)
``failed``      permanent error, attempts or deadline exhausted             ``outbox replay``
``cancelled``   cancelled by the application before any claim               terminal (purged)
==============  ==========================================================  =====================
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
