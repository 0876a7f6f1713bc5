"""Usage accounting (issue 32, docs/sharing.md "Usage"): what ended attempts used, summed
per month, owner, team and queue, rolled up from the event feed by the leader
(``db/accounting.py``), so the sums outlive the tasks' retention. Where the roll-up has
read the feed to is a row of ``notify_cursors`` (the feed's cursors), ``usage``, starting
at the feed's beginning: the attempts still within retention are counted on the first
pass.

Revision ID: 0021_usage
Revises: 0019_placement
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0021_usage"
down_revision = "0019_placement"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE core.usage_monthly (
    month DATE NOT NULL,
    owner TEXT NOT NULL,
    team TEXT NOT NULL DEFAULT '',
    queue TEXT NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    wall_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    cpu_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    cpu_reserved_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    memory_mb_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    peak_memory_mb DOUBLE PRECISION NOT NULL DEFAULT 0,
    CONSTRAINT pk_usage_monthly PRIMARY KEY (month, owner, team, queue),
    CONSTRAINT ck_usage_monthly_first_day CHECK (EXTRACT(DAY FROM month) = 1)
);
CREATE INDEX ix_usage_monthly_month_team ON core.usage_monthly (month, team);
INSERT INTO core.notify_cursors (name) VALUES ('usage');
"""

DOWNGRADE = """
DELETE FROM core.notify_cursors WHERE name = 'usage';
DROP TABLE core.usage_monthly;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
