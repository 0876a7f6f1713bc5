"""Egress policy per queue (issue 32, docs/security.md "Egress"): what its attempts'
network may reach, as the queue settings API validated it (``libs.common.models.Egress``);
NULL is ``host``, the default.

Revision ID: 0016_egress
Revises: 0014_progress
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0016_egress"
down_revision = "0015_agent_turns"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.queues
    ADD COLUMN egress JSONB,
    ADD CONSTRAINT ck_queues_egress_mode CHECK (egress->>'mode' IN ('none', 'allow'));
"""

DOWNGRADE = """
ALTER TABLE core.queues DROP CONSTRAINT ck_queues_egress_mode, DROP COLUMN egress;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
