"""The claim takes ready tasks whose ``run_at`` has come (in a running queue) directly:
an index of ready work by queue and due time, so it finds them without walking the
future ones.

Revision ID: 0006_due_claim
Revises: 0006_speed
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0006_due_claim"
down_revision = "0006_speed"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_tasks_ready_due ON core.tasks (queue, run_at) WHERE state = 'ready'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX core.ix_tasks_ready_due")
