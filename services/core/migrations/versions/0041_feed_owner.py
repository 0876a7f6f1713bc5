"""A user's event feed reads its own events by owner (``ix_task_events_owner``), not by
walking every event after its cursor: a user with few events among many made the feed
scan the history from the cursor to find a page (``db.tasks.FEED_OWN``). One entry more
for every event; built without blocking the writers.

Revision ID: 0035_feed_owner
Revises: 0034_task_indexes
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0035_feed_owner"
down_revision = "0034_task_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "ix_task_events_owner",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_task_events_owner"
            " ON core.task_events (owner, xid, id)",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS core.ix_task_events_owner")
