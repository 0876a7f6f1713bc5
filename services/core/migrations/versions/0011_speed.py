"""The notification matcher reads only the events that moved a task to dead: a partial
index on them, in feed order (``queries.feed_to``).

Revision ID: 0006_speed
Revises: 0005_data
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0006_speed"
down_revision = "0005_data"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Built without blocking the writers of a large feed.
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "ix_task_events_dead",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_task_events_dead"
            " ON core.task_events (xid, id) WHERE to_state = 'dead'",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS core.ix_task_events_dead")
