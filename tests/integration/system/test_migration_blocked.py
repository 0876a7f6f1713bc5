"""Every service's migrations behind a long transaction, in real processes against the
test's database: cron's and dag's runner, like core's (tests/integration/core/
test_migration_locks.py), times out, tries again and completes once the blocker ends; and
a service's start (``python -m services.X``, ``cairn up``), or a command that migrates
first (``cairn token create --db``), that gives up says so in one message naming the
blocker and what to do, and exits 1, without a traceback; as does one whose database
server refuses it, in a line naming the server and the error."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.exc import DBAPIError

from libs.common import migrations
from libs.common.settings import libpq_url
from tests.support import free_port
from tests.support.migration_locks import ROOT, SCHEMAS, migration_env, reaped, wait_for


@pytest.mark.parametrize("service", ["cron", "dag"])
def test_a_blocked_migration_tries_again_and_completes_once_the_blocker_ends(
    service: str, db_url: str, tmp_path: Path
) -> None:
    schema = SCHEMAS[service]
    schema.back(db_url)
    url, log = libpq_url(db_url), tmp_path / "stderr"
    code = f"import logging, sys; from services.{service} import migrate; "
    code += "logging.basicConfig(level=logging.INFO); migrate.upgrade(sys.argv[1])"
    with (
        psycopg.connect(url, autocommit=True) as watch,
        psycopg.connect(url) as blocker,
        log.open("w") as stderr,
    ):
        blocker.execute(f"LOCK TABLE {schema.table} IN ACCESS SHARE MODE")  # a long report
        blocker_pid = blocker.info.backend_pid
        with reaped(
            subprocess.Popen(
                [sys.executable, "-c", code, db_url],
                env=migration_env(attempts=40, backoff_s=0.05),
                cwd=ROOT,
                stderr=stderr,
                text=True,
            )
        ) as run:
            wait_for(lambda: log.read_text().count("trying again") >= 2, "two timed-out tries")
            assert schema.version(watch) == [(schema.before,)]  # each rolled back
            blocker.commit()
            run.wait(timeout=60)
    err = log.read_text()
    assert run.returncode == 0, err
    assert f"pid {blocker_pid} (idle in transaction, xact " in err
    with psycopg.connect(url, autocommit=True) as watch:
        assert schema.version(watch) == [(schema.head(),)]


#: the commands that migrate every schema before they do their work (core's first)
COMMANDS = {
    "up": ["-m", "cairn", "up"],
    "token": ["-m", "cairn", "token", "create", "boot", "--db", "--role", "admin"],
}


@pytest.mark.parametrize("service", ["core", "cron", "dag", *COMMANDS])
def test_a_start_that_a_migration_gives_up_on_exits_1_with_one_message(
    service: str, db_url: str, tmp_path: Path
) -> None:
    schema = SCHEMAS.get(service, SCHEMAS["core"])
    schema.back(db_url)
    ports = {f"CAIRN_{name.upper()}_PORT": str(free_port()) for name in SCHEMAS}
    env = migration_env(attempts=2, backoff_s=0.05) | ports
    env |= {
        "CAIRN_DATABASE_URL": db_url,
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_LOG_FORMAT": "text",
    }
    argv = COMMANDS.get(service, ["-m", f"services.{service}"])
    url = libpq_url(db_url)
    with (
        psycopg.connect(url, autocommit=True) as watch,
        psycopg.connect(url, application_name="nightly-report") as blocker,
    ):
        blocker.execute(f"LOCK TABLE {schema.table} IN ACCESS SHARE MODE")
        run = subprocess.run(
            [sys.executable, *argv],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 1, run.stderr
        assert "Traceback" not in run.stderr
        [message] = [line for line in run.stderr.splitlines() if "gave up" in line]
        assert f"migrations of {schema.name} gave up after 2 attempts" in message
        assert (
            f"pid {blocker.info.backend_pid} 'nightly-report' (idle in transaction, xact "
            in message
        )
        assert ", query started 20" in message and " UTC): 'LOCK TABLE " in message
        assert "pg_terminate_backend" in message
        assert "raise CAIRN_MIGRATION_LOCK_TIMEOUT_S or CAIRN_MIGRATION_LOCK_ATTEMPTS" in message
        assert schema.version(watch) == [(schema.before,)]
        blocker.rollback()


@pytest.mark.parametrize("command", ["migrate", "core"])
def test_a_migration_whose_server_refuses_exits_1_with_one_line(
    command: str, tmp_path: Path
) -> None:
    # Nobody listens on the port: the connection is refused. ``cairn migrate`` and a
    # service's start say so in one line naming the server, not its password.
    port = free_port()
    env = {
        **migration_env(attempts=2, backoff_s=0.05),
        "CAIRN_DATABASE_URL": f"postgresql://cairn:s3cret-pw@127.0.0.1:{port}/cairn",
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_LOG_FORMAT": "text",
        "CAIRN_CORE_PORT": str(free_port()),
    }
    argv = ["-m", "cairn", "migrate"] if command == "migrate" else ["-m", "services.core"]
    run = subprocess.run(
        [sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "s3cret" not in run.stderr, run.stderr
    # besides it, only info lines (alembic's plugins, loaded as it starts)
    [line] = [line for line in run.stderr.splitlines() if " INFO " not in line]
    assert f"the database server at 127.0.0.1:{port}" in line and "refused" in line, line


def test_a_migration_whose_server_answers_nothing_gives_up_at_its_connect_timeout(
    tmp_path: Path,
) -> None:
    # A listening socket whose backlog is full drops every SYN, as a host that vanished
    # or a firewall does: without a connect timeout, the run waited until its
    # tcp_user_timeout (10 s; the kernel's two minutes of SYN retries where there is
    # none) and said the server closed the connection; with it, 5 s, and says so.
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        port = server.getsockname()[1]
        held = []
        while True:  # fill the backlog until a connection is no longer answered
            client = socket.socket()
            client.settimeout(0.5)
            try:
                client.connect(("127.0.0.1", port))
            except TimeoutError:
                client.close()
                break
            held.append(client)
        env = {
            **migration_env(attempts=2, backoff_s=0.05),
            "CAIRN_DATABASE_URL": f"postgresql://cairn:s3cret-pw@127.0.0.1:{port}/cairn",
            "CAIRN_HOME": str(tmp_path / "home"),
            "CAIRN_LOG_FORMAT": "text",
        }
        try:
            run = subprocess.run(
                [sys.executable, "-m", "cairn", "migrate"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            for client in held:
                client.close()
    assert run.returncode == 1, run.stderr
    [line] = [line for line in run.stderr.splitlines() if " INFO " not in line]
    assert f"the database server at 127.0.0.1:{port}: connection timeout expired" in line, line


def _migrations(tmp_path: Path, statement: str) -> Path:
    """A schema's migrations whose one migration runs ``statement``."""
    where = tmp_path / "bugged" / "migrations"
    (where / "versions").mkdir(parents=True)
    (where / "env.py").write_text(
        "from sqlalchemy import MetaData\n"
        "from libs.common.migrations import run_online\n"
        "run_online('bugged', MetaData())\n"
    )
    (where / "versions" / "0001_bug.py").write_text(
        "from alembic import op\n"
        "revision = '0001_bug'\n"
        "down_revision = None\n"
        "def upgrade() -> None:\n"
        "    op.execute('CREATE SEQUENCE bugged.seq')\n"
        f"    op.execute({statement!r})\n"
    )
    return where


