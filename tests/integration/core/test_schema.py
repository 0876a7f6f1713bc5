"""Each service's migrations build exactly its tables, migrate idempotently, and round-trip
a downgrade."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, create_engine

from libs.common import migrations
from libs.common.migrations import alembic_config
from libs.common.schema import Domain
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
        core_tables.SCHEMA, core_tables.metadata, core_migrate, "0041_tasks_analyze", id="core"
    ),
    pytest.param(
        cron_tables.SCHEMA, cron_tables.metadata, cron_migrate, "cron_0004_changed_by", id="cron"
    ),
    pytest.param(dag_tables.SCHEMA, dag_tables.metadata, dag_migrate, "0009_events", id="dag"),
]


def _diff(db_url: str, schema: str, metadata: MetaData) -> list[object]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn, warnings.catch_warnings():
            # SQLAlchemy's reflection of an index on a column of a domain
            # (``ix_tasks_waiting``: ``priority DESC``) asks its own DOMAIN type for an
            # operator that type does not declare (libs.common.schema.Domain does)
            warnings.filterwarnings(
                "ignore", "Type object <class 'sqlalchemy.dialects.postgresql.named_types.DOMAIN'>"
            )
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


def test_a_server_that_refuses_the_client_check_still_migrates(
    db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    command.downgrade(alembic_config(cron_migrate.MIGRATIONS, db_url), "cron_0003_teams")
    # PostgreSQL without POLLRDHUP (macOS, Windows) refuses any client check but 0 with
    # SQLSTATE 22023 (invalid_parameter_value); here a value out of range gets the same
    monkeypatch.setattr(migrations, "_CLIENT_CHECK", "-1")
    monkeypatch.setattr(migrations, "_told_no_client_check", threading.Event(), raising=False)
    with caplog.at_level(logging.INFO, logger="cairn.migrations"):
        cron_migrate.upgrade(db_url)
        core_migrate.upgrade(db_url)
    with psycopg.connect(libpq_url(db_url)) as conn:
        found = conn.execute("SELECT version_num FROM cron.alembic_version").fetchall()
    assert found == [("cron_0004_changed_by",)]
    told = [r.getMessage() for r in caplog.records if "check_interval refused" in r.getMessage()]
    assert len(told) == 1, told  # once a process
    assert "outside the valid range" in told[0]


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


#: the revision of 0039_task_domains and the one before it
DOMAINS, DOMAINS_BEFORE = "0033_task_domains", "0032_source_handbacks"

#: a task's columns and values every rule of core.tasks lets through (a waiting task)
_TASK = {
    "owner": "'alice'",
    "name": "'t'",
    "queue": "'default'",
    "kind": "'task'",
    "artifact_uri": "'file:///bin/true'",
    "artifact_sha256": f"'{'0' * 64}'",
    "cpu": "1",
    "memory_mb": "1",
    "max_attempts": "3",
    "backoff_cap_s": "60",
    "backoff_jitter": "false",
    "poison_after": "3",
    "state": "'waiting'",
}

#: each rule of core.tasks (its name after ``ck_tasks_``) and a value it refuses
_REFUSED = [
    ("state", {"state": "'lost'"}),
    ("kind", {"kind": "'job'"}),
    ("priority_range", {"priority": "101"}),
    ("priority_range", {"priority": "-101"}),
    ("max_attempts_positive", {"max_attempts": "0"}),
    ("poison_after_positive", {"poison_after": "0"}),
    ("poison_window_positive", {"poison_window_s": "0"}),
    ("counts_non_negative", {"attempts": "-1"}),
    ("counts_non_negative", {"crashes": "-1"}),
    ("source_handbacks_non_negative", {"source_handbacks": "-1"}),
    ("resources_positive", {"cpu": "0"}),
    ("resources_positive", {"memory_mb": "0"}),
    ("disk_positive", {"disk_mb": "0"}),
    ("timeout_positive", {"timeout_s": "0"}),
    ("progress_timeout_positive", {"progress_timeout_s": "0"}),
    ("concurrency_limit_positive", {"concurrency_limit": "0"}),
    ("artifact_credentials", {"artifact_credentials": "'[]'"}),
    ("final_has_finished_at", {"state": "'succeeded'"}),
    ("final_has_finished_at", {"finished_at": "now()"}),
    ("running_has_attempt", {"state": "'running'"}),
    ("required_placed", {"required": "'{}'"}),
    ("service_kind", {"service": "'{}'"}),
]


def _refused_by(conn: psycopg.Connection[tuple[object, ...]], sql: str) -> str | None:
    """The constraint that refused ``sql`` (None: nothing refused it)."""
    try:
        with conn.transaction():
            conn.execute(sql)  # type: ignore[arg-type]
            raise _Kept
    except psycopg.errors.CheckViolation as e:
        return e.diag.constraint_name
    except _Kept:
        return None


class _Kept(Exception):
    """Rolls a statement's transaction back when nothing refused it."""


