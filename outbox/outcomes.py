"""What an attempt row's outcome says about the provider, and when an ambiguous call counts as
settled.

Every claim leaves one ``outbox_attempt`` row. Its ``outcome`` falls in one of three kinds:

* **safe** — the call certainly did not take effect: ``retry`` (connect error, 429/503, …),
  ``failed`` (the provider refused it, or no call was made: deadline passed, attempts exhausted
  after a certain failure) and ``released`` (the claim gave the row back before calling);
* **confirmed** — the provider confirmed the effect: ``sent``;
* **ambiguous** — everything else: ``unknown`` (read timeout, dropped connection, 5xx, time
  limit, a handler bug), ``lease_expired`` (the worker died or overran), no outcome at all (a
  claim that never recorded), and any outcome this version does not know.

A claim whose reply was lost before it committed gets its fence row from the worker's recovery
instead (``store.delivery.fence_lost_claim``): attempt number 0 (a committed claim's is 1 or
more), outcome ``released``, the claim's token, so that the claim can never commit. Every claim
sent still leaves one row; this one made no call, so readers that count committed claims or
calls leave it out (:func:`is_fence_sql`), and a release that does not know it still reads it as
safe.

``superseded:X`` (a late worker whose row had been taken over) has the kind of ``X``. The list
of *safe* outcomes is closed on purpose: a new outcome is ambiguous until someone decides it is
not, so the mistake it can cause is a refused replay, never a second charge.

An ambiguous call is **settled** (known not to have taken effect) only by

* ``lookup_not_found`` — the destination's lookup found no record while every call that may
  have taken effect was younger than the destination's ``key_ttl`` (the reconciler writes it in
  the statement that moves the row out of ``unknown``, and parks the row for a human instead
  when a call is older);
* ``operator_not_sent`` — ``outbox resolve ID --not-sent``.

Two more marks are not settlements: ``operator_forced`` (``outbox replay ID --force --reason``:
an operator took the risk of that call on record) and ``idempotent_retry`` (the destination is
declared idempotent and was called again inside its ``key_ttl``; the provider's deduplication
covers that call, but not a replay later). A confirmed call is never settled by a lookup: only
``operator_forced`` clears it.
"""

from __future__ import annotations

#: Outcomes of a call that certainly did not take effect.
SAFE_OUTCOMES = ("retry", "failed", "released")
#: Outcomes of a call the provider confirmed.
CONFIRMED_OUTCOMES = ("sent",)

LOOKUP_NOT_FOUND = "lookup_not_found"
OPERATOR_NOT_SENT = "operator_not_sent"
OPERATOR_FORCED = "operator_forced"
IDEMPOTENT_RETRY = "idempotent_retry"
#: Every value of ``outbox_attempt.settled`` (a CHECK constraint holds the column to these).
SETTLED_VALUES = (LOOKUP_NOT_FOUND, OPERATOR_NOT_SENT, OPERATOR_FORCED, IDEMPOTENT_RETRY)
#: Marks that make an ambiguous call harmless for a replay.
SETTLEMENTS = (LOOKUP_NOT_FOUND, OPERATOR_NOT_SENT)


#: The attempt number of a fence row (see above): claims count from 1.
FENCE_ATTEMPT = 0


def is_fence_sql(alias: str) -> str:
    """True for the fence row of a lost claim that never committed: no call."""
    return f"{alias}.attempt = {FENCE_ATTEMPT}"


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def bare_outcome_sql(alias: str) -> str:
    """The outcome without its ``superseded:`` prefix, '' when none was recorded."""
    return f"regexp_replace(COALESCE({alias}.outcome, ''), '^superseded:', '')"


def is_confirmed_sql(alias: str) -> str:
    return f"({bare_outcome_sql(alias)} IN ({_quoted(CONFIRMED_OUTCOMES)}))"


def is_ambiguous_sql(alias: str) -> str:
    return f"({bare_outcome_sql(alias)} NOT IN ({_quoted(SAFE_OUTCOMES + CONFIRMED_OUTCOMES)}))"


