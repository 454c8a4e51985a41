"""Rolling deploys: the rules a take or a claim obeys hold for processes of an older
release that are still running when this revision is applied, because the database enforces them
or because a feature stays off until no such process is left.

* **Enforced** by row triggers on ``outbox_message``, each restricted by ``WHEN`` to the rows and
  moves it guards (no function runs for any other row or move). A refused move does not happen
  (a BEFORE trigger returns NULL): the statement moves nothing, what this code's own guarded
  statements do when their rule refuses, and what every release reads as "someone else moved it".

  - ``outbox_message_ordered_claim``: a claim (pending/dispatched -> in_flight) of a row of an
    ordering key while an earlier row holds the key (outbox.ordering.blocked_sql).
  - ``outbox_message_failed_stands``: out of ``failed`` (a replay, a repair, a late
    confirmation), a row an operator failed out of unknown (``resolve --failed``) moves only when
    the same statement records a forced replay or repair (outbox.outcomes); a replay of a row
    that let its ordering key go on, or whose @on_failure compensation was written, only forced.
  - ``outbox_message_payload_versions_claim``: a row with ``payload_version <> 1`` is claimed
    only once the feature ``payload_versions`` is on (below): a worker older than 0016 would
    hand the new shape to its handler. It waits, whoever's message brought it.
  - ``outbox_message_chains_unknown`` (not a refusal): a move to ``sent`` that leaves
    ``chains_known_at`` as it was comes from a release that does not set it, which may not know
    chains: the row is marked ``chain_problem = NOT_COMPUTED`` (outbox.chains; ``alerted_at``
    cleared) and the reconciler's ``chains`` job writes its steps, or only clears the mark when
    its handler has none or its step exists (a release that knows chains wrote it).

* **Gated**: ``outbox_feature`` lists the features an operator enabled (``outbox features
  enable``). The application's rows with ``payload_version <> 1``, and batches whose then/catch
  step has one, are refused (SQLSTATE OB001) until ``payload_versions`` is; a chain's next step
  or a batch's row, written by a statement that settles a row after its call, is not refused
  (that statement must not fail after a charge): it waits at its claim (above).
  Enabled here, with its floor, when nothing older can be running: no live heartbeat and no
  connection of a release before this one ("outbox-failover", held by every relay, worker and
  reconciler), or when rows already use it (the deployment relies on it already).

* ``outbox_process`` gains the schema range each process's code accepts (``schema_oldest``,
  ``schema_newest``); a beat without one is an older release's.

* A floor: code that does not know the circuit breaker (0010) no longer starts.

The SQL of the triggers is frozen here, rendered from outbox.ordering, outbox.outcomes and
outbox.chains as they stood; a later change of those rules needs a revision of its own.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.helpers import forget_code_requirement, require_code_from

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# A fence row whose call may have taken effect (outbox.outcomes.may_have_taken_effect_sql).
_MAY_HAVE_TAKEN_EFFECT = """((regexp_replace(COALESCE({a}.outcome, ''), '^superseded:', '') IN ('sent'))
     OR ((regexp_replace(COALESCE({a}.outcome, ''), '^superseded:', '')
          NOT IN ('retry', 'failed', 'released', 'sent'))
         AND ({a}.settled IS NULL
              OR {a}.settled NOT IN ('lookup_not_found', 'operator_not_sent', 'operator_forced'))))"""


def _lets_pass(row: str) -> str:
    return f"""({row}.order_skipped_at IS NOT NULL
        OR ({row}.skip_when_failed AND NOT EXISTS (
            SELECT 1 FROM outbox_attempt {row}_a
            WHERE {row}_a.message_id = {row}.id AND {_MAY_HAVE_TAKEN_EFFECT.format(a=f"{row}_a")})))"""


_ORDERED_CLAIM = f"""
CREATE OR REPLACE FUNCTION outbox_message_ordered_claim() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM outbox_message e
        WHERE e.ordering_key = NEW.ordering_key AND e.id < NEW.id
          AND e.state NOT IN ('sent', 'cancelled')
          AND (e.state IN ('pending', 'dispatched', 'in_flight', 'unknown')
               OR (e.state = 'failed' AND NOT {_lets_pass("e")}))
    ) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
"""

_FAILED_STANDS = f"""
CREATE OR REPLACE FUNCTION outbox_message_failed_stands() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    -- The statement appended an entry that says forced (never NULL: NOT NULL is no refusal).
    forced boolean := COALESCE(jsonb_array_length(COALESCE(NEW.history, '[]'::jsonb))
                                   > jsonb_array_length(COALESCE(OLD.history, '[]'::jsonb))
                               AND NEW.history -> -1 ->> 'forced' = 'true', false);
