"""The DAG service's schema: workflow versions, runs, their nodes, the feed cursor.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE dag.workflows (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    definition JSONB NOT NULL,
    definition_hash TEXT NOT NULL,
    node_count INTEGER NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_workflows PRIMARY KEY (id),
    CONSTRAINT uq_workflows_owner_name_version UNIQUE (owner, name, version),
    CONSTRAINT ck_workflows_version_positive CHECK (version > 0),
    CONSTRAINT ck_workflows_has_nodes CHECK (node_count > 0)
);

CREATE TABLE dag.runs (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    workflow_id BIGINT NOT NULL,
    owner TEXT NOT NULL,
    workflow TEXT NOT NULL,
    workflow_version INTEGER NOT NULL,
    params JSONB NOT NULL,
    state TEXT DEFAULT 'queued' NOT NULL,
    idempotency_key TEXT,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    started_at TIMESTAMP WITH TIME ZONE,
    finished_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_runs PRIMARY KEY (id),
    CONSTRAINT ck_runs_state CHECK (state IN ('cancelled', 'failed', 'queued', 'running', 'succeeded')),
    CONSTRAINT ck_runs_final_has_time CHECK ((state IN ('cancelled', 'failed', 'succeeded')) = (finished_at IS NOT NULL)),
    CONSTRAINT ck_runs_started_has_time CHECK (state = 'queued' OR started_at IS NOT NULL),
    CONSTRAINT fk_runs_workflow_id_workflows FOREIGN KEY (workflow_id)
        REFERENCES dag.workflows (id) ON DELETE RESTRICT
);

CREATE INDEX ix_runs_workflow_id ON dag.runs (workflow_id);
CREATE UNIQUE INDEX ix_runs_idempotency ON dag.runs (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX ix_runs_active ON dag.runs (owner, workflow, state, id)
    WHERE state IN ('queued', 'running');

CREATE TABLE dag.nodes (
    run_id BIGINT NOT NULL,
    name TEXT NOT NULL,
    state TEXT DEFAULT 'pending' NOT NULL,
    try_number INTEGER DEFAULT 1 NOT NULL,
    task_id BIGINT,
    error TEXT,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_nodes PRIMARY KEY (run_id, name),
    CONSTRAINT ck_nodes_state CHECK (state IN ('cancelled', 'cancelling', 'failed', 'pending', 'ready', 'released', 'running', 'skipped', 'succeeded', 'upstream_failed')),
    CONSTRAINT ck_nodes_try_positive CHECK (try_number > 0),
    CONSTRAINT ck_nodes_live_has_task CHECK (task_id IS NOT NULL OR state NOT IN ('released', 'running', 'cancelling')),
    CONSTRAINT fk_nodes_run_id_runs FOREIGN KEY (run_id) REFERENCES dag.runs (id) ON DELETE CASCADE
);

CREATE UNIQUE INDEX ix_nodes_task_id ON dag.nodes (task_id) WHERE task_id IS NOT NULL;
CREATE INDEX ix_nodes_to_do ON dag.nodes (state) WHERE state IN ('ready', 'cancelling');

CREATE TABLE dag.feed_cursor (
    id SMALLINT NOT NULL,
    cursor TEXT NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_feed_cursor PRIMARY KEY (id),
    CONSTRAINT ck_feed_cursor_one_row CHECK (id = 1)
);
-- Core's feed from its start: events of tasks this service did not create are skipped.
INSERT INTO dag.feed_cursor (id, cursor) VALUES (1, '0.0');
"""

DOWNGRADE = """
DROP TABLE dag.feed_cursor;
DROP TABLE dag.nodes;
DROP TABLE dag.runs;
DROP TABLE dag.workflows;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
