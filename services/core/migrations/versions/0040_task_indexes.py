"""Fewer index entries a task move (issue 35): no task move is HOT, so each one adds an
entry to every index of ``core.tasks`` whose predicate the new row meets, and each event
one to every index of ``core.task_events``; and every statement that writes a task opens
all of the table's indexes and prepares their predicates.

- ``core.task_events`` had two unique keys: ``id`` (the primary key) and ``(task_id,
  seq)``. Nothing reads an event by its id alone (the feed walks ``(xid, id)``, a task's
  history and the purge go by ``task_id``), so the natural key ``(task_id, seq)`` is now
  the primary key and the index of ``id`` is gone: one entry less for every event (the
  submit's, the claim's, the report's).
- The running tasks placed by label (``ix_tasks_placed_running``, read by
  ``db.placement``'s spread groups) and the running services (``ix_tasks_services_running``,
  read by ``db.services``' endpoints) are one partial index of the running tasks that are
  either, by name and owner: the same entries, one index less to open.

The new indexes are built without blocking the writers (as ``0011_speed`` does), then
swapped in; the downgrade builds the old ones back the same way.

Revision ID: 0034_task_indexes
Revises: 0033_task_domains
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0034_task_indexes"
down_revision = "0033_task_domains"
branch_labels = None
depends_on = None

RUNNING_NAMED = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tasks_running_named ON core.tasks (name, owner)"
    " WHERE state = 'running' AND (placement IS NOT NULL OR kind = 'service')"
)


def upgrade() -> None:
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "task_events_key",
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS task_events_key"
            " ON core.task_events (task_id, seq)",
        )
        create_index_concurrently("core", "ix_tasks_running_named", RUNNING_NAMED)
    op.execute(
        "ALTER TABLE core.task_events DROP CONSTRAINT pk_task_events,"
        " DROP CONSTRAINT uq_task_events_task_id_seq,"
        " ADD CONSTRAINT pk_task_events PRIMARY KEY USING INDEX task_events_key"
    )
    op.execute("DROP INDEX core.ix_tasks_placed_running")
    op.execute("DROP INDEX core.ix_tasks_services_running")


def downgrade() -> None:
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "task_events_id",
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS task_events_id ON core.task_events (id)",
        )
        create_index_concurrently(
            "core",
            "task_events_task_id_seq",
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS task_events_task_id_seq"
            " ON core.task_events (task_id, seq)",
        )
        create_index_concurrently(
            "core",
            "ix_tasks_placed_running",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tasks_placed_running"
            " ON core.tasks (owner, name) WHERE placement IS NOT NULL AND state = 'running'",
        )
        create_index_concurrently(
            "core",
            "ix_tasks_services_running",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tasks_services_running"
            " ON core.tasks (name, owner) WHERE kind = 'service' AND state = 'running'",
        )
    op.execute(
        "ALTER TABLE core.task_events DROP CONSTRAINT pk_task_events,"
        " ADD CONSTRAINT pk_task_events PRIMARY KEY USING INDEX task_events_id,"
        " ADD CONSTRAINT uq_task_events_task_id_seq UNIQUE USING INDEX task_events_task_id_seq"
    )
    op.execute("DROP INDEX core.ix_tasks_running_named")
