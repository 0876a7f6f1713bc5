"""Artifact credentials (docs/security.md, "Artifact credentials"): a task's ``s3://``
artifact may name a secret of its owner or team (``{"secret": ..., "team": ...}``, as an
env value does) that the worker signs the fetch with. Only the reference is stored.

Revision ID: 0020_artifact_creds
Revises: 0018_login
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0020_artifact_creds"
down_revision = "0018_login"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        ALTER TABLE core.tasks ADD COLUMN artifact_credentials JSONB,
            ADD CONSTRAINT ck_tasks_artifact_credentials
                CHECK (jsonb_typeof(artifact_credentials) = 'object')
    """)


def downgrade() -> None:
    op.execute("ALTER TABLE core.tasks DROP COLUMN artifact_credentials")
