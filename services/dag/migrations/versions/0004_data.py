"""Workflows for data: nodes keep their outputs, a mapped node's instances are rows of
their own (``NODE[INDEX]``, with their item), a mapped node waits in ``mapped``; runs
have a timeout (a deadline while running, a reason when it fails them) and a cap on
live nodes.

Revision ID: 0003_data
Revises: 0003_teams
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0003_data"
down_revision = "0003_teams"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.nodes ADD COLUMN outputs JSONB;
ALTER TABLE dag.nodes ADD COLUMN map_of TEXT;
ALTER TABLE dag.nodes ADD COLUMN map_index INTEGER;
ALTER TABLE dag.nodes ADD COLUMN map_item JSONB;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_instance_has_index
    CHECK ((map_of IS NULL) = (map_index IS NULL));
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_state;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_state CHECK (state IN ('cancelled',
    'cancelling', 'failed', 'mapped', 'pending', 'ready', 'released', 'running', 'skipped',
    'succeeded', 'upstream_failed'));

ALTER TABLE dag.runs ADD COLUMN timeout_s INTEGER;
ALTER TABLE dag.runs ADD COLUMN deadline TIMESTAMP WITH TIME ZONE;
ALTER TABLE dag.runs ADD COLUMN reason TEXT;
ALTER TABLE dag.runs ADD COLUMN max_active_nodes INTEGER;
ALTER TABLE dag.runs ADD CONSTRAINT ck_runs_timeout_positive
    CHECK (timeout_s IS NULL OR timeout_s > 0);
ALTER TABLE dag.runs ADD CONSTRAINT ck_runs_max_active_nodes_positive
    CHECK (max_active_nodes IS NULL OR max_active_nodes > 0);
CREATE INDEX ix_runs_deadline ON dag.runs (deadline)
    WHERE state = 'running' AND deadline IS NOT NULL;
"""

DOWNGRADE = """
DROP INDEX dag.ix_runs_deadline;
ALTER TABLE dag.runs DROP CONSTRAINT ck_runs_max_active_nodes_positive;
ALTER TABLE dag.runs DROP CONSTRAINT ck_runs_timeout_positive;
ALTER TABLE dag.runs DROP COLUMN max_active_nodes;
ALTER TABLE dag.runs DROP COLUMN reason;
ALTER TABLE dag.runs DROP COLUMN deadline;
ALTER TABLE dag.runs DROP COLUMN timeout_s;
DELETE FROM dag.nodes WHERE map_of IS NOT NULL;
UPDATE dag.nodes SET state = 'running' WHERE state = 'mapped';
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_state;
ALTER TABLE dag.nodes ADD CONSTRAINT ck_nodes_state CHECK (state IN ('cancelled',
    'cancelling', 'failed', 'pending', 'ready', 'released', 'running', 'skipped',
    'succeeded', 'upstream_failed'));
ALTER TABLE dag.nodes DROP CONSTRAINT ck_nodes_instance_has_index;
ALTER TABLE dag.nodes DROP COLUMN map_item;
ALTER TABLE dag.nodes DROP COLUMN map_index;
ALTER TABLE dag.nodes DROP COLUMN map_of;
ALTER TABLE dag.nodes DROP COLUMN outputs;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
