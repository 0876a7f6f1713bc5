"""A migration behind a long transaction: its statements wait at most the lock timeout
for a lock (so the queries queued behind its request wait no longer), it rolls back and
tries again, and it gives up naming the sessions that blocked it; its index builds, which
block nobody, wait out older transactions up to the index wait, leave nothing INVALID for
good, and neither outlive a killed run nor deadlock with a second one. Each run is a real
``migrate.upgrade`` process against the test's database, at ``0033_task_domains``:
``0034_task_indexes`` builds two indexes CONCURRENTLY, then drops an index of
``core.tasks`` (ACCESS EXCLUSIVE); ``0035_feed_owner`` after it builds one more, and
``0036_audit_key`` adds a column to ``core.audit`` and builds its unique index, and
``0037_token_kid`` adds one to ``core.tokens`` and builds its index; ``0038_retired_teams``
makes a table, ``0039_principal_disabled`` adds two columns to ``core.principals``,
``0040_deferral_indexes`` builds two indexes of ``core.tasks`` CONCURRENTLY, and
``0041_tasks_analyze`` sets its autovacuum analysis threshold."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from libs.common.settings import libpq_url
from tests.support.migration_locks import (
    LOCK_TIMEOUT_S,
    ROOT,
    SCHEMAS,
    migration_env,
    reaped,
    wait_for,
    waiting_on,
)

HEAD, BEFORE = "0041_tasks_analyze", "0033_task_domains"
CORE = SCHEMAS["core"]
INVALID = (
    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
    " JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE n.nspname = 'core' AND NOT i.indisvalid"
)
UPGRADE = (
    "import logging, sys; from services.core import migrate; "
    "logging.basicConfig(level=logging.INFO); migrate.upgrade(sys.argv[1])"
)


@pytest.fixture
def before(db_url: str) -> Iterator[str]:
    """The test's database one revision back, with three tasks in core.tasks."""
    CORE.back(db_url)
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


