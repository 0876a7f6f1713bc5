"""Workers, and attempts that name the worker running them.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE core.workers (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    principal TEXT NOT NULL,
    hostname TEXT NOT NULL,
    queues TEXT[] NOT NULL,
    labels JSONB DEFAULT '{}'::jsonb NOT NULL,
    cpu DOUBLE PRECISION NOT NULL,
    memory_mb INTEGER NOT NULL,
    state TEXT DEFAULT 'live' NOT NULL,
    registered_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    last_heartbeat_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    gone_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT pk_workers PRIMARY KEY (id),
    CONSTRAINT ck_workers_state CHECK (state IN ('dead', 'draining', 'left', 'live')),
    CONSTRAINT ck_workers_capacity_positive CHECK (cpu > 0 AND memory_mb > 0),
    CONSTRAINT ck_workers_gone_has_time CHECK ((state IN ('dead', 'left')) = (gone_at IS NOT NULL))
);

CREATE INDEX ix_workers_heartbeat ON core.workers (last_heartbeat_at)
    WHERE state IN ('draining', 'live');

ALTER TABLE core.attempts ALTER COLUMN worker_id TYPE BIGINT USING worker_id::bigint;
ALTER TABLE core.attempts ADD CONSTRAINT fk_attempts_worker_id_workers
    FOREIGN KEY (worker_id) REFERENCES core.workers (id) ON DELETE SET NULL;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'succeeded', 'timeout')
);
CREATE INDEX ix_attempts_open_by_worker ON core.attempts (worker_id) WHERE outcome IS NULL;
-- When a heartbeat last showed the attempt's process alive (NULL: never).
ALTER TABLE core.attempts ADD COLUMN seen_at TIMESTAMP WITH TIME ZONE;

CREATE TABLE core.attempt_logs (
    attempt_id BIGINT NOT NULL,
    content TEXT NOT NULL,
    truncated BOOLEAN DEFAULT false NOT NULL,
    CONSTRAINT pk_attempt_logs PRIMARY KEY (attempt_id),
    CONSTRAINT fk_attempt_logs_attempt_id_attempts FOREIGN KEY (attempt_id)
        REFERENCES core.attempts (id) ON DELETE CASCADE
);
"""

DOWNGRADE = """
DROP TABLE core.attempt_logs;
ALTER TABLE core.attempts DROP COLUMN seen_at;
DROP INDEX core.ix_attempts_open_by_worker;
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts DROP CONSTRAINT fk_attempts_worker_id_workers;
ALTER TABLE core.attempts ALTER COLUMN worker_id TYPE TEXT;
DROP TABLE core.workers;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
