"""Attempts keep the outputs their task wrote (the ``CAIRN_OUTPUTS`` file, sent with the
report), for the DAG service to hand to downstream nodes.

Revision ID: 0005_data
Revises: 0004_teams2
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0005_data"
down_revision = "0004_teams2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE core.attempts ADD COLUMN outputs JSONB")


def downgrade() -> None:
    op.execute("ALTER TABLE core.attempts DROP COLUMN outputs")
