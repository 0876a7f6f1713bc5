"""Events (issue 33): signed HTTP triggers of workflows, events delivered to runs (kept
once per run and name, also before a node waits for them), the event a waiting node
waits for, and when each node started (the run history grid's durations).

Revision ID: 0009_events
Revises: 0008_subflows
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0009_events"
down_revision = "0008_subflows"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE dag.nodes ADD COLUMN event TEXT;
ALTER TABLE dag.nodes ADD COLUMN started_at TIMESTAMPTZ;
CREATE TABLE dag.run_events (
    run_id BIGINT NOT NULL REFERENCES dag.runs (id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    data JSONB NOT NULL,
    sent_by TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT pk_run_events PRIMARY KEY (run_id, name)
);
CREATE TABLE dag.triggers (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    workflow TEXT NOT NULL,
    secret TEXT NOT NULL,
    params JSONB,
    key_path TEXT,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT pk_triggers PRIMARY KEY (id)
);
CREATE INDEX ix_triggers_owner ON dag.triggers (owner, workflow);
CREATE INDEX ix_runs_workflow ON dag.runs (owner, workflow, id);
"""

DOWNGRADE = """
DROP INDEX dag.ix_runs_workflow;
DROP TABLE dag.triggers;
DROP TABLE dag.run_events;
ALTER TABLE dag.nodes DROP COLUMN started_at;
ALTER TABLE dag.nodes DROP COLUMN event;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
