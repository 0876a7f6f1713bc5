"""Teams in sharing: a team's fair-share weight and quotas (docs/sharing.md, "Teams").

Revision ID: 0004_teams2
Revises: 0004_logs
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_teams2"
down_revision = "0004_logs"
branch_labels = None
depends_on = None

UPGRADE = """
-- A team's share and quotas, as core.shares holds an owner's; kept apart so a team and a
-- principal of the same name never share a row. It goes with its team.
CREATE TABLE core.team_shares (
    team TEXT NOT NULL,
    weight DOUBLE PRECISION DEFAULT 1 NOT NULL,
    max_cpu DOUBLE PRECISION,
    max_memory_mb DOUBLE PRECISION,
    max_running INTEGER,
    max_waiting INTEGER,
    max_submits_per_min INTEGER,
    rate_window_at TIMESTAMP WITH TIME ZONE,
    rate_count INTEGER DEFAULT 0 NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_team_shares PRIMARY KEY (team),
    CONSTRAINT fk_team_shares_team_teams FOREIGN KEY (team)
        REFERENCES core.teams (name) ON DELETE CASCADE,
    CONSTRAINT ck_team_shares_weight_range CHECK (weight > 0 AND weight <= 1000),
    CONSTRAINT ck_team_shares_limits_positive CHECK (
        (max_cpu IS NULL OR max_cpu > 0) AND (max_memory_mb IS NULL OR max_memory_mb > 0)
        AND (max_running IS NULL OR max_running > 0) AND (max_waiting IS NULL OR max_waiting > 0)
        AND (max_submits_per_min IS NULL OR max_submits_per_min > 0)
    )
);
-- A team's last stamp in a queue (submit: team work is one flow), and its waiting count.
CREATE INDEX ix_tasks_team_waiting ON core.tasks (team, queue, vtime)
    WHERE state IN ('ready', 'waiting') AND team IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX core.ix_tasks_team_waiting;
DROP TABLE core.team_shares;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
