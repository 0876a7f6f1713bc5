"""Placement by label (issue 32, docs/placement.md): a task's placement as submitted
(required and preferred selectors, spread, anti-affinity) and its required selectors
compiled for the claim (``domain.selectors.compile_required``); both NULL for the
common task, which the claim tests with one NULL check; and where a spread group (the
running tasks of one owner and name, placed) runs, indexed for the claims that spread
(an index only placed tasks enter: the common task's moves do not maintain it).

Revision ID: 0019_placement
Revises: 0017_audit_chain
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0019_placement"
down_revision = "0017_audit_chain"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tasks
    ADD COLUMN placement JSONB,
    ADD COLUMN required JSONB,
    ADD CONSTRAINT ck_tasks_required_placed CHECK (required IS NULL OR placement IS NOT NULL);
CREATE INDEX ix_tasks_placed_running ON core.tasks (owner, name)
    WHERE placement IS NOT NULL AND state = 'running';
"""

DOWNGRADE = """
DROP INDEX core.ix_tasks_placed_running;
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_required_placed,
    DROP COLUMN required, DROP COLUMN placement;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
