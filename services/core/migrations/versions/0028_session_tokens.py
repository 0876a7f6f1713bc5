"""Session tokens (docs/security.md, "Signing in"): short-lived bearer tokens that core
mints for a live dashboard session, so the dashboard's pages can call cron's and dag's
APIs (which take bearer tokens) without a pasted token. Only their SHA-256 is kept, each
bound to its session: it ends with it (``ON DELETE CASCADE``) and stands for whom the
session does, the teams its ID token claimed included.

Revision ID: 0022_session_tokens
Revises: 0020_artifact_creds
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0022_session_tokens"
down_revision = "0020_artifact_creds"
branch_labels = None
depends_on = None

UPGRADE = """
CREATE TABLE core.session_tokens (
    token_hash TEXT NOT NULL,
    session_hash TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    expires_at TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT pk_session_tokens PRIMARY KEY (token_hash),
    CONSTRAINT fk_session_tokens_session_hash_sessions FOREIGN KEY (session_hash)
        REFERENCES core.sessions (id_hash) ON DELETE CASCADE
);
CREATE INDEX ix_session_tokens_session_hash ON core.session_tokens (session_hash);
CREATE INDEX ix_session_tokens_expires_at ON core.session_tokens (expires_at);
"""

DOWNGRADE = "DROP TABLE core.session_tokens;"


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
