"""Operations for revisions that run while the previous release is still serving (expand/contract).

A deploy runs ``outbox migrate`` first, then rolls the code: for a while both releases run on the
new schema. So a revision *expands* (adds a table, a nullable column, an index) and the previous
code, which ignores what it does not know, keeps working; outbox.migrate tolerates a revision
newer than it knows. Removing or tightening what an older release still uses is a *contract*
revision, shipped a release later, which states the oldest code it allows with
:func:`require_code_from`; older code then refuses to start with one line naming that revision.

    from outbox.migrations.helpers import create_index_concurrently, require_code_from
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outbox.migrate import FLOOR_TABLE


def create_index_concurrently(
    op: Any, name: str, table: str, columns: Sequence[str | sa.TextClause], **kw: Any
) -> None:
    """``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` on a live table: a plain CREATE INDEX holds a
    SHARE lock, which stops every insert and state change for as long as the build takes.

    CONCURRENTLY cannot run in a transaction: Alembic commits what the run did so far and builds
    the index outside one. A build that fails leaves an INVALID index behind; IF NOT EXISTS would
    then keep it, so it is dropped first (CONCURRENTLY too). Keyword arguments go to
    ``op.create_index`` (``unique``, ``postgresql_where``, …)."""
    with op.get_context().autocommit_block():
        invalid = op.get_bind().execute(
            sa.text(
                "SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE c.relname = :name AND NOT i.indisvalid"
            ),
            {"name": name},
        )
        if invalid.first() is not None:
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
        op.create_index(name, table, list(columns), postgresql_concurrently=True, if_not_exists=True, **kw)


def drop_index_concurrently(op: Any, name: str, table: str) -> None:
    """The downgrade of :func:`create_index_concurrently`."""
    with op.get_context().autocommit_block():
        op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)


def require_code_from(op: Any, code_revision: str, *, migration: str) -> None:
    """Record that, from this revision on, only code that knows ``code_revision`` may run: code
    whose newest revision is older refuses with "the database needs outbox code from revision
    <code_revision>; this is <its head>". ``migration`` is the calling revision's id; its
    downgrade calls :func:`forget_code_requirement` with it. The table appears on first use (no
    table: no requirement, what every release before this helper expects)."""
    op.execute(
        f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} ("
        "migration text PRIMARY KEY, needs_code text NOT NULL, "
        "recorded_at timestamptz NOT NULL DEFAULT now())"
    )
    op.get_bind().execute(
        sa.text(
            f"INSERT INTO {FLOOR_TABLE} (migration, needs_code) VALUES (:m, :c) "
            "ON CONFLICT (migration) DO UPDATE SET needs_code = excluded.needs_code"
        ),
        {"m": migration, "c": code_revision},
    )


def forget_code_requirement(op: Any, *, migration: str) -> None:
    """The downgrade of :func:`require_code_from`."""
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": FLOOR_TABLE}).scalar():
        bind.execute(sa.text(f"DELETE FROM {FLOOR_TABLE} WHERE migration = :m"), {"m": migration})