@pytest.mark.parametrize(("rule", "values"), _REFUSED, ids=[r for r, _ in _REFUSED])
def test_every_task_rule_refuses_a_bad_value_by_its_name(
    db: psycopg.Connection[tuple[object, ...]], rule: str, values: dict[str, str]
) -> None:
    # an INSERT and an UPDATE setting the value: refused, and the error names the rule
    row = {**_TASK, **values}
    [(task,)] = db.execute(
        f"INSERT INTO core.tasks ({', '.join(_TASK)}) VALUES ({', '.join(_TASK.values())})"
        " RETURNING id"
    )
    insert = f"INSERT INTO core.tasks ({', '.join(row)}) VALUES ({', '.join(row.values())})"
    sets = ", ".join(f"{column} = {value}" for column, value in values.items())
    update = f"UPDATE core.tasks SET {sets} WHERE id = {task}"
    assert (_refused_by(db, insert), _refused_by(db, update)) == (f"ck_tasks_{rule}",) * 2


def test_a_task_move_meets_only_the_rules_of_several_columns(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    # PostgreSQL runs every CHECK of a table at each UPDATE of a row, planned afresh: the
    # rules on one column are their domains' checks, run only where the column is set
    table = db.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = 'core.tasks'::regclass"
        " AND contype = 'c' ORDER BY conname"
    ).fetchall()
    assert [name for (name,) in table] == [
        "ck_tasks_final_has_finished_at",
        "ck_tasks_required_placed",
        "ck_tasks_running_has_attempt",
        "ck_tasks_service_kind",
    ]
    domains = db.execute(
        "SELECT t.typname, c.conname FROM pg_constraint c JOIN pg_type t ON t.oid = c.contypid"
        " WHERE t.typnamespace = 'core'::regnamespace ORDER BY t.typname"
    ).fetchall()
    assert len(domains) == 16
    assert ("tasks_max_attempts", "ck_tasks_max_attempts_positive") in domains