BEGIN
    IF EXISTS (
        SELECT 1 FROM jsonb_array_elements(COALESCE(NEW.history, '[]'::jsonb)) WITH ORDINALITY AS h(e, n)
        WHERE h.e->>'action' = 'resolve' AND h.e->>'from' = 'unknown' AND h.e->>'to' = 'failed'
          AND NOT EXISTS (
              SELECT 1 FROM jsonb_array_elements(NEW.history) WITH ORDINALITY AS f(e, k)
              WHERE f.k > h.n AND f.e->>'action' IN ('replay', 'repair') AND f.e->>'forced' = 'true')
    ) THEN
        RETURN NULL;
    END IF;
    IF NEW.state IN ('pending', 'dispatched') AND NOT forced THEN
        IF EXISTS (SELECT 1 FROM outbox_message c
                   WHERE c.key = OLD.key AND c.parent_id = OLD.id AND c.via = 'on_failure')
           OR EXISTS (SELECT 1 FROM outbox_key_ledger c
                      WHERE c.key = OLD.key AND c.parent_id = OLD.id AND c.via = 'on_failure') THEN
            RETURN NULL;
        END IF;
        IF OLD.ordering_key IS NOT NULL AND ({_lets_pass("OLD")}
            OR EXISTS (SELECT 1 FROM outbox_message p
                       WHERE p.ordering_key = OLD.ordering_key AND p.id > OLD.id
                         AND (p.state IN ('in_flight', 'unknown', 'sent', 'failed')
                              OR (p.state <> 'cancelled' AND p.attempts > 0)))) THEN
            RETURN NULL;
        END IF;
    END IF;
    RETURN NEW;
END
$$
"""

# outbox.chains.NOT_COMPUTED: the reconciler's chains job computes and writes the row's then
# steps with its handler module, or clears the mark when the settling code wrote them already.
# Assignments only, no query: it runs at every settle of an older release, and a query in a
# trigger runs on a generic plan, which on a table grown since its statistics can read every sent
# row (an UPDATE by id in an AFTER trigger costs tens of ms per row with thousands marked:
# docs/decisions/hot-path-costs.md). alerted_at
# goes: a row alerted while unknown must be picked up by the chains job, which only takes rows not
# alerted yet (an older `resolve --sent` leaves it set).
_CHAINS_UNKNOWN = """
CREATE OR REPLACE FUNCTION outbox_message_chains_unknown() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.chain_problem := 'next steps not computed yet: settled sent by hand without the handler module';
    NEW.alerted_at := NULL;
    RETURN NEW;
END
$$
"""

# A row with a payload version is claimed only once the feature is on: until then no process is
# known to handle it (a worker before 0016 would hand it to its handler as it is). It waits
# `dispatched`, re-queued by the reconciler, whoever's message brought it.
_PAYLOAD_VERSIONS_CLAIM = """
CREATE OR REPLACE FUNCTION outbox_message_payload_versions_claim() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox_feature WHERE name = 'payload_versions') THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
"""

_PAYLOAD_VERSIONS_GATE = """
CREATE OR REPLACE FUNCTION outbox_payload_versions_gate() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    what text;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_feature WHERE name = 'payload_versions') THEN
        RETURN NEW;
    END IF;
    -- Each table's branch is planned only when it runs: NEW has one table's columns.
    IF TG_TABLE_NAME = 'outbox_batch' THEN
        what := 'batch ' || NEW.name;
    ELSE
        what := 'row ' || NEW.key || ':' || NEW.step || ' (payload_version ' || NEW.payload_version || ')';
    END IF;
    RAISE EXCEPTION 'payload versions are not enabled on this database: %', what
        USING ERRCODE = 'OB001',
              HINT = 'once no process older than revision 0016 runs: outbox features enable payload_versions';
