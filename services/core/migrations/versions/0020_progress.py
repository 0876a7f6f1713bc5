"""Progress, checkpoints and fencing tokens (docs/progress.md): a task's latest progress
and checkpoint, one row per task that reported any; the stalled-progress bound a task
may ask for; and the digest of each attempt's fencing secret.

Revision ID: 0014_progress
Revises: 0012_leader
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0014_progress"
down_revision = "0013_policy"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tasks ADD COLUMN progress_timeout_s INTEGER;
ALTER TABLE core.tasks ADD CONSTRAINT ck_tasks_progress_timeout_positive
    CHECK (progress_timeout_s IS NULL OR progress_timeout_s > 0);
ALTER TABLE core.attempts ADD COLUMN fence_sha256 BYTEA;
CREATE TABLE core.task_progress (
    task_id BIGINT NOT NULL,
    attempt_id BIGINT NOT NULL,
    fraction DOUBLE PRECISION,
    message TEXT,
    progress_at TIMESTAMP WITH TIME ZONE,
    checkpoint BYTEA,
    checkpoint_attempt_id BIGINT,
    checkpoint_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_task_progress PRIMARY KEY (task_id),
    CONSTRAINT fk_task_progress_task_id_tasks FOREIGN KEY (task_id)
        REFERENCES core.tasks (id) ON DELETE CASCADE,
    CONSTRAINT ck_task_progress_fraction CHECK (fraction IS NULL OR fraction BETWEEN 0 AND 1),
    CONSTRAINT ck_task_progress_message_size CHECK (char_length(message) <= 200),
    CONSTRAINT ck_task_progress_checkpoint_size CHECK (octet_length(checkpoint) <= 65536)
);
"""

DOWNGRADE = """
DROP TABLE core.task_progress;
ALTER TABLE core.attempts DROP COLUMN fence_sha256;
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_progress_timeout_positive;
ALTER TABLE core.tasks DROP COLUMN progress_timeout_s;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
