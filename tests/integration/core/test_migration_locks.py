"""A migration behind a long transaction: its statements wait at most the lock timeout
for a lock (so the queries queued behind its request wait no longer), it rolls back and
tries again, and it gives up naming the sessions that blocked it. Each run is a real
``migrate.upgrade`` process against the test's database, at ``0033_task_domains``:
``0034_task_indexes`` builds two indexes CONCURRENTLY, then drops an index of
``core.tasks`` (ACCESS EXCLUSIVE); ``0035_feed_owner`` after it builds one more."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic import command

from libs.common.migrations import alembic_config
from libs.common.settings import libpq_url
from services.core import migrate as core_migrate

HEAD, BEFORE = "0035_feed_owner", "0033_task_domains"
LOCK_TIMEOUT_S = 0.2
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def before(db_url: str) -> Iterator[str]:
    """The test's database one revision back, with three tasks in core.tasks."""
    command.downgrade(alembic_config(core_migrate.MIGRATIONS, db_url), BEFORE)
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        for i in range(3):
            conn.execute(
                "INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri,"
                " artifact_sha256, cpu, memory_mb, max_attempts, backoff_cap_s,"
                " backoff_jitter, poison_after, state)"
                " VALUES ('alice', %s, 'default', 'task', 'file:///bin/true', %s, 1, 1, 3,"
                " 60, false, 3, 'waiting')",
                (f"t{i}", "0" * 64),
            )
    yield db_url


def _migrate(
    db_url: str, attempts: int, backoff_s: float, *, cli: Path | None = None
) -> subprocess.Popen[str]:
    """Core's ``migrate.upgrade`` in a process of its own; with ``cli`` (a home), the
    command ``cairn migrate`` (every service's) instead."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_MIGRATION_LOCK_TIMEOUT_S": str(LOCK_TIMEOUT_S),
        "CAIRN_MIGRATION_LOCK_ATTEMPTS": str(attempts),
        "CAIRN_MIGRATION_LOCK_BACKOFF_S": str(backoff_s),
    }
    code = "import logging, sys; from services.core import migrate; "
    code += "logging.basicConfig(level=logging.INFO); migrate.upgrade(sys.argv[1])"
    argv = [sys.executable, "-c", code, db_url]
    if cli is not None:
        env |= {"CAIRN_DATABASE_URL": db_url, "CAIRN_HOME": str(cli)}
        argv = [sys.executable, "-m", "cairn", "migrate"]
    return subprocess.Popen(
        argv,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _waiting_on(conn: psycopg.Connection[tuple[object, ...]], blocker: int) -> bool:
    """Whether some session waits for a lock behind ``blocker``."""
    found = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
        (blocker,),
    ).fetchone()
    return bool(found and found[0])


def _wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the migration never waited for its lock"
        time.sleep(0.01)


def _version(conn: psycopg.Connection[tuple[object, ...]]) -> object:
    return conn.execute("SELECT version_num FROM core.alembic_version").fetchall()


def test_a_blocked_migration_lets_core_tasks_serve_and_completes_after(before: str) -> None:
    url = libpq_url(before)
    with (
        psycopg.connect(url, autocommit=True) as watch,
        psycopg.connect(url, autocommit=True) as reader,
        psycopg.connect(url) as blocker,
    ):
        rows = watch.execute("SELECT * FROM core.tasks ORDER BY id").fetchall()
        blocker.execute("LOCK TABLE core.tasks IN ACCESS SHARE MODE")  # a long report
        blocker_pid = blocker.info.backend_pid
        run = _migrate(before, attempts=40, backoff_s=0.05)
        try:
            _wait_for(lambda: _waiting_on(watch, blocker_pid))
            # Behind the migration's ACCESS EXCLUSIVE request, an ordinary read queues;
            # without a lock timeout it would wait for the report (here: 5 s, then fail).
            reader.execute("SET statement_timeout = '5s'")
            started = time.monotonic()
            assert reader.execute("SELECT count(*) FROM core.tasks").fetchone() == (3,)
            assert time.monotonic() - started < LOCK_TIMEOUT_S + 1.0
            assert _version(watch) == [(BEFORE,)]  # a try that timed out left nothing
            blocker.commit()  # the report ends: the next try gets its lock
            _, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
        assert run.returncode == 0, err
        assert "trying again" in err and f"pid {blocker_pid} " in err
        assert _version(watch) == [(HEAD,)]
        assert watch.execute("SELECT * FROM core.tasks ORDER BY id").fetchall() == rows


def test_a_blocker_that_never_ends_fails_the_run_naming_it(before: str, tmp_path: Path) -> None:
    url = libpq_url(before)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as blocker:
        blocker.execute("SELECT count(*) FROM core.tasks")
        blocker.execute("LOCK TABLE core.tasks IN ACCESS SHARE MODE")
        run = _migrate(before, attempts=3, backoff_s=0.05, cli=tmp_path)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 1, err
        last = err.strip().splitlines()[-1]  # the message alone, no traceback
        assert "gave up after 3 attempts" in last
        assert f"pid {blocker.info.backend_pid} (idle in transaction, xact " in last
        assert "'LOCK TABLE core.tasks IN ACCESS SHARE MODE'" in last
        assert err.count("trying again") == 2
        assert _version(watch) == [(BEFORE,)]
        # what the last try had done in its transaction before it waited (the new primary
        # key of core.task_events, in place of these two) is rolled back
        assert watch.execute(
            "SELECT conname, pg_get_indexdef(conindid) FROM pg_constraint"
            " WHERE conrelid = 'core.task_events'::regclass AND contype IN ('p', 'u')"
            " ORDER BY conname"
        ).fetchall() == [
            (
                "pk_task_events",
                "CREATE UNIQUE INDEX pk_task_events ON core.task_events USING btree (id)",
            ),
            (
                "uq_task_events_task_id_seq",
                "CREATE UNIQUE INDEX uq_task_events_task_id_seq ON core.task_events"
                " USING btree (task_id, seq)",
            ),
        ]
        blocker.rollback()


def test_an_index_build_cut_short_is_built_again_valid(before: str) -> None:
    # A writer's open transaction (ROW EXCLUSIVE on core.tasks) makes CREATE INDEX
    # CONCURRENTLY wait for it, past the lock timeout: the build stops and leaves an
    # INVALID index, which the next try drops and builds again (IF NOT EXISTS alone would
    # keep it for good).
    url = libpq_url(before)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as blocker:
        blocker.execute("LOCK TABLE core.tasks IN ROW EXCLUSIVE MODE")
        run = _migrate(before, attempts=3, backoff_s=0.05)
        _, err = run.communicate(timeout=60)
        assert run.returncode != 0, err
        invalid = (
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'core' AND NOT i.indisvalid"
        )
        assert watch.execute(invalid).fetchall() == [("ix_tasks_running_named",)]
        blocker.commit()
        run = _migrate(before, attempts=3, backoff_s=0.05)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert watch.execute(invalid).fetchall() == []
        assert "an invalid index left by a build cut short" in err
        assert _version(watch) == [(HEAD,)]
