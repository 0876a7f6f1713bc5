"""Room for HOT updates of attempts: ``fillfactor = 80`` on core.attempts.

An attempt row is inserted by its claim, then written again while it runs without any
indexed column changing: the start's acknowledgement (a turn's ``started``) and every
heartbeat that lists it alive set ``seen_at``, which no index holds. Such an update is
HOT (a new version in the same page, no index entry added) only when its page has room;
attempts are inserted in id order into full pages, so each of these updates moved the row
to another page and added an entry to each of the table's indexes. A fill factor of 80
keeps a fifth of each page for them.

Nothing is rewritten: the setting applies to the pages filled from now on (existing rows
stay where they are, and keep their values); the downgrade restores the default.

Revision ID: 0027_hot_states
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0027_hot_states"
down_revision = "0024_fairshare"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE core.attempts SET (fillfactor = 80)")


def downgrade() -> None:
    op.execute("ALTER TABLE core.attempts RESET (fillfactor)")
