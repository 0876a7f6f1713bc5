"""When a worker's agent last took a turn (claim, report, keep-alive), apart from its
sidecar's heartbeat: core declares a worker dead whose agent has not turned for
``CAIRN_AGENT_HANG_TIMEOUT_S`` even while its sidecar beats (agents that register with
``hang_watch``; NULL for the others).

Revision ID: 0015_agent_turns
Revises: 0012_leader
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0015_agent_turns"
down_revision = "0014_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL: an agent that does not promise keep-alive turns (registered before this, or
    # without ``hang_watch``); only its heartbeats count.
    op.execute("ALTER TABLE core.workers ADD COLUMN last_turn_at TIMESTAMP WITH TIME ZONE")


def downgrade() -> None:
    op.execute("ALTER TABLE core.workers DROP COLUMN last_turn_at")
