"""A fair-share flow's last waiting stamp, read off an index of exactly the flow's waiting
rows (an owner's own work, a team's work): SUBMIT's ``clock`` takes ``max(vtime)`` there.

The condition is spelled ``state >= 'waiting' AND state <= 'waiting'`` (which is
``state = 'waiting'``) in these indexes and in the query alike, so that the query proves
these predicates and no other index's: with ``state = 'waiting'`` PostgreSQL's cached
generic plan could take the queue's waiting index (``ix_tasks_waiting_vtime``) backwards,
filtering by owner, and walk the backlog of the other flows' later work to a flow
stamped near the head (23.7 ms a submission behind 50,000 of another owner's tasks);
with the owner's ready-and-waiting index it walked the flow's own delayed and paused
work instead (a paused queue's fill read ~190 buffers a submission).

Revision ID: 0008_flow_last
Revises: 0007_hot_indexes
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0008_flow_last"
down_revision = "0007_hot_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_tasks_owner_last ON core.tasks (owner, queue, vtime)"
        " WHERE state >= 'waiting' AND state <= 'waiting' AND team IS NULL"
    )
    op.execute(
        "CREATE INDEX ix_tasks_team_last ON core.tasks (team, queue, vtime)"
        " WHERE state >= 'waiting' AND state <= 'waiting' AND team IS NOT NULL"
    )


def downgrade() -> None:
    op.execute("DROP INDEX core.ix_tasks_team_last")
    op.execute("DROP INDEX core.ix_tasks_owner_last")
