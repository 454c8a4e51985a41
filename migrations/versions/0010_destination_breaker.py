"""The circuit breaker of each destination, on its ``outbox_destination`` row.

``breaker_failures`` counts the consecutive "not processed" outcomes (connect error, 429, 503)
since ``breaker_window_at``; the breaker is open while ``breaker_opened_at`` is set: no claim
before ``breaker_open_until``, then one probe (``breaker_probe_token``, reserved by the claim that
carries it until ``breaker_probe_until``). ``pause_alerted_at`` / ``breaker_alerted_at``: when the
reconciler alerted the current episode. Added columns only (nullable or with a constant
default: no table rewrite); the previous release never reads them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION, UUID

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_TABLE = "outbox_destination"


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.add_column(_TABLE, sa.Column("breaker_failures", sa.Integer(), nullable=False, server_default="0"))
    op.add_column(_TABLE, sa.Column("breaker_window_at", tz, nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_opened_at", tz, nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_open_until", tz, nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_open_seconds", DOUBLE_PRECISION(), nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_probe_token", UUID(as_uuid=True), nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_probe_until", tz, nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_probes", sa.Integer(), nullable=False, server_default="0"))
    op.add_column(_TABLE, sa.Column("breaker_reason", sa.Text(), nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_trips", sa.Integer(), nullable=False, server_default="0"))
    op.add_column(_TABLE, sa.Column("breaker_closed_at", tz, nullable=True))
    # The episode's start: a trip soon after a close continues it (outbox.pauses.EPISODE_GAP_SECONDS).
    op.add_column(_TABLE, sa.Column("breaker_since", tz, nullable=True))
    # When the reconciler alerted the current pause / breaker episode (once per episode).
    op.add_column(_TABLE, sa.Column("pause_alerted_at", tz, nullable=True))
    op.add_column(_TABLE, sa.Column("breaker_alerted_at", tz, nullable=True))
    op.create_check_constraint(
        "outbox_destination_breaker_check",
        _TABLE,
        "breaker_opened_at IS NULL OR (breaker_open_until IS NOT NULL AND breaker_open_seconds > 0)",
    )


def downgrade() -> None:
    op.drop_constraint("outbox_destination_breaker_check", _TABLE, type_="check")
    for column in (
        "breaker_alerted_at",
        "pause_alerted_at",
        "breaker_since",
        "breaker_closed_at",
        "breaker_trips",
        "breaker_reason",
        "breaker_probes",
        "breaker_probe_until",
        "breaker_probe_token",
        "breaker_open_seconds",
        "breaker_open_until",
        "breaker_opened_at",
        "breaker_window_at",
        "breaker_failures",
    ):
        op.drop_column(_TABLE, column)
