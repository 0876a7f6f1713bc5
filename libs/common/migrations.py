"""Alembic, the same way for every service: each service keeps its migrations beside its
code, its tables in a schema of its own, and its version table in that schema."""

from __future__ import annotations

from pathlib import Path

from alembic import command, context
from alembic.config import Config
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.pool import NullPool

from libs.common import locks

# Replicas starting together take turns; the loser then finds nothing to do. One key for
# every service: migrations are rare and short, so they may as well queue.
_LOCK_KEY = locks.MIGRATIONS


def alembic_config(script_location: Path, database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(script_location: Path, database_url: str) -> None:
    """Bring the schema whose migrations live at ``script_location`` to the newest."""
    command.upgrade(alembic_config(script_location, database_url), "head")


def run_online(schema: str, metadata: MetaData) -> None:
    """The body of a service's ``env.py``: migrate ``schema`` under an advisory lock."""
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set"
    # No pool: closing the connection ends its session, so a migration that fails still
    # lets the lock go (a pooled connection kept it, and the next upgrade in this process
    # waited on it for ever).
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _LOCK_KEY})
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        connection.commit()
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema=schema,
            include_schemas=True,
            include_name=lambda name, type_, _parents: type_ != "schema" or name == schema,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
        connection.commit()
    engine.dispose()
