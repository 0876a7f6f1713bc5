"""The cron schema: schedules and their fires.

Revision ID: cron_0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "cron_0001"
down_revision = None
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE cron.schedules (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    expression TEXT NOT NULL,
    timezone TEXT NOT NULL,
    target JSONB NOT NULL,
    misfire_policy TEXT NOT NULL,
    catch_up_limit INTEGER NOT NULL,
    misfire_grace_s INTEGER NOT NULL,
    overlap_policy TEXT NOT NULL,
    starts_at TIMESTAMP WITH TIME ZONE,
    ends_at TIMESTAMP WITH TIME ZONE,
    paused BOOLEAN DEFAULT false NOT NULL,
    version BIGINT DEFAULT 1 NOT NULL,
    fired_through TIMESTAMP WITH TIME ZONE NOT NULL,
    next_fire_at TIMESTAMP WITH TIME ZONE,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_schedules PRIMARY KEY (id),
    CONSTRAINT uq_schedules_owner_name UNIQUE (owner, name),
    CONSTRAINT ck_schedules_misfire_policy CHECK (misfire_policy IN ('catch_up', 'fire_once', 'skip')),
    CONSTRAINT ck_schedules_overlap_policy CHECK (overlap_policy IN ('allow', 'forbid', 'replace')),
    CONSTRAINT ck_schedules_catch_up_limit CHECK (catch_up_limit BETWEEN 1 AND 1000),
    CONSTRAINT ck_schedules_misfire_grace_positive CHECK (misfire_grace_s >= 1),
    CONSTRAINT ck_schedules_paused_waits_for_nothing CHECK (NOT paused OR next_fire_at IS NULL)
);

CREATE INDEX ix_schedules_next_fire_at ON cron.schedules (next_fire_at) WHERE next_fire_at IS NOT NULL;

CREATE TABLE cron.fires (
    schedule_id BIGINT NOT NULL,
    fire_time TIMESTAMP WITH TIME ZONE NOT NULL,
    manual BOOLEAN DEFAULT false NOT NULL,
    outcome TEXT NOT NULL,
    task_id BIGINT,
    run_id BIGINT,
    recorded_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    submitted_at TIMESTAMP WITH TIME ZONE,
    tries INTEGER DEFAULT 0 NOT NULL,
    detail TEXT,
    CONSTRAINT pk_fires PRIMARY KEY (schedule_id, fire_time),
    CONSTRAINT ck_fires_outcome CHECK (outcome IN ('failed', 'missed', 'pending', 'skipped_overlap', 'submitted')),
    CONSTRAINT ck_fires_submitted_has_time CHECK ((outcome = 'submitted') = (submitted_at IS NOT NULL)),
    CONSTRAINT fk_fires_schedule_id_schedules FOREIGN KEY(schedule_id) REFERENCES cron.schedules (id) ON DELETE CASCADE
);

CREATE INDEX ix_fires_pending ON cron.fires (schedule_id) WHERE outcome = 'pending';

CREATE INDEX ix_fires_recorded_at ON cron.fires (recorded_at);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE cron.fires; DROP TABLE cron.schedules;")