@pytest.fixture
def report(before: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A report's open transaction on a table no step of 0040 locks (REPEATABLE READ: its
    snapshot stays while it is idle, as it does while a long query runs)."""
    with psycopg.connect(libpq_url(before), application_name="report") as report:
        report.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT count(*) FROM core.workers")
        yield report


@contextmanager
def _build_waiting(
    before: str, report: psycopg.Connection[tuple[object, ...]]
) -> Iterator[tuple[psycopg.Connection[tuple[object, ...]], subprocess.Popen[str]]]:
    """A run (one try) whose index build waits for ``report``, and a connection beside."""
    with (
        psycopg.connect(libpq_url(before), autocommit=True) as watch,
        reaped(_migrate(before, attempts=1, backoff_s=0.05)) as run,
    ):
        blocker = report.info.backend_pid
        wait_for(lambda: waiting_on(watch, blocker), "the build waited for the report")
        yield watch, run


def _waiting(conn: psycopg.Connection[tuple[object, ...]], blocker: int) -> int:
    """The one session waiting behind ``blocker``."""
    [(pid,)] = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (blocker,)
    ).fetchall()
    assert isinstance(pid, int)
    return pid


def _migrate(
    db_url: str,
    attempts: int,
    backoff_s: float,
    *,
    cli: Path | None = None,
    index_wait_s: float = 600.0,
) -> subprocess.Popen[str]:
    """Core's ``migrate.upgrade`` in a process of its own; with ``cli`` (a home), the
    command ``cairn migrate`` (every service's) instead."""
    env = migration_env(attempts, backoff_s, index_wait_s)
    argv = [sys.executable, "-c", UPGRADE, db_url]
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
        with reaped(_migrate(before, attempts=40, backoff_s=0.05)) as run:
            wait_for(lambda: waiting_on(watch, blocker_pid), "the migration waited for its lock")
            # Behind the migration's ACCESS EXCLUSIVE request, an ordinary read queues;
            # without a lock timeout it would wait for the report (here: 5 s, then fail).
            reader.execute("SET statement_timeout = '5s'")
            assert reader.execute("SELECT count(*) FROM core.tasks").fetchone() == (3,)
            # answered while the report still holds its lock and the run still tries
            assert run.poll() is None
            assert CORE.version(watch) == [(BEFORE,)]  # a try that timed out left nothing
            blocker.commit()  # the report ends: the next try gets its lock
            _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        # what let the read through: the migration's request gave up at the lock timeout
        # (SQLSTATE 55P03), rolled back and tried again
        gave_up = f"waited over {LOCK_TIMEOUT_S:g} s for a lock (lock_timeout) and was rolled back"
        assert gave_up in err and "trying again" in err and f"pid {blocker_pid} " in err
        assert CORE.version(watch) == [(HEAD,)]
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
        assert CORE.version(watch) == [(BEFORE,)]
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
    # CONCURRENTLY wait for it, past the index wait: the build stops and leaves an
    # INVALID index, which the next run drops and builds again (IF NOT EXISTS alone would
    # keep it for good). A build that waited its bound is not tried again.
    url = libpq_url(before)
    with psycopg.connect(url, autocommit=True) as watch, psycopg.connect(url) as blocker:
        blocker.execute("LOCK TABLE core.tasks IN ROW EXCLUSIVE MODE")
        run = _migrate(before, attempts=3, backoff_s=0.05, index_wait_s=LOCK_TIMEOUT_S)
        _, err = run.communicate(timeout=60)
        assert run.returncode != 0, err
        assert "trying again" not in err
        assert "gave up after 1 attempt: building index core.ix_tasks_running_named" in err
        assert f"pid {blocker.info.backend_pid} (idle in transaction, xact " in err
        assert "raise CAIRN_MIGRATION_INDEX_WAIT_S, then try again" in err
        assert watch.execute(INVALID).fetchall() == [("ix_tasks_running_named",)]
        blocker.commit()
        run = _migrate(before, attempts=3, backoff_s=0.05)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert watch.execute(INVALID).fetchall() == []
        assert "an invalid index left by a build cut short" in err
        assert CORE.version(watch) == [(HEAD,)]


def test_an_index_build_waits_out_an_older_transaction_past_the_lock_timeout(
    before: str, report: psycopg.Connection[tuple[object, ...]]
) -> None:
    # CREATE INDEX CONCURRENTLY waits for every transaction older than it (the report),
    # whichever table it reads; that wait stalls nobody, so it is not cut short at the
    # lock timeout: one try, and it succeeds once the report ends.
    with _build_waiting(before, report) as (watch, run):
        time.sleep(LOCK_TIMEOUT_S * 10)  # ten lock timeouts, and the build still waits
        assert run.poll() is None
        assert waiting_on(watch, report.info.backend_pid)
        # meanwhile core.tasks is read and written as ever
        watch.execute("SET statement_timeout = '5s'")
        watch.execute("UPDATE core.tasks SET name = name || '-x' WHERE name = 't0'")
        assert watch.execute("SELECT count(*) FROM core.tasks").fetchone() == (3,)
        report.commit()
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert f"pid {report.info.backend_pid} 'report' (idle in transaction, xact " in err
        assert "waits for an older transaction to end" in err
        assert CORE.version(watch) == [(HEAD,)]
        assert watch.execute(
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname IN ('ix_tasks_running_named', 'pk_task_events')"
            " AND i.indisvalid"
        ).fetchone() == (2,)


def test_a_database_statement_timeout_does_not_cancel_an_index_build(
    before: str, report: psycopg.Connection[tuple[object, ...]]
) -> None:
    # A database's (or a role's) statement_timeout applies to every new session, the
    # migration's too: it cancelled the build waiting for the report after 50 ms (SQLSTATE
    # 57014). The migration's waits have bounds of their own; its session sets it to 0.
    name = sql.Identifier(conninfo_to_dict(libpq_url(before))["dbname"])
    with psycopg.connect(libpq_url(before), autocommit=True) as admin:
        for setting in ("statement_timeout", "idle_in_transaction_session_timeout"):
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET {} = '50ms'").format(name, sql.SQL(setting))
            )
    with (
        psycopg.connect(libpq_url(before), autocommit=True) as watch,
        reaped(_migrate(before, attempts=1, backoff_s=0.05)) as run,
    ):
        blocker = report.info.backend_pid
        waits = lambda: waiting_on(watch, blocker) or run.poll() is not None  # noqa: E731
        wait_for(waits, "the build waited for the report (or the run ended)")
        time.sleep(0.5)  # ten statement timeouts
        report.commit()
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert CORE.version(watch) == [(HEAD,)]
        assert watch.execute(INVALID).fetchall() == []