def blocks_replay_sql(alias: str) -> str:
    """True for an attempt row that forbids a replay without ``--force``: a confirmed call not
    forced over, or an ambiguous call neither settled nor forced over."""
    return (
        f"(({is_confirmed_sql(alias)} AND {alias}.settled IS DISTINCT FROM '{OPERATOR_FORCED}')"
        f" OR ({is_ambiguous_sql(alias)} AND ({alias}.settled IS NULL OR {alias}.settled NOT IN "
        f"({_quoted((*SETTLEMENTS, OPERATOR_FORCED))}))))"
    )


def may_have_taken_effect_sql(alias: str) -> str:
    """True for a call whose effect the provider may hold: what a lookup must still be able to
    see (its age is compared with ``key_ttl``). A call an operator forced over is on record as
    an accepted risk and no longer counts."""
    return (
        f"({is_confirmed_sql(alias)} OR ({is_ambiguous_sql(alias)} AND ({alias}.settled IS NULL "
        f"OR {alias}.settled NOT IN ({_quoted((*SETTLEMENTS, OPERATOR_FORCED))}))))"
    )


def known_not_taken_effect_sql(alias: str) -> str:
    """True for a call known not to have taken effect: a safe outcome, or an ambiguous call a
    lookup or an operator settled. What lets an operator cancel a row that was claimed before
    (``outbox cancel``): a confirmed call, an unsettled ambiguous one, and one only forced over
    (an accepted risk, not a settlement) may have charged."""
    return (
        f"({bare_outcome_sql(alias)} IN ({_quoted(SAFE_OUTCOMES)}) OR ({is_ambiguous_sql(alias)} "
        f"AND {alias}.settled IS NOT NULL AND {alias}.settled IN ({_quoted(SETTLEMENTS)})))"
    )


def unsettled_ambiguous_sql(alias: str) -> str:
    """An ambiguous call a settlement may mark (one already settled keeps its first mark)."""
    return (
        f"({is_ambiguous_sql(alias)} AND ({alias}.settled IS NULL OR {alias}.settled = '{IDEMPOTENT_RETRY}'))"
    )


def recalled_without_settlement_sql(alias: str, later: str) -> str:
    """For ``outbox audit``: ``alias`` may have taken effect, and ``later`` is a newer call of the
    same row made without a settlement (or an operator's force, or idempotency) in between."""
    covered = (
        f"({alias}.settled_at IS NOT NULL AND {alias}.settled_at <= {later}.started_at AND "
        f"(({is_ambiguous_sql(alias)}) OR {alias}.settled = '{OPERATOR_FORCED}'))"
    )
    # Two confirmed calls are already their own violation (confirmed more than once).
    both_confirmed = f"({is_confirmed_sql(alias)} AND {is_confirmed_sql(later)})"
    return (
        f"({is_confirmed_sql(alias)} OR {is_ambiguous_sql(alias)}) AND NOT {covered} "
        f"AND NOT {both_confirmed} AND NOT {is_fence_sql(later)} "
        f"AND ({later}.started_at, {later}.id) > ({alias}.started_at, {alias}.id)"
    )


def operator_failed_unknown_sql(message: str) -> str:
    """True when an operator moved the row from ``unknown`` to ``failed`` (``resolve --failed``)
    and no forced replay or forced repair came after: the operator gave up on an outcome nobody
    knows, and only another operator, by name and with a reason, overrules that."""
    return f"""EXISTS (
        SELECT 1 FROM jsonb_array_elements({message}.history) WITH ORDINALITY AS h(e, n)
        WHERE h.e->>'action' = 'resolve' AND h.e->>'from' = 'unknown' AND h.e->>'to' = 'failed'
          AND NOT EXISTS (
              SELECT 1 FROM jsonb_array_elements({message}.history) WITH ORDINALITY AS f(e, k)
              WHERE f.k > h.n AND f.e->>'action' IN ('replay', 'repair') AND f.e->>'forced' = 'true'))"""
