"""Bring the cron schema to the newest migration."""

from __future__ import annotations

from pathlib import Path

from libs.common import migrations

MIGRATIONS = Path(__file__).parent / "migrations"


def upgrade(database_url: str) -> None:
    migrations.upgrade(MIGRATIONS, database_url)


def check(database_url: str) -> None:
    """Refuse a schema behind this release's (``CAIRN_MIGRATE_ON_START=false``)."""
    migrations.check(MIGRATIONS, database_url)
