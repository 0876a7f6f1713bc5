"""Indexes for the placement pass's deferral (``db.placement._DEFER``, ``_UNDEFER``): the
deferrable waiting work (``defer_ok`` or a deadline) and the ready work a deferral parked.
A pool is hot during every backlog, and without them each pass (once a second) read
every waiting task of its queues to find the deferrable ones, and every ready task
(delayed submissions, retries in their backoff) to find the deferred: 20,000 rows a pass
at 10,000 of each, 24-34 ms at 20,000 waiting. Both hold few entries: only such tasks.

Built without blocking the writers (as ``0034_task_indexes`` does).

Revision ID: 0040_deferral_indexes
Revises: 0039_principal_disabled
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0040_deferral_indexes"
down_revision = "0039_principal_disabled"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "ix_tasks_deferrable",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tasks_deferrable ON core.tasks (id)"
            " WHERE state = 'waiting' AND (defer_ok OR deadline IS NOT NULL)",
        )
        create_index_concurrently(
            "core",
            "ix_tasks_deferred",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tasks_deferred ON core.tasks (id)"
            " WHERE state = 'ready' AND deferred",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS core.ix_tasks_deferred")
    op.execute("DROP INDEX IF EXISTS core.ix_tasks_deferrable")
