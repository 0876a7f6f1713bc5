"""The leader's epoch (libs/common/leader.py): one row per election, bumped by each new
leader; the leader's writes are fenced on it. A cancelled run's ready node may be
cancelling without a task id (its release may have reached core unrecorded).
Finished runs are purged oldest first after the retention.

Revision ID: 0002_faults
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0002_faults"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE dag.leader (
    name TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    holder TEXT NOT NULL,
    since TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT pk_leader PRIMARY KEY (name)
);

ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_live_has_task;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_live_has_task
    CHECK (task_id IS NOT NULL OR state NOT IN ('released', 'running'));

CREATE INDEX ix_runs_finished_at ON dag.runs (finished_at) WHERE finished_at IS NOT NULL;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(
        "DROP INDEX dag.ix_runs_finished_at; DROP TABLE dag.leader; ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_live_has_task;"
        " ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_live_has_task CHECK (task_id IS NOT NULL"
        " OR state NOT IN ('released', 'running', 'cancelling'));"
    )
