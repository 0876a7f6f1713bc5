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
from libs.common.states import FINAL, TaskState
from services.core import migrate as core_migrate
from services.core.db import tables as core_tables
from services.cron import migrate as cron_migrate
from services.cron import tables as cron_tables
from services.dag import migrate as dag_migrate
from services.dag import tables as dag_tables

# (schema, its tables, its migrate module, its newest revision)
SERVICES = [
    pytest.param(
        core_tables.SCHEMA, core_tables.metadata, core_migrate, "0034_task_indexes", id="core"
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


#: the revision of 0033_hot_states and the one before it
HOT, HOT_BEFORE = "0027_hot_states", "0024_fairshare"


def test_hot_states_keeps_every_row_and_sets_the_fill_factor(db_url: str) -> None:
    # 0033_hot_states on a database with a task (and an attempt) in every state: no row
    # moves or changes; core.attempts gets its fill factor, and the downgrade resets it.
    config = alembic_config(core_migrate.MIGRATIONS, db_url)
    command.downgrade(config, HOT_BEFORE)
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        [(worker,)] = conn.execute(
            "INSERT INTO core.workers (principal, hostname, queues, cpu, memory_mb)"
            " VALUES ('w', 'h', '{default}', 1, 1) RETURNING id"
        )
        for i, state in enumerate(TaskState):
            final = state in FINAL
            [(task,)] = conn.execute(
                "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri,"
                " artifact_sha256, cpu, memory_mb, max_attempts, backoff_cap_s,"
                " backoff_jitter, poison_after, state, finished_at, current_attempt_id)"
                " VALUES ('alice', %s, 'default', 'task', 'file:///bin/true', %s, 1, 1, 3,"
                " 60, false, 3, %s, CASE WHEN %s THEN now() END, %s) RETURNING id",
                (f"t{i}", "0" * 64, state.value, final, 1000 + i),
            )
            running = state is TaskState.RUNNING
            conn.execute(
                "INSERT INTO core.attempts (task_id, number, worker_id, outcome, ended_at)"
                " VALUES (%s, 1, %s, %s, CASE WHEN %s THEN NULL ELSE now() END)",
                (task, worker, None if running else "succeeded", running),
            )

        def rows() -> list[tuple[object, ...]]:
            return conn.execute(
                "SELECT (SELECT string_agg(t::text, '|' ORDER BY id) FROM core.tasks t),"
                " (SELECT string_agg(a::text, '|' ORDER BY id) FROM core.attempts a)"
            ).fetchall()

        def options() -> object:
            found = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = 'core.attempts'::regclass"
            ).fetchone()
            return found[0] if found else None

        states = conn.execute("SELECT DISTINCT state FROM core.tasks").fetchall()
        assert {s for (s,) in states} == {s.value for s in TaskState}
        before = rows()
        command.upgrade(config, HOT)
        assert (rows(), options()) == (before, ["fillfactor=80"])
        command.downgrade(config, HOT_BEFORE)
        assert (rows(), options()) == (before, None)
