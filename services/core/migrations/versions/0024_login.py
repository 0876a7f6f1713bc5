"""Sign-in (issue 34, docs/security.md "Signing in"): ``core.login_flows`` holds the
authorization-code flows the dashboard has started (the PKCE verifier and nonce, kept
until the provider sends the browser back, ten minutes at most); ``core.sessions`` the
dashboard's sessions, by the SHA-256 of their cookie (and of their CSRF token), each with
the teams its ID token claimed and a bounded lifetime. ``core.team_claims`` learns when a
claim was last seen in a verified token (``seen_at``) and until when it stands for what a
service does in the member's name (``standing_until``: cron fires, DAG nodes).

Revision ID: 0018_login
Revises: 0021_usage
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0018_login"
down_revision = "0021_usage"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.team_claims
    ADD COLUMN seen_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    ADD COLUMN standing_until TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL;

CREATE TABLE core.login_flows (
    state_hash TEXT NOT NULL,
    verifier TEXT NOT NULL,
    nonce TEXT NOT NULL,
    next TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    CONSTRAINT pk_login_flows PRIMARY KEY (state_hash)
);
CREATE INDEX ix_login_flows_created_at ON core.login_flows (created_at);

CREATE TABLE core.sessions (
    id_hash TEXT NOT NULL,
    csrf_hash TEXT NOT NULL,
    principal TEXT NOT NULL,
    role TEXT NOT NULL,
    teams TEXT[] NOT NULL,
    kid TEXT,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    expires_at TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT pk_sessions PRIMARY KEY (id_hash),
    CONSTRAINT ck_sessions_role CHECK (role IN ('admin', 'user')),
    CONSTRAINT ck_sessions_lifetime CHECK (expires_at > created_at)
);
CREATE INDEX ix_sessions_expires_at ON core.sessions (expires_at);
CREATE INDEX ix_sessions_principal ON core.sessions (principal);
"""

DOWNGRADE = """
DROP TABLE core.sessions;
DROP TABLE core.login_flows;
ALTER TABLE core.team_claims DROP COLUMN standing_until, DROP COLUMN seen_at;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
