"""The GIN index of task labels holds only labelled tasks: every move of a task is a
non-HOT update (its state is in the predicates of the partial indexes), and each one
added an entry for ``{}`` to the GIN's pending list, which no query reads (a label
filter never matches an unlabelled task; the queries that filter say so).

Revision ID: 0007_hot_indexes
Revises: 0006_due_claim
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0007_hot_indexes"
down_revision = "0006_due_claim"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DROP INDEX core.ix_tasks_labels")
    op.execute(
        "CREATE INDEX ix_tasks_labels ON core.tasks USING gin (labels jsonb_path_ops)"
        " WHERE labels <> '{}'::jsonb"
    )


def downgrade() -> None:
    op.execute("DROP INDEX core.ix_tasks_labels")
    op.execute("CREATE INDEX ix_tasks_labels ON core.tasks USING gin (labels jsonb_path_ops)")
