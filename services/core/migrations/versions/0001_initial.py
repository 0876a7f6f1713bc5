"""Initial core schema: principals, tokens, queues, tasks, attempts, task events.

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
CREATE SCHEMA IF NOT EXISTS core;

CREATE TABLE core.principals (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_principals PRIMARY KEY (id),
    CONSTRAINT ck_principals_role CHECK (role IN ('admin', 'service', 'user', 'worker')),
    CONSTRAINT ck_principals_name_length CHECK (length(name) BETWEEN 1 AND 100),
    CONSTRAINT uq_principals_name UNIQUE (name)
);

CREATE TABLE core.queues (
    name TEXT NOT NULL,
    paused BOOLEAN DEFAULT false NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_queues PRIMARY KEY (name)
);

CREATE TABLE core.task_events (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    xid BIGINT DEFAULT (pg_current_xact_id())::text::bigint NOT NULL,
    task_id BIGINT NOT NULL,
    seq INTEGER NOT NULL,
    owner TEXT NOT NULL,
    op TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT,
    attempt_id BIGINT,
    at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_task_events PRIMARY KEY (id),
    CONSTRAINT uq_task_events_task_id_seq UNIQUE (task_id, seq)
);

CREATE INDEX ix_task_events_xid_id ON core.task_events (xid, id);


CREATE TABLE core.tasks (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT DEFAULT 0 NOT NULL,
    kind TEXT NOT NULL,
    artifact_uri TEXT NOT NULL,
    artifact_sha256 TEXT NOT NULL,
    args JSONB DEFAULT '[]'::jsonb NOT NULL,
    env JSONB DEFAULT '{}'::jsonb NOT NULL,
    input_path TEXT,
    output_path TEXT,
    cpu DOUBLE PRECISION NOT NULL,
    memory_mb INTEGER NOT NULL,
    preemptible BOOLEAN DEFAULT false NOT NULL,
    max_attempts INTEGER NOT NULL,
    backoff_base_s DOUBLE PRECISION,
    backoff_cap_s DOUBLE PRECISION NOT NULL,
    backoff_jitter BOOLEAN NOT NULL,
    poison_after INTEGER NOT NULL,
    timeout_s INTEGER,
    run_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    idempotency_key TEXT,
    spec_hash TEXT,
    labels JSONB DEFAULT '{}'::jsonb NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER DEFAULT 0 NOT NULL,
    crashes INTEGER DEFAULT 0 NOT NULL,
    last_error TEXT,
    current_attempt_id BIGINT,
    version INTEGER DEFAULT 1 NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    finished_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_tasks PRIMARY KEY (id),
    CONSTRAINT ck_tasks_state CHECK (state IN ('cancelled', 'dead', 'failed', 'ready', 'running', 'succeeded', 'waiting')),
    CONSTRAINT ck_tasks_kind CHECK (kind IN ('service', 'task')),
    CONSTRAINT ck_tasks_final_has_finished_at CHECK ((state IN ('cancelled', 'dead', 'succeeded')) = (finished_at IS NOT NULL)),
    CONSTRAINT ck_tasks_max_attempts_positive CHECK (max_attempts > 0),
    CONSTRAINT ck_tasks_poison_after_positive CHECK (poison_after > 0),
    CONSTRAINT ck_tasks_counts_non_negative CHECK (attempts >= 0 AND crashes >= 0),
    CONSTRAINT ck_tasks_resources_positive CHECK (cpu > 0 AND memory_mb > 0),
    CONSTRAINT ck_tasks_timeout_positive CHECK (timeout_s IS NULL OR timeout_s > 0),
    CONSTRAINT ck_tasks_priority_range CHECK (priority BETWEEN -100 AND 100),
    CONSTRAINT ck_tasks_running_has_attempt CHECK (state <> 'running' OR current_attempt_id IS NOT NULL)
);

CREATE INDEX ix_tasks_due ON core.tasks (run_at) WHERE state IN ('failed', 'ready');

CREATE INDEX ix_tasks_finished_at ON core.tasks (finished_at) WHERE finished_at IS NOT NULL;

CREATE INDEX ix_tasks_labels ON core.tasks USING gin (labels jsonb_path_ops);

CREATE INDEX ix_tasks_live_queue_state ON core.tasks (queue, state) WHERE state IN ('dead', 'failed', 'ready', 'running', 'waiting');

CREATE INDEX ix_tasks_owner_id ON core.tasks (owner, id);

CREATE INDEX ix_tasks_waiting ON core.tasks (queue, priority DESC, id) WHERE state = 'waiting';

CREATE UNIQUE INDEX uq_tasks_owner_idempotency_key ON core.tasks (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;

CREATE TABLE core.attempts (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    task_id BIGINT NOT NULL,
    number INTEGER NOT NULL,
    worker_id TEXT,
    outcome TEXT,
    started_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    ended_at TIMESTAMP WITH TIME ZONE,
    exit_code INTEGER,
    peak_memory_mb DOUBLE PRECISION,
    cpu_seconds DOUBLE PRECISION,
    error TEXT,
    log_tail TEXT,
    CONSTRAINT pk_attempts PRIMARY KEY (id),
    CONSTRAINT ck_attempts_ended_has_outcome CHECK ((outcome IS NULL) = (ended_at IS NULL)),
    CONSTRAINT fk_attempts_task_id_tasks FOREIGN KEY(task_id) REFERENCES core.tasks (id) ON DELETE CASCADE
);

CREATE INDEX ix_attempts_task_id ON core.attempts (task_id);

CREATE TABLE core.tokens (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    principal_id BIGINT NOT NULL,
    token_hash BYTEA NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    revoked_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_tokens PRIMARY KEY (id),
    CONSTRAINT fk_tokens_principal_id_principals FOREIGN KEY(principal_id) REFERENCES core.principals (id) ON DELETE CASCADE,
    CONSTRAINT uq_tokens_token_hash UNIQUE (token_hash)
);

CREATE INDEX ix_tokens_principal_id ON core.tokens (principal_id);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(
        "DROP TABLE core.task_events, core.attempts, core.tasks, core.tokens,"
        " core.principals, core.queues CASCADE"
    )
