"""The resync's work list: nodes waiting on a live task, oldest change first
(``ix_nodes_live``), read each ``CAIRN_DAG_RESYNC_S`` to find outcomes the feed never
delivered.

Revision ID: 0006_resync
Revises: 0005_approvals
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0006_resync"
down_revision = "0005_approvals"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE INDEX ix_nodes_live ON dag.nodes (updated_at)
    WHERE state IN ('released', 'running', 'cancelling');
"""

DOWNGRADE = """
DROP INDEX dag.ix_nodes_live;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
