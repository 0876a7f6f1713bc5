"""A service meets a schema of another release. Newer (a rolling upgrade ran the new
release's migrations, then a replica of the old one started again, or the code was rolled
back): it starts, its migrations having nothing to do; Alembic failed with "Can't locate
revision", a traceback, and the replica could not come back. Behind, where it does not
migrate on start (``CAIRN_MIGRATE_ON_START=false``, compose's replicas): it refuses to
start in one line saying what to run; it started, answered /readyz 200 and failed every
request on tables that were not there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from libs.common.settings import libpq_url
from services.core import migrate as core_migrate
from services.cron import migrate as cron_migrate
from services.dag import migrate as dag_migrate
from tests.support import free_port
from tests.support.migration_locks import ROOT, SCHEMAS, migration_env

MIGRATE = {"core": core_migrate, "cron": cron_migrate, "dag": dag_migrate}
NEWER = "9999_a_newer_release"


@pytest.mark.parametrize("service", ["core", "cron", "dag"])
def test_an_older_release_starts_beside_a_newer_schema(service: str, db_url: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(f"UPDATE {service}.alembic_version SET version_num = %s", (NEWER,))
        MIGRATE[service].upgrade(db_url)  # migrate on start
        MIGRATE[service].check(db_url)  # or not
        assert SCHEMAS[service].version(conn) == [(NEWER,)]


@pytest.mark.parametrize("service", ["core", "cron", "dag"])
def test_a_service_that_does_not_migrate_refuses_a_schema_behind_its_release(
    service: str, db_url: str, tmp_path: Path
) -> None:
    schema = SCHEMAS[service]
    schema.back(db_url)
    env = {
        **migration_env(attempts=1, backoff_s=0),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_DATABASE_URL": db_url,
        "CAIRN_MIGRATE_ON_START": "false",
        "CAIRN_LOG_FORMAT": "text",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", f"services.{service}", "--port", str(free_port())],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{service} started on a schema behind its release")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        f"{service} did not start: the database's {service} schema is at {schema.before},"
        f" this release needs {schema.head()}: run its migrations first"
    ) in done.stderr
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        assert schema.version(conn) == [(schema.before,)]  # nothing migrated


def test_a_database_never_migrated_is_refused_too(pg_server: object, tmp_path: Path) -> None:
    from libs.common.migrations import MigrationFailed

    url = pg_server.url  # type: ignore[attr-defined]
    empty = url.rsplit("/", 1)[0] + "/t_never_migrated"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS t_never_migrated")
        conn.execute("CREATE DATABASE t_never_migrated")
    try:
        with pytest.raises(MigrationFailed, match="schema is at no migration"):
            cron_migrate.check(empty)
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute("DROP DATABASE t_never_migrated")