def test_a_run_killed_while_its_index_build_waits_ends_its_session(
    before: str, report: psycopg.Connection[tuple[object, ...]]
) -> None:
    # A run killed while its build waits for a report (a deploy that gave up on it, a
    # replaced pod): its session notices the client gone and ends, and with it the
    # migrations' advisory lock, instead of waiting on for the report (and holding up
    # the next run behind that lock). The build leaves an INVALID index, which the next
    # run drops and builds again.
    with _build_waiting(before, report) as (watch, run):
        session = _waiting(watch, report.info.backend_pid)
        run.kill()
        run.communicate()
        alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        wait_for(lambda: watch.execute(alive, (session,)).fetchone() == (0,), "session ended")
        assert watch.execute(INVALID).fetchall() == [("task_events_key",)]
        report.commit()
        run = _migrate(before, attempts=1, backoff_s=0.05)
        _, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert "an invalid index left by a build cut short" in err
        assert watch.execute(INVALID).fetchall() == []
        assert CORE.version(watch) == [(HEAD,)]


def test_a_second_run_waits_its_turn_without_deadlocking_the_first(
    before: str, tmp_path: Path
) -> None:
    # Two replicas migrating as they start. The first's index build on core.task_events
    # waits for a writer of that table; the second starts and waits for the first's
    # advisory lock; the writer ends, and the build then waits for every transaction
    # older than it. A second run waiting inside pg_advisory_lock was one: a deadlock,
    # which PostgreSQL broke by failing one of the runs.
    url, log = libpq_url(before), tmp_path / "second"
    with (
        psycopg.connect(url, autocommit=True) as watch,
        psycopg.connect(url) as writer,
        log.open("w") as stderr,
    ):
        writer.execute("LOCK TABLE core.task_events IN ROW EXCLUSIVE MODE")
        writer_pid = writer.info.backend_pid
        with reaped(_migrate(before, attempts=1, backoff_s=0.05)) as first:
            wait_for(lambda: waiting_on(watch, writer_pid), "the build waited for the writer")
            first_pid = _waiting(watch, writer_pid)
            second = subprocess.Popen(
                [sys.executable, "-c", UPGRADE, before],
                env=migration_env(attempts=1, backoff_s=0.05),
                cwd=ROOT,
                stderr=stderr,
                text=True,
            )
            with reaped(second):
                wait_for(
                    lambda: "waits its turn" in log.read_text() or waiting_on(watch, first_pid),
                    "the second run waited for the first",
                )
                writer.commit()
                _, err = first.communicate(timeout=60)
                second.wait(timeout=60)
    assert first.returncode == 0, err
    assert second.returncode == 0, log.read_text()
    with psycopg.connect(url, autocommit=True) as watch:
        assert CORE.version(watch) == [(HEAD,)]


def test_cairn_migrate_logs_its_steps_on_stderr_as_the_services_do(
    before: str, tmp_path: Path
) -> None:
    run = _migrate(before, attempts=1, backoff_s=0.05, cli=tmp_path)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    steps = [line for line in lines if line["logger"] == "alembic.runtime.migration"]
    assert {(s["level"], s["service"]) for s in steps} == {("info", "migrate")}
    assert any(f"Running upgrade {BEFORE} -> 0034_task_indexes" in s["message"] for s in steps)
