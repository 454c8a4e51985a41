"""A new row's step holds no ':': the provider's Idempotency-Key is
``key:step``, and a ':' in the step lets two rows send one key. outbox.write refuses it before
the database; this CHECK holds writers that insert with plain SQL to the same rule.

Rows stored before this revision keep their step: the constraint exempts every id up to the
highest one at upgrade time. ``NOT VALID`` alone would not do: PostgreSQL checks a NOT VALID
constraint on every later UPDATE of an old row too, so the relay's first state change of an
old ``refund:2`` row would fail. The bound is read under a lock that keeps inserts out until
the constraint exists, and NOT VALID skips a scan that could only confirm the exemption.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

NAME = "outbox_message_step_colon_check"


def upgrade() -> None:
    # SHARE ROW EXCLUSIVE: no insert between reading the bound and adding the constraint (the
    # ALTER below takes ACCESS EXCLUSIVE anyway, for an instant).
    op.execute("LOCK TABLE outbox_message IN SHARE ROW EXCLUSIVE MODE")
    top = op.get_bind().execute(sa.text("SELECT COALESCE(max(id), 0) FROM outbox_message")).scalar_one()
    # An int from the database, not user input: formatted into DDL, which takes no parameters.
    op.execute(
        f"ALTER TABLE outbox_message ADD CONSTRAINT {NAME} "
        f"CHECK (strpos(step, ':') = 0 OR id <= {int(top)}) NOT VALID"
    )


def downgrade() -> None:
    op.execute(f"ALTER TABLE outbox_message DROP CONSTRAINT IF EXISTS {NAME}")
