"""Sub-workflows (issue 33): a node may run another stored workflow as a child run.
``dag.nodes.child_run_id`` is the run a node started; the child run keeps its parent
(run, node, try) under a unique index, so a parent node's try starts at most one child
whatever restarts or leader changes happen; ``dag.runs.depth`` bounds the nesting.
Approval decisions wait (``dag.nodes.audit_pending``) until the loop has reported them
to core's audit trail, with the decider's role (``decided_role``).

Revision ID: 0008_subflows
Revises: 0007_run_task_timeout
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0008_subflows"
down_revision = "0007_run_task_timeout"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.runs ADD COLUMN parent_run_id BIGINT;
ALTER TABLE dag.runs ADD COLUMN parent_node TEXT;
ALTER TABLE dag.runs ADD COLUMN parent_try INTEGER;
ALTER TABLE dag.runs ADD COLUMN depth SMALLINT NOT NULL DEFAULT 0;
ALTER TABLE dag.runs ADD CONSTRAINT ck_runs_parent_whole
    CHECK ((parent_run_id IS NULL) = (parent_node IS NULL)
        AND (parent_run_id IS NULL) = (parent_try IS NULL)
        AND (parent_run_id IS NULL) = (depth = 0));
CREATE UNIQUE INDEX ix_runs_parent ON dag.runs (parent_run_id, parent_node, parent_try)
    WHERE parent_run_id IS NOT NULL;
ALTER TABLE dag.nodes ADD COLUMN child_run_id BIGINT;
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_live_has_task;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_live_has_task
    CHECK (task_id IS NOT NULL OR child_run_id IS NOT NULL
        OR state NOT IN ('released', 'running'));
CREATE INDEX ix_nodes_children ON dag.nodes (child_run_id)
    WHERE child_run_id IS NOT NULL AND state IN ('running', 'cancelling');
ALTER TABLE dag.nodes ADD COLUMN decided_role TEXT;
ALTER TABLE dag.nodes ADD COLUMN audit_pending BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX ix_nodes_audit_pending ON dag.nodes (decided_at) WHERE audit_pending;
"""

DOWNGRADE = """
DROP INDEX dag.ix_nodes_audit_pending;
ALTER TABLE dag.nodes DROP COLUMN audit_pending;
ALTER TABLE dag.nodes DROP COLUMN decided_role;
DROP INDEX dag.ix_nodes_children;
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_live_has_task;
UPDATE dag.nodes SET state = 'failed', error = 'sub-workflows were removed'
    WHERE child_run_id IS NOT NULL AND task_id IS NULL AND state IN ('released', 'running');
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_live_has_task
    CHECK (task_id IS NOT NULL OR state NOT IN ('released', 'running'));
ALTER TABLE dag.nodes DROP COLUMN child_run_id;
DROP INDEX dag.ix_runs_parent;
ALTER TABLE dag.runs DROP CONSTRAINT ck_runs_parent_whole;
ALTER TABLE dag.runs DROP COLUMN depth;
ALTER TABLE dag.runs DROP COLUMN parent_try;
ALTER TABLE dag.runs DROP COLUMN parent_node;
ALTER TABLE dag.runs DROP COLUMN parent_run_id;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
