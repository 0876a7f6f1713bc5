"""A reported action's idempotency key (``core.audit.idempotency_key``): the DAG service
reports each approval decision with a key of its own (``AuditReport.idempotency_key``),
and a report sent again (after a timeout, whose first send may have been recorded) is
recorded once. The key is the reporting service's name and the key it gave; it is not
part of the hash chain (the row's content is). The unique index is built without
blocking the writers; every row before it has none.

Revision ID: 0036_audit_key
Revises: 0035_feed_owner
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0036_audit_key"
down_revision = "0035_feed_owner"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE core.audit ADD COLUMN idempotency_key TEXT")
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "ix_audit_idempotency",
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ix_audit_idempotency"
            " ON core.audit (idempotency_key) WHERE idempotency_key IS NOT NULL",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS core.ix_audit_idempotency")
    op.execute("ALTER TABLE core.audit DROP COLUMN idempotency_key")
