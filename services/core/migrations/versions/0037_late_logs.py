"""The end of a log that reaches core after its attempt's report (docs/logs.md): a
worker whose last chunks were still on their way when it reported says how long the
attempt's output was (``log_bytes``); core takes the rest for ``CAIRN_LOG_LATE_S`` after
the end, and neither archives the log nor ends a follower's stream before it has it.

Revision ID: 0031_late_logs
Revises: 0028_service_ops
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0031_late_logs"
down_revision = "0028_service_ops"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.attempts ADD COLUMN log_bytes BIGINT,
    ADD CONSTRAINT ck_attempts_log_bytes CHECK (log_bytes >= 0);
"""

DOWNGRADE = """
ALTER TABLE core.attempts DROP CONSTRAINT ck_attempts_log_bytes, DROP COLUMN log_bytes;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