def test_task_domains_rewrite_no_row_and_keep_every_one(db_url: str) -> None:
    # 0039_task_domains on a database with a task in every state, a service and a placed
    # task with every column of a nullable rule set: the table keeps its file
    # (no row is rewritten; the partial indexes on ``state`` are built again) and every
    # row, both ways and up again.
    config = alembic_config(core_migrate.MIGRATIONS, db_url)
    command.downgrade(config, DOMAINS_BEFORE)
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        for i, state in enumerate(TaskState):
            conn.execute(
                "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri,"
                " artifact_sha256, cpu, memory_mb, max_attempts, backoff_cap_s,"
                " backoff_jitter, poison_after, state, finished_at, current_attempt_id,"
                " artifact_credentials)"
                " VALUES ('alice', %s, 'default', 'task', 'file:///bin/true', %s, 1, 1, 3,"
                " 60, false, 3, %s, CASE WHEN %s THEN now() END, %s, '{}')",
                (f"t{i}", "0" * 64, state.value, state in FINAL, 1000 + i),
            )
        # a running service, and a placed task with every nullable rule's column set
        conn.execute(
            "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,"
            " cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after, state,"
            " current_attempt_id, service, priority)"
            " VALUES ('alice', 's', 'default', 'service', 'file:///bin/true', %s, 0.25, 64, 3,"
            ' 60, false, 3, \'running\', 2000, \'{"ports": [{"name": "http"}]}\', -100)',
            ("0" * 64,),
        )
        conn.execute(
            "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,"
            " cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after, state,"
            " placement, required, disk_mb, timeout_s, progress_timeout_s, concurrency_key,"
            " concurrency_limit, attempts, crashes, source_handbacks, priority)"
            " VALUES ('alice', 'p', 'default', 'task', 'file:///bin/true', %s, 2, 512, 5, 60,"
            " true, 2, 'waiting', '{\"require\": {\"zone\": \"a\"}}', '[]', 100, 60, 30,"
            " 'k', 1, 2, 1, 1, 100)",
            ("0" * 64,),
        )

        def files() -> list[tuple[object, ...]]:
            return conn.execute(
                "SELECT relname, relfilenode FROM pg_class"
                " WHERE oid IN ('core.tasks'::regclass, 'core.pk_tasks'::regclass)"
                " ORDER BY relname"
            ).fetchall()

        def rows() -> object:
            return conn.execute("SELECT string_agg(t::text, '|' ORDER BY id) FROM core.tasks t")

        before = (files(), rows().fetchall())
        command.upgrade(config, DOMAINS)
        assert (files(), rows().fetchall()) == before
        command.downgrade(config, DOMAINS_BEFORE)
        assert (files(), rows().fetchall()) == before
        command.upgrade(config, DOMAINS)  # and up again
        assert (files(), rows().fetchall()) == before


def test_task_domains_keep_the_planner_statistics(db_url: str) -> None:
    # ALTER COLUMN ... TYPE drops what ANALYZE knew of each column it changes, even when no
    # row is rewritten: without it the planner guesses (``state = 'waiting'``: 0.5 % of the
    # rows) until autovacuum's next analyze, which waits for a tenth of the table to change,
    # and a turn's statements keep the generic plans made meanwhile. The migration analyses
    # what it changed, both ways.
    config = alembic_config(core_migrate.MIGRATIONS, db_url)
    command.downgrade(config, DOMAINS_BEFORE)
    ruled = [c.name for c in core_tables.tasks.c if isinstance(c.type, Domain)]
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256,"
            " cpu, memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after, state,"
            " priority) SELECT 'alice', 't' || i, 'default', 'task', 'file:///bin/true', %s,"
            " 1, 1, 3, 60, false, 3, CASE WHEN i %% 10 = 0 THEN 'ready' ELSE 'waiting' END,"
            " i %% 5 FROM generate_series(1, 200) i",
            ("0" * 64,),
        )
        conn.execute("ANALYZE core.tasks")

        def known() -> list[str]:
            found = conn.execute(
                "SELECT attname FROM pg_stats WHERE schemaname = 'core'"
                " AND tablename = 'tasks' AND attname = ANY(%s) ORDER BY attname",
                (ruled,),
            )
            return [name for (name,) in found]

        assert known() == sorted(ruled)
        command.upgrade(config, DOMAINS)
        assert known() == sorted(ruled)
        command.downgrade(config, DOMAINS_BEFORE)
        assert known() == sorted(ruled)


def test_a_new_install_leaves_core_tasks_never_analysed(
    db: psycopg.Connection[tuple[object, ...]],
) -> None:
    # The migration analyses again only what had statistics: a new install's empty table,
    # analysed, would be taken at its true size as it grows instead of at ten pages at
    # least (PostgreSQL's guess for a table never analysed), and sequential scans planned.
    [(tuples, known)] = db.execute(
        "SELECT reltuples, (SELECT count(*) FROM pg_stats WHERE schemaname = 'core'"
        " AND tablename = 'tasks') FROM pg_class WHERE oid = 'core.tasks'::regclass"
    )
    assert (tuples, known) == (-1, 0)
