from __future__ import annotations

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from libs.common.settings import libpq_url
from services.core import migrate
from services.core.tables import SCHEMA, metadata


def test_migrations_build_exactly_the_models_schema(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "version_table_schema": SCHEMA,
                    "include_name": lambda name, kind, _: kind != "schema" or name == SCHEMA,
                    "compare_type": True,
                },
            )
            diff = compare_metadata(context, metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_migrating_twice_is_a_no_op(db_url: str) -> None:
    migrate.upgrade(db_url)
    with psycopg.connect(libpq_url(db_url)) as conn:
        assert conn.execute("SELECT version_num FROM core.alembic_version").fetchall() == [
            ("0003",)
        ]


def test_downgrade_then_upgrade_round_trips(db_url: str) -> None:
    from alembic import command

    command.downgrade(migrate.alembic_config(db_url), "base")
    with psycopg.connect(libpq_url(db_url)) as conn:
        left = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'core'"
        ).fetchall()
    assert left == [("alembic_version",)]
    migrate.upgrade(db_url)
    test_migrations_build_exactly_the_models_schema(db_url)
