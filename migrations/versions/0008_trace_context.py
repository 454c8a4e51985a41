"""Trace context on the row: ``outbox.write`` stores the writer's W3C trace context
(``traceparent``, ``tracestate``, baggage: whatever the application's OpenTelemetry propagators
inject), and the worker runs the handler in a child span of it.

Expand only: a nullable column without a default is a catalog change (no table rewrite, an
ACCESS EXCLUSIVE lock for an instant); the previous release never names it.

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


def downgrade() -> None:
    op.drop_column("outbox_message", "trace_context")
