"""A task whose ``file://`` source does not answer on any worker is buried after
``CAIRN_SOURCE_UNANSWERED_MAX`` hand-backs in a row (docs/security.md, "A ``file://``
source that does not answer"): the count, kept on the task, reset by any other end of an
attempt and by a person's retry. And what of each worker's agent hangs on such sources
at its last beat (threads, checkers), for the gauge ``cairn_workers_hung_sources``.

Revision ID: 0032_source_handbacks
Revises: 0031_late_logs
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0032_source_handbacks"
down_revision = "0031_late_logs"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.tasks ADD COLUMN source_handbacks INTEGER NOT NULL DEFAULT 0,
    ADD CONSTRAINT ck_tasks_source_handbacks_non_negative CHECK (source_handbacks >= 0);
ALTER TABLE core.workers ADD COLUMN hung_source_threads INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN hung_source_checkers INTEGER NOT NULL DEFAULT 0,
    ADD CONSTRAINT ck_workers_hung_non_negative
        CHECK (hung_source_threads >= 0 AND hung_source_checkers >= 0);
"""

DOWNGRADE = """
ALTER TABLE core.workers DROP CONSTRAINT ck_workers_hung_non_negative,
    DROP COLUMN hung_source_checkers, DROP COLUMN hung_source_threads;
ALTER TABLE core.tasks DROP CONSTRAINT ck_tasks_source_handbacks_non_negative,
    DROP COLUMN source_handbacks;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
