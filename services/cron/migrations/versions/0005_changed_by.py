"""Who last changed a schedule: its fires' tasks carry it (the label
``cairn.cron/changed-by``), since only its owner or an admin changes what it runs.

Revision ID: cron_0004_changed_by
Revises: cron_0003_teams
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "cron_0004_changed_by"
down_revision = "cron_0003_teams"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE cron.schedules ADD COLUMN changed_by TEXT;
UPDATE cron.schedules SET changed_by = owner;
ALTER TABLE cron.schedules ALTER COLUMN changed_by SET NOT NULL;
"""

DOWNGRADE = """
ALTER TABLE cron.schedules DROP COLUMN changed_by;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
