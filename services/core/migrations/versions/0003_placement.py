"""Placement: charges held by attempts, measured use per kind of task, pool settings,
preemption, squeeze and deferral.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

UPGRADE = """
-- A pool's overcommit ratio for preemptible work, and the utilisation above which
-- time-insensitive work is deferred (NULL: the settings' defaults). ``utilisation`` is
-- the placement pass's last reading.
ALTER TABLE core.queues ADD COLUMN overcommit DOUBLE PRECISION;
ALTER TABLE core.queues ADD COLUMN defer_above DOUBLE PRECISION;
ALTER TABLE core.queues ADD COLUMN utilisation DOUBLE PRECISION;
ALTER TABLE core.queues ADD CONSTRAINT ck_queues_overcommit_range
    CHECK (overcommit IS NULL OR (overcommit >= 1 AND overcommit <= 10));
ALTER TABLE core.queues ADD CONSTRAINT ck_queues_defer_above_range
    CHECK (defer_above IS NULL OR (defer_above > 0 AND defer_above <= 1));

ALTER TABLE core.tasks ADD COLUMN defer_ok BOOLEAN DEFAULT false NOT NULL;
ALTER TABLE core.tasks ADD COLUMN deadline TIMESTAMP WITH TIME ZONE;
-- Set while it waits in ready for its pool to calm down (run_at: its latest start).
ALTER TABLE core.tasks ADD COLUMN deferred BOOLEAN DEFAULT false NOT NULL;

-- What the attempt holds against its worker's capacity (NULL: its task's request).
ALTER TABLE core.attempts ADD COLUMN charge_cpu DOUBLE PRECISION;
ALTER TABLE core.attempts ADD COLUMN charge_memory_mb DOUBLE PRECISION;
ALTER TABLE core.attempts ADD COLUMN squeezed_at TIMESTAMP WITH TIME ZONE;
-- The guaranteed task this attempt was squeezed or preempted for.
ALTER TABLE core.attempts ADD COLUMN squeezed_for BIGINT;
ALTER TABLE core.attempts ADD COLUMN preempted_by BIGINT;
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'preempted',
                'succeeded', 'timeout')
);
CREATE INDEX ix_attempts_room_made ON core.attempts (worker_id)
    WHERE preempted_by IS NOT NULL OR squeezed_for IS NOT NULL;

-- The decaying peak of what each kind of task (owner, name) used.
CREATE TABLE core.usage (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    peak_cpu DOUBLE PRECISION NOT NULL,
    peak_memory_mb DOUBLE PRECISION NOT NULL,
    samples INTEGER DEFAULT 0 NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_usage PRIMARY KEY (owner, name)
);
"""

DOWNGRADE = """
DROP TABLE core.usage;
DROP INDEX core.ix_attempts_room_made;
UPDATE core.attempts SET outcome = 'handed_back' WHERE outcome = 'preempted';
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'succeeded', 'timeout')
);
ALTER TABLE core.attempts DROP COLUMN preempted_by;
ALTER TABLE core.attempts DROP COLUMN squeezed_for;
ALTER TABLE core.attempts DROP COLUMN squeezed_at;
ALTER TABLE core.attempts DROP COLUMN charge_memory_mb;
ALTER TABLE core.attempts DROP COLUMN charge_cpu;
ALTER TABLE core.tasks DROP COLUMN deferred;
ALTER TABLE core.tasks DROP COLUMN deadline;
ALTER TABLE core.tasks DROP COLUMN defer_ok;
ALTER TABLE core.queues DROP CONSTRAINT ck_queues_defer_above_range;
ALTER TABLE core.queues DROP CONSTRAINT ck_queues_overcommit_range;
ALTER TABLE core.queues DROP COLUMN utilisation;
ALTER TABLE core.queues DROP COLUMN defer_above;
ALTER TABLE core.queues DROP COLUMN overcommit;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
