"""Every service's migrations behind a long transaction, in real processes against the
test's database: cron's and dag's runner, like core's (tests/integration/core/
test_migration_locks.py), times out, tries again and completes once the blocker ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from libs.common.settings import libpq_url
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
