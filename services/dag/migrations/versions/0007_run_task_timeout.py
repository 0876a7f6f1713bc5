"""A run's own default task timeout (issue 31): ``dag.runs.task_timeout_s`` fills the
``timeout_s`` of the run's node tasks that set none, over the workflow's ``task_timeout_s``.

Revision ID: 0007_run_task_timeout
Revises: 0006_resync
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0007_run_task_timeout"
down_revision = "0006_resync"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.runs ADD COLUMN task_timeout_s INTEGER;
ALTER TABLE dag.runs ADD CONSTRAINT ck_runs_task_timeout_positive
    CHECK (task_timeout_s IS NULL OR task_timeout_s > 0);
"""

DOWNGRADE = """
ALTER TABLE dag.runs DROP CONSTRAINT ck_runs_task_timeout_positive;
ALTER TABLE dag.runs DROP COLUMN task_timeout_s;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
