"""Services rolled back at once when their new replicas keep failing (issue 32 part 7,
docs/services.md): a service's rollout allows ``max_failures`` failures of its new
revision's replicas before it is rolled back, without waiting for its deadline.

Revision ID: 0028_service_ops
Revises: 0026_services
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0028_service_ops"
down_revision = "0026_services"
branch_labels = None
depends_on = None

UPGRADE = """
ALTER TABLE core.services
    ADD COLUMN max_failures INTEGER DEFAULT 3 NOT NULL,
    ADD CONSTRAINT ck_services_max_failures CHECK (max_failures >= 1);
"""

DOWNGRADE = """
ALTER TABLE core.services DROP CONSTRAINT ck_services_max_failures,
    DROP COLUMN max_failures;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
