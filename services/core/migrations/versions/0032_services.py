"""Services (issue 32 part 7, docs/services.md): a service's declared ports and probes as
submitted (``tasks.service``, NULL for everything else), and what its agent reports of
each replica: whether its readiness probe passes, its host's address and the ports it
listens on (``attempts.ready``, ``address``, ``ports``); the endpoint read walks the
running services of one owner and name (``ix_tasks_placed_running`` does not hold
unplaced ones, hence an index of its own).

Revision ID: 0026_services
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0026_services"
down_revision = "0022_session_tokens"
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
"""

DOWNGRADE = """
DROP INDEX core.ix_tasks_services_running;
ALTER TABLE core.attempts DROP COLUMN ports, DROP COLUMN address, DROP COLUMN ready_at,
    DROP COLUMN ready;
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_service_kind, DROP COLUMN service;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