END
$$
"""

# A batch's then/catch step stores its version only when it is not 1 (outbox.batches).
_BATCH_VERSIONED = (
    "COALESCE({r}.then_step->>'payload_version', '1') <> '1' "
    "OR COALESCE({r}.catch_step->>'payload_version', '1') <> '1'"
)

# heartbeat.LIVE as it stands: a process heard from within three of its intervals plus 5 s.
_LIVE = "stopped_at IS NULL AND last_seen_at > now() - (interval_seconds * 3 + 5) * interval '1 second'"


def upgrade() -> None:
    op.add_column("outbox_process", sa.Column("schema_oldest", sa.Text(), nullable=True))
    op.add_column("outbox_process", sa.Column("schema_newest", sa.Text(), nullable=True))
    op.create_table(
        "outbox_feature",
        sa.Column("name", sa.Text(), primary_key=True),
        sa.Column("needs_code", sa.Text(), nullable=False),
        sa.Column("enabled_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("enabled_by", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
    )
    op.execute(
        f"""
        INSERT INTO outbox_feature (name, needs_code, enabled_by, reason)
        SELECT 'payload_versions', '0016', 'migration 0022',
               CASE WHEN EXISTS (SELECT 1 FROM outbox_message WHERE payload_version <> 1)
                    THEN 'rows used it already' ELSE 'no live process at migration' END
        WHERE (NOT EXISTS (SELECT 1 FROM outbox_process WHERE {_LIVE})
               AND NOT EXISTS (SELECT 1 FROM pg_stat_activity
                               WHERE datname = current_database() AND application_name = 'outbox-failover'))
           OR EXISTS (SELECT 1 FROM outbox_message WHERE payload_version <> 1)
           OR EXISTS (SELECT 1 FROM outbox_batch b WHERE {_BATCH_VERSIONED.format(r="b")})
        """
    )
    # Enabled, the feature raises the floor as `outbox features enable` does: code before 0016
    # no longer starts here.
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT EXISTS (SELECT 1 FROM outbox_feature)")).scalar():
        require_code_from(op, "0016", migration="feature:payload_versions")
    op.execute(_ORDERED_CLAIM)
    op.execute(
        """
        CREATE TRIGGER outbox_message_ordered_claim
        BEFORE UPDATE ON outbox_message
        FOR EACH ROW WHEN (
            NEW.ordering_key IS NOT NULL AND NEW.state = 'in_flight'
            AND OLD.state IN ('pending', 'dispatched'))
        EXECUTE FUNCTION outbox_message_ordered_claim()
        """
    )
    op.execute(_FAILED_STANDS)
    op.execute(
        """
        CREATE TRIGGER outbox_message_failed_stands
        BEFORE UPDATE ON outbox_message
        FOR EACH ROW WHEN (OLD.state = 'failed' AND NEW.state IN ('pending', 'dispatched', 'sent'))
        EXECUTE FUNCTION outbox_message_failed_stands()
        """
    )
    op.add_column("outbox_message", sa.Column("chains_known_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(_CHAINS_UNKNOWN)
    op.execute(
        """
        CREATE TRIGGER outbox_message_chains_unknown
        BEFORE UPDATE ON outbox_message
        FOR EACH ROW WHEN (
            NEW.state = 'sent' AND OLD.state IS DISTINCT FROM 'sent' AND NEW.chain_problem IS NULL
            AND NEW.chains_known_at IS NOT DISTINCT FROM OLD.chains_known_at)
        EXECUTE FUNCTION outbox_message_chains_unknown()
        """
    )
    op.execute(_PAYLOAD_VERSIONS_CLAIM)
    op.execute(
        """
        CREATE TRIGGER outbox_message_payload_versions_claim
        BEFORE UPDATE ON outbox_message
        FOR EACH ROW WHEN (
            NEW.payload_version <> 1 AND NEW.state = 'in_flight' AND OLD.state IN ('pending', 'dispatched'))
        EXECUTE FUNCTION outbox_message_payload_versions_claim()
        """
    )
    # The application's own rows only: a chain's next step or a batch's row is written by the
    # statement that settles a row (any release's), which must never fail after a charge; such a
    # row waits at its claim instead.
    op.execute(_PAYLOAD_VERSIONS_GATE)
    op.execute(
        """
        CREATE TRIGGER outbox_message_payload_versions_gate
        BEFORE INSERT OR UPDATE OF payload_version ON outbox_message
        FOR EACH ROW WHEN (NEW.payload_version <> 1 AND NEW.parent_id IS NULL AND NEW.via IS NULL)
        EXECUTE FUNCTION outbox_payload_versions_gate()
        """
    )
    op.execute(
        f"""
        CREATE TRIGGER outbox_batch_payload_versions_gate
        BEFORE INSERT ON outbox_batch
        FOR EACH ROW WHEN ({_BATCH_VERSIONED.format(r="NEW")})
        EXECUTE FUNCTION outbox_payload_versions_gate()
        """
    )
    require_code_from(op, "0010", migration="0022")


def downgrade() -> None:
    forget_code_requirement(op, migration="0022")
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT to_regclass('outbox_schema_floor') IS NOT NULL")).scalar():
        bind.execute(sa.text("DELETE FROM outbox_schema_floor WHERE migration LIKE 'feature:%'"))
        # Created by this revision's requirement unless an earlier contract made it: empty, it
        # goes, as before it (no table: no requirement).
        if not bind.execute(sa.text("SELECT EXISTS (SELECT 1 FROM outbox_schema_floor)")).scalar():
            op.execute("DROP TABLE outbox_schema_floor")
    op.execute("DROP TRIGGER IF EXISTS outbox_batch_payload_versions_gate ON outbox_batch")
    for name in (
        "payload_versions_gate",
        "payload_versions_claim",
        "chains_unknown",
        "failed_stands",
        "ordered_claim",
    ):
        op.execute(f"DROP TRIGGER IF EXISTS outbox_message_{name} ON outbox_message")
    for name in (
        "outbox_payload_versions_gate",
        "outbox_message_payload_versions_claim",
        "outbox_message_chains_unknown",
        "outbox_message_failed_stands",
        "outbox_message_ordered_claim",
    ):
        op.execute(f"DROP FUNCTION IF EXISTS {name}()")
    op.drop_column("outbox_message", "chains_known_at")
    op.drop_table("outbox_feature")
    op.drop_column("outbox_process", "schema_newest")
    op.drop_column("outbox_process", "schema_oldest")
