"""The names of deleted teams (``core.retired_teams``): their tasks, schedules and
workflows still name them, so a team made with one later handed its members the old
team's work. Such a name is taken again only when asked for (``reuse_name``). Filled with
the teams the audit trail says were deleted and not made again since.

Revision ID: 0038_retired_teams
Revises: 0037_token_kid
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0038_retired_teams"
down_revision = "0037_token_kid"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE core.retired_teams (
            name TEXT PRIMARY KEY,
            deleted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            deleted_by TEXT NOT NULL
        )
        """
    )
    op.execute(
        """
        INSERT INTO core.retired_teams (name, deleted_at, deleted_by)
        SELECT DISTINCT ON (d.name) d.name, d.at, d.actor
        FROM (SELECT substr(target, 6) AS name, at, actor FROM core.audit
              WHERE action = 'team.delete' AND target LIKE 'team:%') d
        WHERE NOT EXISTS (SELECT 1 FROM core.teams t WHERE t.name = d.name)
        ORDER BY d.name, d.at DESC
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE core.retired_teams")
