"""Approval gates: a node may wait for a person (state ``waiting``) until ``wait_until``;
its decision (``approve`` or ``reject``), who made it (NULL: the timeout), when, and the
comment are kept on the node.

Revision ID: 0005_approvals
Revises: 0003_data
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0005_approvals"
down_revision = "0003_data"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.nodes ADD COLUMN wait_until TIMESTAMP WITH TIME ZONE;
ALTER TABLE dag.nodes ADD COLUMN decision TEXT;
ALTER TABLE dag.nodes ADD COLUMN decided_by TEXT;
ALTER TABLE dag.nodes ADD COLUMN decided_at TIMESTAMP WITH TIME ZONE;
ALTER TABLE dag.nodes ADD COLUMN comment TEXT;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_decision
    CHECK (decision IS NULL OR decision IN ('approve', 'reject'));
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_decision_has_time
    CHECK ((decision IS NULL) = (decided_at IS NULL));
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_state;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_state CHECK (state IN ('cancelled',
    'cancelling', 'failed', 'mapped', 'pending', 'ready', 'released', 'running', 'skipped',
    'succeeded', 'upstream_failed', 'waiting'));
CREATE INDEX ix_nodes_waiting ON dag.nodes (wait_until) WHERE state = 'waiting';
"""

DOWNGRADE = """
DROP INDEX dag.ix_nodes_waiting;
UPDATE dag.nodes SET state = 'pending' WHERE state = 'waiting';
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_state;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_state CHECK (state IN ('cancelled',
    'cancelling', 'failed', 'mapped', 'pending', 'ready', 'released', 'running', 'skipped',
    'succeeded', 'upstream_failed'));
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_decision_has_time;
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_decision;
ALTER TABLE dag.nodes DROP COLUMN comment;
ALTER TABLE dag.nodes DROP COLUMN decided_at;
ALTER TABLE dag.nodes DROP COLUMN decided_by;
ALTER TABLE dag.nodes DROP COLUMN decision;
ALTER TABLE dag.nodes DROP COLUMN wait_until;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
