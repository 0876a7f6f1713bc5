"""A task's policy (issue 31): queues' time limits (default and maximum ``timeout_s``,
the longest wait to start), a task's ``start_by``, crashes counted within a window
(their times), the retry policy's never/always causes, and the signal that killed an
attempt.

Revision ID: 0013_policy
Revises: 0012_leader
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0013_policy"
down_revision = "0012_leader"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.queues
    ADD COLUMN default_timeout_s INTEGER,
    ADD COLUMN max_timeout_s INTEGER,
    ADD COLUMN max_wait_s INTEGER,
    ADD CONSTRAINT ck_queues_time_limits_positive CHECK (
        (default_timeout_s IS NULL OR default_timeout_s > 0)
        AND (max_timeout_s IS NULL OR max_timeout_s > 0)
        AND (max_wait_s IS NULL OR max_wait_s > 0)),
    ADD CONSTRAINT ck_queues_default_timeout_within_max CHECK (
        default_timeout_s <= max_timeout_s);

-- Existing tasks keep the 72 h window; their crashes so far carry no time, so they start
-- the window afresh (the count of each is kept in crashes).
ALTER TABLE core.tasks
    ADD COLUMN start_by TIMESTAMP WITH TIME ZONE,
    ADD COLUMN poison_window_s DOUBLE PRECISION DEFAULT 259200 NOT NULL,
    ADD COLUMN crashed_at TIMESTAMP WITH TIME ZONE[] DEFAULT '{}' NOT NULL,
    ADD COLUMN retry_causes JSONB,
    ADD CONSTRAINT ck_tasks_poison_window_positive CHECK (poison_window_s > 0);

CREATE INDEX ix_tasks_start_by ON core.tasks (start_by)
    WHERE start_by IS NOT NULL AND state IN ('ready', 'waiting');

ALTER TABLE core.attempts ADD COLUMN signal SMALLINT;
"""

DOWNGRADE = """
ALTER TABLE core.attempts DROP COLUMN signal;
DROP INDEX core.ix_tasks_start_by;
ALTER TABLE core.tasks
    DROP CONSTRAINT ck_tasks_poison_window_positive,
    DROP COLUMN retry_causes,
    DROP COLUMN crashed_at,
    DROP COLUMN poison_window_s,
    DROP COLUMN start_by;
ALTER TABLE core.queues
    DROP CONSTRAINT ck_queues_default_timeout_within_max,
    DROP CONSTRAINT ck_queues_time_limits_positive,
    DROP COLUMN max_wait_s,
    DROP COLUMN max_timeout_s,
    DROP COLUMN default_timeout_s;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
