"""The provider's key a token rests on (``core.tokens.kid``): a token made with a JWT,
a dashboard session or its bearer token (or made by a token that was) carries the id of
the key that signed the ID token, so that the provider withdrawing the key (leaked)
revokes it with the sessions and claims it began. Tokens made before have none.

Revision ID: 0037_token_kid
Revises: 0036_audit_key
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

from libs.common.migrations import create_index_concurrently

revision = "0037_token_kid"
down_revision = "0036_audit_key"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE core.tokens ADD COLUMN kid TEXT")
    with op.get_context().autocommit_block():
        create_index_concurrently(
            "core",
            "ix_tokens_kid",
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_tokens_kid"
            " ON core.tokens (kid) WHERE kid IS NOT NULL AND revoked_at IS NULL",
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS core.ix_tokens_kid")
    op.execute("ALTER TABLE core.tokens DROP COLUMN kid")
