"""Core's leader (libs/common/leader.py): the replica that runs core's singleton loops
(promotion, the reaper, the placement pass, retention, the notification matcher and
deadline scan, the log archive). One row per election, bumped by each new leader.

Revision ID: 0012_leader
Revises: 0011_claim_keys
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0012_leader"
down_revision = "0011_claim_keys"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE core.leader (
    name TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    holder TEXT NOT NULL,
    since TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT pk_leader PRIMARY KEY (name)
);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE core.leader;")
