"""Team memberships an identity provider vouched for, kept until the token that said so
expires: a lease (which has no token at hand) checks a team secret's use against them as
it does against the memberships an admin recorded.

Revision ID: 0010_team_claims
Revises: 0009_webhook_secrets
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0010_team_claims"
down_revision = "0009_webhook_secrets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE core.team_claims (
    team text NOT NULL,
    member text NOT NULL,
    until timestamptz NOT NULL,
    CONSTRAINT pk_team_claims PRIMARY KEY (team, member),
    CONSTRAINT fk_team_claims_team_teams FOREIGN KEY (team)
        REFERENCES core.teams (name) ON DELETE CASCADE
);
CREATE INDEX ix_team_claims_member ON core.team_claims (member);
""")


def downgrade() -> None:
    op.execute("DROP TABLE core.team_claims")
