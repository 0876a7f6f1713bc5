"""Bring the DAG service's schema to the newest migration."""

from __future__ import annotations

from pathlib import Path

from libs.common import migrations

MIGRATIONS = Path(__file__).parent / "migrations"


def upgrade(database_url: str) -> None:
    migrations.upgrade(MIGRATIONS, database_url)
