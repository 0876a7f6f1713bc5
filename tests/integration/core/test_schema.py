"""Each service's migrations build exactly its tables, migrate idempotently, and round-trip
a downgrade."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, create_engine

from libs.common.migrations import alembic_config
from libs.common.settings import libpq_url
from services.core import migrate as core_migrate
from services.core.db import tables as core_tables
from services.cron import migrate as cron_migrate
from services.cron import tables as cron_tables
from services.dag import migrate as dag_migrate
from services.dag import tables as dag_tables

# (schema, its tables, its migrate module, its newest revision)
SERVICES = [
    pytest.param(
        core_tables.SCHEMA, core_tables.metadata, core_migrate, "0026_services", id="core"
    ),
    pytest.param(
        cron_tables.SCHEMA, cron_tables.metadata, cron_migrate, "cron_0004_changed_by", id="cron"
    ),
    pytest.param(dag_tables.SCHEMA, dag_tables.metadata, dag_migrate, "0009_events", id="dag"),
]


def _diff(db_url: str, schema: str, metadata: MetaData) -> list[object]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "version_table_schema": schema,
                    "include_name": lambda name, kind, _: kind != "schema" or name == schema,
                    "compare_type": True,
                },
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


@pytest.mark.parametrize(("schema", "metadata", "migrate", "head"), SERVICES)
def test_migrations_build_exactly_the_models_schema(
    db_url: str, schema: str, metadata: MetaData, migrate: ModuleType, head: str
) -> None:
    assert _diff(db_url, schema, metadata) == []


@pytest.mark.parametrize(("schema", "metadata", "migrate", "head"), SERVICES)
def test_migrating_twice_is_a_no_op(
    db_url: str, schema: str, metadata: MetaData, migrate: ModuleType, head: str
) -> None:
    migrate.upgrade(db_url)
    with psycopg.connect(libpq_url(db_url)) as conn:
        found = conn.execute(f"SELECT version_num FROM {schema}.alembic_version").fetchall()
    assert found == [(head,)]


@pytest.mark.parametrize(("schema", "metadata", "migrate", "head"), SERVICES)
def test_downgrade_then_upgrade_round_trips(
    db_url: str, schema: str, metadata: MetaData, migrate: ModuleType, head: str
) -> None:
    location: Path = migrate.MIGRATIONS
    command.downgrade(alembic_config(location, db_url), "base")
    with psycopg.connect(libpq_url(db_url)) as conn:
        left = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (schema,),
        ).fetchall()
    assert left == [("alembic_version",)]
    migrate.upgrade(db_url)
    assert _diff(db_url, schema, metadata) == []
