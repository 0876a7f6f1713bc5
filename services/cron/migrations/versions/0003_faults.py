"""The leader's epoch (libs/common/leader.py): one row per election, bumped by each new
leader; the leader's writes are fenced on it.

Revision ID: cron_0002_faults
Revises: cron_0002_ontime
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "cron_0002_faults"
down_revision = "cron_0002_ontime"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE cron.leader (
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
    op.execute("DROP TABLE cron.leader;")
