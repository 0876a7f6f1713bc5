"""Services (issue 32 part 7, docs/services.md): a service's declared ports and probes as
submitted (``tasks.service``, NULL for everything else), and what its agent reports of
each replica: whether its readiness probe passes, its host's address and the ports it
listens on (``attempts.ready``, ``address``, ``ports``); the endpoint read walks the
running services of one owner and name (``ix_tasks_placed_running`` does not hold
unplaced ones, hence an index of its own). Services kept at N replicas with rolling
updates (``core.services``, the controller's steps in ``core.service_steps``); their
tasks carry the labels ``cairn.service`` and ``cairn.revision``, and the controller
reads a service's live ones by ``ix_tasks_service_replicas``.

Revision ID: 0026_services
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0026_services"
down_revision = "0025_disk_quota"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tasks
    ADD COLUMN service JSONB,
    ADD CONSTRAINT ck_tasks_service_kind CHECK (service IS NULL OR kind = 'service');
ALTER TABLE core.attempts
    ADD COLUMN ready BOOLEAN,
    ADD COLUMN ready_at TIMESTAMP WITH TIME ZONE,
    ADD COLUMN address TEXT,
    ADD COLUMN ports JSONB;
CREATE INDEX ix_tasks_services_running ON core.tasks (name, owner)
    WHERE kind = 'service' AND state = 'running';
CREATE TABLE core.services (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    replicas INTEGER NOT NULL,
    template JSONB NOT NULL,
    revision INTEGER NOT NULL,
    previous JSONB,
    previous_revision INTEGER,
    revisions INTEGER NOT NULL,
    max_surge INTEGER NOT NULL,
    max_unavailable INTEGER NOT NULL,
    deadline_s INTEGER NOT NULL,
    rollout TEXT NOT NULL,
    rollout_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    message TEXT,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_services PRIMARY KEY (id),
    CONSTRAINT uq_services_owner_name UNIQUE (owner, name),
    CONSTRAINT ck_services_replicas CHECK (replicas >= 0),
    CONSTRAINT ck_services_rollout CHECK (rollout IN ('progressing', 'complete', 'rolled_back')),
    CONSTRAINT ck_services_moves CHECK (max_surge >= 0 AND max_unavailable >= 0
        AND max_surge + max_unavailable > 0)
);
CREATE TABLE core.service_steps (
    id BIGINT GENERATED ALWAYS AS IDENTITY,
    service_id BIGINT NOT NULL,
    at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    step TEXT NOT NULL,
    detail TEXT,
    CONSTRAINT pk_service_steps PRIMARY KEY (id),
    CONSTRAINT fk_service_steps_service_id_services FOREIGN KEY (service_id)
        REFERENCES core.services (id) ON DELETE CASCADE
);
CREATE INDEX ix_service_steps_service_id ON core.service_steps (service_id, id);
CREATE INDEX ix_tasks_service_replicas ON core.tasks (owner, name)
    WHERE labels ? 'cairn.service' AND state IN ('ready', 'waiting', 'running', 'failed');
"""

DOWNGRADE = """
DROP INDEX core.ix_tasks_service_replicas;
DROP TABLE core.service_steps;
DROP TABLE core.services;
DROP INDEX core.ix_tasks_services_running;
ALTER TABLE core.attempts DROP COLUMN ports, DROP COLUMN address, DROP COLUMN ready_at,
    DROP COLUMN ready;
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_service_kind, DROP COLUMN service;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
