"""Trace context on the row and its first publication (issue 12).

``trace_context``: ``outbox.write`` stores the writer's W3C trace context (``traceparent``,
``tracestate``, baggage: whatever the application's OpenTelemetry propagators inject), and the
worker runs the handler in a child span of it.

``first_dispatched_at``: when the relay first published the row, so that the written ->
published histogram counts each row once (a re-publication after a lost message, a release or a
replay is not the relay's lag). Rows stored before this revision have none: each is counted at
its next publication, once.

Expand only: nullable columns without a default are a catalog change (no table rewrite, an
ACCESS EXCLUSIVE lock for an instant); the previous release never names them.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox_message", sa.Column("trace_context", postgresql.JSONB(), nullable=True))
    op.add_column(
        "outbox_message", sa.Column("first_dispatched_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("outbox_message", "first_dispatched_at")
    op.drop_column("outbox_message", "trace_context")
