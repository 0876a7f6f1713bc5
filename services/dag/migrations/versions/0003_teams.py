"""Team-owned workflows and their runs: members of the team see and act on them, and
the runs' tasks are owned by the team (docs/dag.md).

Revision ID: 0003_teams
Revises: 0002_faults
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0003_teams"
down_revision = "0002_faults"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.workflows ADD COLUMN team TEXT;
CREATE INDEX ix_workflows_team ON dag.workflows (team) WHERE team IS NOT NULL;
ALTER TABLE dag.runs ADD COLUMN team TEXT;
CREATE INDEX ix_runs_team_id ON dag.runs (team, id) WHERE team IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX dag.ix_runs_team_id;
ALTER TABLE dag.runs DROP COLUMN team;
DROP INDEX dag.ix_workflows_team;
ALTER TABLE dag.workflows DROP COLUMN team;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
