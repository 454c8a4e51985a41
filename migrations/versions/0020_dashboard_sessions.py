"""Dashboard sessions ended before they expired: the session is a signed cookie, so a
sign-out, to be worth anything against a copied cookie, is recorded here and every request checks
it (one primary-key probe). A row is kept until the session would have expired anyway.

A new table: the previous release never reads it, and creating it locks nothing live.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "outbox_dashboard_session_end",
        sa.Column("sid", sa.Text(), primary_key=True),
        sa.Column("ended_at", tz, nullable=False, server_default=sa.text("now()")),
        sa.Column("expires_at", tz, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("outbox_dashboard_session_end")
