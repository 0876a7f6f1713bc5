"""A principal can be disabled (``core.principals.disabled_at``, ``disabled_by``): when
someone leaves, an admin disables their name, and while it is disabled their tokens,
their JWTs and sessions, the submissions services make on their behalf (cron's fires,
a workflow's nodes) and their subscriptions' webhooks are refused; enabling the name
again restores them. Every principal starts enabled.

Revision ID: 0039_principal_disabled
Revises: 0038_retired_teams
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0039_principal_disabled"
down_revision = "0038_retired_teams"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE core.principals ADD COLUMN disabled_at TIMESTAMPTZ,"
        " ADD COLUMN disabled_by TEXT"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE core.principals DROP COLUMN disabled_by, DROP COLUMN disabled_at")
