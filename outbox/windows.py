"""Priority, fairness and the dispatch window: the order in which the relay publishes a limited
destination's rows.

A destination with a limit (outbox.limits) is served at the limit's pace, so its backlog waits
somewhere. Left in one Redis list it would be served first in, first out: a tenant that wrote
5,000 rows would hold every other tenant's rows behind them for as long as they take. So the
relay keeps such a destination's backlog in PostgreSQL and publishes its rows only while the
destination has fewer than its *window* of rows published and not settled (``dispatched`` or
``in_flight``): enough to keep its limit busy between two takes, few enough that a row taken now
is called soon. Each take fills the window in this order:

1. **priority**, highest first (``high`` 1, ``normal`` 0, ``low`` -1);
2. **fairness key**, in turns: the oldest due row of each key, then the second of each, ...;
3. the row's due time (``available_at``), then its id.

Starvation: a row's priority rises one class for each :data:`PRIORITY_AGING_SECONDS` it has been
due, so a stream of high rows delays a low row by at most twice that, never forever; within a
priority, each turn serves every key with a due row before any key's next row, oldest head
first, so a key waits at most as many rows as there are keys ahead of it.

Ordering keys (outbox.ordering) still hold: a row behind its key's head is not taken, whatever
its priority. A destination without a limit has no window: every due row is published at once,
in due order, and priority and fairness have nothing to reorder (give it an in-flight limit
above what it ever reaches to have them act). Who moves a row out of ``pending``: the relay's
take, as for every row.
"""

from __future__ import annotations

import math

from .exceptions import InvalidMessage

HIGH, NORMAL, LOW = "high", "normal", "low"

#: The priorities ``outbox.write`` accepts and the value stored for each (``priority`` column).
PRIORITIES = {HIGH: 1, NORMAL: 0, LOW: -1}

#: Migration 0025's CHECK: a fairness key is 1 to 200 characters.
MAX_FAIRNESS_KEY_LENGTH = 200

#: A due row's priority rises one class per this many seconds it has waited (see above).
PRIORITY_AGING_SECONDS = 60.0

#: A paced destination's window holds this many seconds of calls at its rate: up to a second is
#: booked ahead by the claims (settings.PACE_AHEAD_SECONDS), the rest covers the relay's refill.
WINDOW_SECONDS = 1.5

#: An in-flight limit's window: this many rows per call it allows (one calling, the others
#: published and ready for the next free place).
WINDOW_PER_CALL = 4

#: The most fairness keys of one priority a take visits: keys with nothing due (rows due later, a
#: retry's backoff) are passed over, and this bounds what passing over them costs a take.
MAX_KEYS_VISITED = 256

#: How often the relay refills a window while the destination has rows waiting for it (s).
REFILL_SECONDS = 0.1

#: How long the relay keeps the set of limited destinations before reading it again (s): a limit
#: set or cleared with ``outbox limit`` reaches the relay's take within this.
LIMITS_REFRESH_SECONDS = 1.0


def priority_rank(priority: object) -> int:
    """The stored value of ``priority`` (a name of :data:`PRIORITIES`); InvalidMessage otherwise."""
    if isinstance(priority, str) and priority in PRIORITIES:
        return PRIORITIES[priority]
    raise InvalidMessage(f"priority must be one of 'high', 'normal', 'low', got {priority!r}")


def window_size(
    in_flight: int | None, per_second: float | None, settled_per_second: float = 0.0
) -> int | None:
    """How many rows of a destination with these limits (the ones in force: the operator's, else
    the lowest a live process declares) may be published and not settled at once; None: no limit,
    no window. The smaller of the two kinds' windows, at least 1.

    ``settled_per_second``: how fast its published rows have been settling (over the last
    second, as the relay saw it between its takes). An in-flight limit says how many calls at
    once, not how many a second: with fast calls, 4 per call refilled every 0.1 s would cap the
    destination at 40 calls a second per call allowed. So its window also holds
    :data:`WINDOW_SECONDS` of what the destination settles: as much as its calls get through,
    and no more while they do not."""
    sizes = []
    if in_flight is not None:
        sizes.append(max(in_flight * WINDOW_PER_CALL, math.ceil(settled_per_second * WINDOW_SECONDS)))
    if per_second is not None:
        sizes.append(math.ceil(per_second * WINDOW_SECONDS))
    if not sizes:
        return None
    return max(1, min(sizes))
