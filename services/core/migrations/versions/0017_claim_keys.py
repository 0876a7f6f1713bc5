"""The key that signed the token behind a team claim: when the identity provider withdraws
a key, the memberships its tokens vouched for go with it.

Revision ID: 0011_claim_keys
Revises: 0010_team_claims
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0011_claim_keys"
down_revision = "0010_team_claims"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Claims kept before this have no key: the next withdrawal of any key takes them.
    op.execute("ALTER TABLE core.team_claims ADD COLUMN kid text")


def downgrade() -> None:
    op.execute("ALTER TABLE core.team_claims DROP COLUMN kid")
