"""Team-owned schedules: members of the team see and act on them, and their fires'
tasks are owned by the team (docs/cron.md).

Revision ID: cron_0003_teams
Revises: cron_0002_faults
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "cron_0003_teams"
down_revision = "cron_0002_faults"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE cron.schedules ADD COLUMN team TEXT;
CREATE INDEX ix_schedules_team_id ON cron.schedules (team, id) WHERE team IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX cron.ix_schedules_team_id;
ALTER TABLE cron.schedules DROP COLUMN team;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
