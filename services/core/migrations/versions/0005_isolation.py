"""Isolation: each worker's lease secret (its sha-256 only), and ``oom_killed`` as an
attempt outcome of its own.

Revision ID: 0004_isolation
Revises: 0004_identity
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004_isolation"
down_revision = "0004_identity"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.workers ADD COLUMN lease_sha256 TEXT;
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'oom_killed',
                'preempted', 'succeeded', 'timeout')
);
"""

DOWNGRADE = """
UPDATE core.attempts SET outcome = 'failed' WHERE outcome = 'oom_killed';
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_outcome;
ALTER TABLE core.attempts ADD CONSTRAINT ck_attempts_outcome CHECK (
    outcome IN ('cancelled', 'crashed', 'failed', 'handed_back', 'lost', 'preempted',
                'succeeded', 'timeout')
);
ALTER TABLE core.workers DROP COLUMN lease_sha256;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
