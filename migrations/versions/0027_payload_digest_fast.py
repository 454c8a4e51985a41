"""The ledger's payload digest without rebuilding the payload when nothing in it needs trimming.

``outbox_payload_digest(payload)`` hashes the jsonb's text after ``outbox_jsonb_normal`` trims
every number's trailing zeros (jsonb equality compares 10 and 10.0 as equal, its text does not).
That normalisation rebuilds the whole value, recursively, in SQL, and the purge spent most of
its CPU in it (docs/decisions). A number needs trimming only when its text has a fractional
part ending in 0 (``1.50``, ``10.0``): jsonb prints numbers without exponents, so when no
``.digits0`` followed by a non-digit appears anywhere in the text (a string holding one only
sends that payload the slow way), the normal form's text is the text itself and is hashed as
it is. Same digest for every payload, so processes of every release may call it during a
rolling deploy, and the ledger's existing hashes stay valid.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

FAST = r"""
CREATE OR REPLACE FUNCTION outbox_payload_digest(payload jsonb) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT sha256(convert_to(
    CASE WHEN payload::text ~ '\.[0-9]*0([^0-9]|$)' THEN outbox_jsonb_normal(payload)::text
         ELSE payload::text END,
    'UTF8'))
$$
"""

SLOW = """
CREATE OR REPLACE FUNCTION outbox_payload_digest(payload jsonb) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT sha256(convert_to(outbox_jsonb_normal(payload)::text, 'UTF8'))
$$
"""


def upgrade() -> None:
    op.execute(FAST)


def downgrade() -> None:
    op.execute(SLOW)
