"""Alembic environment of core's schema; the URL comes from the caller's config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from services.core.tables import SCHEMA, metadata

_LOCK_KEY = 0x0CA1_C0DE


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set"
    engine = create_engine(url)
    with engine.connect() as connection:
        # Replicas starting together take turns; the loser then finds nothing to do.
        connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _LOCK_KEY})
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        connection.commit()
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema=SCHEMA,
            include_schemas=True,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _LOCK_KEY})
        connection.commit()
    engine.dispose()


run_migrations_online()
