"""Countable devices (issue 32, docs/placement.md "Devices"): what a worker offers
(``workers.devices``, ``{"gpu": 2}``), what a task asks for (``tasks.devices``, NULL for
the common task), what an attempt holds (``attempts.charge_devices``, NULL when none),
owners' and teams' running quotas of them (``max_devices``), and the device-seconds of
ended attempts per month, owner, team, queue and device name
(``core.usage_monthly_devices``, beside ``core.usage_monthly``).

Revision ID: 0023_devices
Revises: 0022_session_tokens
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0023_devices"
down_revision = "0027_hot_states"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.workers ADD COLUMN devices JSONB DEFAULT '{}'::jsonb NOT NULL;
ALTER TABLE core.tasks ADD COLUMN devices JSONB;
ALTER TABLE core.attempts ADD COLUMN charge_devices JSONB;
ALTER TABLE core.shares ADD COLUMN max_devices JSONB;
ALTER TABLE core.team_shares ADD COLUMN max_devices JSONB;
CREATE TABLE core.usage_monthly_devices (
    month DATE NOT NULL,
    owner TEXT NOT NULL,
    team TEXT NOT NULL DEFAULT '',
    queue TEXT NOT NULL,
    device TEXT NOT NULL,
    device_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    CONSTRAINT pk_usage_monthly_devices PRIMARY KEY (month, owner, team, queue, device),
    CONSTRAINT ck_usage_monthly_devices_first_day CHECK (EXTRACT(DAY FROM month) = 1)
);
"""

DOWNGRADE = """
DROP TABLE core.usage_monthly_devices;
ALTER TABLE core.team_shares DROP COLUMN max_devices;
ALTER TABLE core.shares DROP COLUMN max_devices;
ALTER TABLE core.attempts DROP COLUMN charge_devices;
ALTER TABLE core.tasks DROP COLUMN devices;
ALTER TABLE core.workers DROP COLUMN devices;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
