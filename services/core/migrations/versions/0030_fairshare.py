"""Fair share by usage (issue 32, docs/sharing.md "Fair share by usage"): each flow's
(an owner's own work, or a team's) reserved core-seconds, decayed with a half-life, kept
by the usage roll-up (``db/accounting.py``) as one row per flow: the value as of ``at``,
which a reader decays to its own now. The claim reads it by primary key for the rows it
picked, so that queues with ``fair_share: usage`` order work by it.

Revision ID: 0024_fairshare
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0024_fairshare"
down_revision = "0022_session_tokens"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE core.fair_usage (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    cpu_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    at TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT pk_fair_usage PRIMARY KEY (kind, name),
    CONSTRAINT ck_fair_usage_kind CHECK (kind IN ('owner', 'team'))
);
"""

DOWNGRADE = """
DROP TABLE core.fair_usage;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
