"""Fires on time: per-schedule jitter; fires remember the schedule version they were
planned from, how often they were withdrawn (a change in the lead window), and whether
a backfill asked for them.

Revision ID: cron_0002_ontime
Revises: cron_0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "cron_0002_ontime"
down_revision = "cron_0001"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE cron.schedules ADD COLUMN jitter_s INTEGER DEFAULT 0 NOT NULL;
ALTER TABLE cron.schedules ADD CONSTRAINT ck_schedules_jitter_range
    CHECK (jitter_s BETWEEN 0 AND 3600);
ALTER TABLE cron.fires ADD COLUMN version BIGINT;
ALTER TABLE cron.fires ADD COLUMN withdrawn INTEGER DEFAULT 0 NOT NULL;
ALTER TABLE cron.fires ADD COLUMN backfill BOOLEAN DEFAULT false NOT NULL;
ALTER TABLE cron.fires DROP CONSTRAINT ck_fires_outcome;
ALTER TABLE cron.fires ADD CONSTRAINT ck_fires_outcome
    CHECK (outcome IN ('failed', 'missed', 'pending', 'skipped_overlap', 'submitted', 'withdrawn'));
"""

DOWNGRADE = """
DELETE FROM cron.fires WHERE outcome = 'withdrawn';
ALTER TABLE cron.fires DROP CONSTRAINT ck_fires_outcome;
ALTER TABLE cron.fires ADD CONSTRAINT ck_fires_outcome
    CHECK (outcome IN ('failed', 'missed', 'pending', 'skipped_overlap', 'submitted'));
ALTER TABLE cron.fires DROP COLUMN backfill, DROP COLUMN withdrawn, DROP COLUMN version;
ALTER TABLE cron.schedules DROP CONSTRAINT ck_schedules_jitter_range;
ALTER TABLE cron.schedules DROP COLUMN jitter_s;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
