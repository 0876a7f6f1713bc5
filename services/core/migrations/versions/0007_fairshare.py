"""Sharing one pool: fair-share stamps, shares and quotas per owner, queue policy,
concurrency keys and their limits.

Revision ID: 0004_fairshare
Revises: 0004_notifications
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_fairshare"
down_revision = "0004_notifications"
branch_labels = None
depends_on = None

UPGRADE = """
-- The task's fair-share stamp (virtual clock, epoch seconds): the later of its due time
-- and its owner's last waiting stamp in the queue, plus the owner's step. Within a
-- priority the claim serves the smallest stamp first.
ALTER TABLE core.tasks ADD COLUMN vtime DOUBLE PRECISION
    DEFAULT (EXTRACT(EPOCH FROM now())) NOT NULL;
UPDATE core.tasks SET vtime = EXTRACT(EPOCH FROM run_at) WHERE finished_at IS NULL;
ALTER TABLE core.tasks ADD COLUMN concurrency_key TEXT;
ALTER TABLE core.tasks ADD COLUMN concurrency_limit INTEGER;
ALTER TABLE core.tasks ADD CONSTRAINT ck_tasks_concurrency_limit_positive
    CHECK (concurrency_limit IS NULL OR concurrency_limit > 0);
DROP INDEX core.ix_tasks_waiting;
CREATE INDEX ix_tasks_waiting ON core.tasks (queue, priority DESC, vtime, id)
    WHERE state = 'waiting';
-- Aging: the waiting work longest past its fair turn.
CREATE INDEX ix_tasks_waiting_vtime ON core.tasks (queue, vtime, id) WHERE state = 'waiting';
-- An owner's last stamp in a queue (submit), and its waiting count (the waiting quota).
CREATE INDEX ix_tasks_owner_waiting ON core.tasks (owner, queue, vtime)
    WHERE state IN ('ready', 'waiting');

ALTER TABLE core.attempts ADD COLUMN concurrency_key TEXT;
CREATE INDEX ix_attempts_key_open ON core.attempts (concurrency_key)
    WHERE outcome IS NULL AND concurrency_key IS NOT NULL;
CREATE INDEX ix_attempts_key_started ON core.attempts (concurrency_key, started_at)
    WHERE concurrency_key IS NOT NULL;

-- Reservation: a guaranteed task that fits nowhere and can make no room by preemption
-- holds this worker; its claims start nothing else until the task fits.
ALTER TABLE core.workers ADD COLUMN reserved_for BIGINT;

-- What a queue lets each role ask for (docs/sharing.md); NULL: anything.
ALTER TABLE core.queues ADD COLUMN policy JSONB;

-- Share and quotas of a principal, by name: an owner today; a team's row slots in by the
-- team's name. NULL: no limit. rate_*: the current minute's submissions.
CREATE TABLE core.shares (
    name TEXT NOT NULL,
    weight DOUBLE PRECISION DEFAULT 1 NOT NULL,
    max_cpu DOUBLE PRECISION,
    max_memory_mb DOUBLE PRECISION,
    max_running INTEGER,
    max_waiting INTEGER,
    max_submits_per_min INTEGER,
    rate_window_at TIMESTAMP WITH TIME ZONE,
    rate_count INTEGER DEFAULT 0 NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_shares PRIMARY KEY (name),
    CONSTRAINT ck_shares_weight_range CHECK (weight > 0 AND weight <= 1000),
    CONSTRAINT ck_shares_limits_positive CHECK (
        (max_cpu IS NULL OR max_cpu > 0) AND (max_memory_mb IS NULL OR max_memory_mb > 0)
        AND (max_running IS NULL OR max_running > 0) AND (max_waiting IS NULL OR max_waiting > 0)
        AND (max_submits_per_min IS NULL OR max_submits_per_min > 0)
    )
);

-- Limits of a concurrency key set by an admin: they override the tasks' own.
CREATE TABLE core.concurrency_limits (
    key TEXT NOT NULL,
    max_running INTEGER,
    max_starts INTEGER,
    window_s DOUBLE PRECISION,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_concurrency_limits PRIMARY KEY (key),
    CONSTRAINT ck_concurrency_limits_positive CHECK (
        (max_running IS NULL OR max_running > 0) AND (max_starts IS NULL OR max_starts > 0)
        AND (window_s IS NULL OR window_s > 0)
    ),
    CONSTRAINT ck_concurrency_limits_rate_has_window CHECK (
        (max_starts IS NULL) = (window_s IS NULL)
    )
);
"""

DOWNGRADE = """
DROP TABLE core.concurrency_limits;
DROP TABLE core.shares;
ALTER TABLE core.queues DROP COLUMN policy;
ALTER TABLE core.workers DROP COLUMN reserved_for;
DROP INDEX core.ix_attempts_key_started;
DROP INDEX core.ix_attempts_key_open;
ALTER TABLE core.attempts DROP COLUMN concurrency_key;
DROP INDEX core.ix_tasks_owner_waiting;
DROP INDEX core.ix_tasks_waiting_vtime;
DROP INDEX core.ix_tasks_waiting;
CREATE INDEX ix_tasks_waiting ON core.tasks (queue, priority DESC, id) WHERE state = 'waiting';
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_concurrency_limit_positive;
ALTER TABLE core.tasks DROP COLUMN concurrency_limit;
ALTER TABLE core.tasks DROP COLUMN concurrency_key;
ALTER TABLE core.tasks DROP COLUMN vtime;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
