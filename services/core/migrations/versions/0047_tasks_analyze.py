"""``core.tasks`` analysed every 5,000 changed rows, whatever its size.

A deployment's table is mostly finished tasks (a month of retention), and PostgreSQL's
default analyses a table once a tenth of it has changed: 100,000 rows at 1,000,000 tasks.
A morning's backlog then met the night's statistics, which said nothing waited, and the
planner chose, for statements that look for a few rows among the live ones (the
promoter's next due time, among others), a walk of every waiting task's index entry: 5,000
rows at 5,000 waiting, 44 ms a pass at 100,000 waiting behind 1,000,000 finished, once a
second. With no scale factor and a threshold of 5,000, autovacuum analyses the table at
its next look (``autovacuum_naptime``, a minute by default) after 5,000 rows changed; an
analysis reads a sample of at most 30,000 rows, whatever the table's size.

Revision ID: 0041_tasks_analyze
Revises: 0040_deferral_indexes
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0041_tasks_analyze"
down_revision = "0040_deferral_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE core.tasks SET"
        " (autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 5000)"
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE core.tasks RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold)"
    )
