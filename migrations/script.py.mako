"""${message}

Expand/contract (docs/production.md#upgrades-and-outbox-migrate): the previous release keeps
running on this revision during a deploy. Add, never drop or tighten what it uses; build an
index on an existing table with outbox.migrations.helpers.create_index_concurrently. A revision
that removes what older code needs calls outbox.migrations.helpers.require_code_from. The
revision id is the next number (``--rev-id``): the code orders revisions by it.

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
