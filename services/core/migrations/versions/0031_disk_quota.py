"""Disk quota per attempt (issue 32, part 5): a task's ``resources.disk_mb``, its queue's
default and maximum, and ``disk_exceeded`` as an attempt outcome of its own (it failed
with its tmpfs full).

Revision ID: 0025_disk_quota
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0025_disk_quota"
down_revision = "0023_devices"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tasks
    ADD COLUMN disk_mb INTEGER,
    ADD CONSTRAINT ck_tasks_disk_positive CHECK (disk_mb IS NULL OR disk_mb > 0);
ALTER TABLE core.queues
    ADD COLUMN default_disk_mb INTEGER,
    ADD COLUMN max_disk_mb INTEGER,
    ADD CONSTRAINT ck_queues_disk_limits_positive CHECK (
        (default_disk_mb IS NULL OR default_disk_mb > 0)
        AND (max_disk_mb IS NULL OR max_disk_mb > 0)),
    ADD CONSTRAINT ck_queues_default_disk_within_max CHECK (default_disk_mb <= max_disk_mb);
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'disk_exceeded', 'failed', 'handed_back', 'lost',
                'oom_killed', 'preempted', 'succeeded', 'timeout')
);
"""

DOWNGRADE = """
UPDATE core.attempts SET outcome = 'failed' WHERE outcome = 'disk_exceeded';
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'oom_killed',
                'preempted', 'succeeded', 'timeout')
);
ALTER TABLE core.queues
    DROP CONSTRAINT ck_queues_default_disk_within_max,
    DROP CONSTRAINT ck_queues_disk_limits_positive,
    DROP COLUMN max_disk_mb,
    DROP COLUMN default_disk_mb;
ALTER TABLE core.tasks
    DROP CONSTRAINT ck_tasks_disk_positive,
    DROP COLUMN disk_mb;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