def test_a_bug_in_a_migration_that_postgres_classes_operational_stays_its_error(
    db_url: str, tmp_path: Path
) -> None:
    # currval before nextval: SQLSTATE 55000, which psycopg raises as an OperationalError
    # (as 54xxx, 55006, 40P01): a bug of the migration's, whose traceback is what its
    # author needs, not a one-line "database server at ..." as if the server were lost.
    where = _migrations(tmp_path, "SELECT currval('bugged.seq')")
    with pytest.raises(DBAPIError) as raised:
        migrations.upgrade(where, db_url)
    assert getattr(raised.value.orig, "sqlstate", None) == "55000"


def test_a_migration_an_admin_cancels_stops_saying_so(db_url: str, tmp_path: Path) -> None:
    # pg_cancel_backend (SQLSTATE 57014): one line, as the run's other ends, but saying
    # its statement was cancelled, not that the server was lost.
    where = _migrations(tmp_path, "SELECT pg_sleep(120)")
    failed: list[BaseException] = []

    def run() -> None:
        try:
            migrations.upgrade(where, db_url)
        except BaseException as exc:  # kept for the asserts below
            failed.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    with psycopg.connect(libpq_url(db_url), autocommit=True) as admin:
        sleeping = "SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(120)'"
        wait_for(lambda: admin.execute(sleeping).fetchone() is not None, "the migration runs")
        admin.execute(f"SELECT pg_cancel_backend(pid) FROM ({sleeping}) AS s")
    runner.join(timeout=60)
    [error] = failed
    assert isinstance(error, migrations.MigrationFailed), repr(error)
    assert not isinstance(error, migrations.ServerLost), error
    assert "was cancelled" in str(error) and "canceling statement due to user request" in str(
        error
    ), error
