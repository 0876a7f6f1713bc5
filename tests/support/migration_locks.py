"""What the migration lock tests share: each service's schema one migration back (the
next one takes an exclusive lock on ``table``), the environment that gives a run short
bounds, and waits on what the database shows."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from alembic import command
from alembic.script import ScriptDirectory

from libs.common.migrations import alembic_config
from services.core import migrate as core_migrate
from services.cron import migrate as cron_migrate
from services.dag import migrate as dag_migrate

ROOT = Path(__file__).resolve().parents[2]
LOCK_TIMEOUT_S = 0.2


@dataclass(frozen=True)
class Schema:
    migrations: Path
    name: str
    #: a revision whose next migration locks ``table`` ACCESS EXCLUSIVE
    before: str
    table: str

    def back(self, db_url: str) -> None:
        command.downgrade(alembic_config(self.migrations, db_url), self.before)

    def head(self) -> str | None:
        config = alembic_config(self.migrations, "postgresql://unused")
        return ScriptDirectory.from_config(config).get_current_head()

    def version(self, conn: psycopg.Connection[tuple[object, ...]]) -> object:
        return conn.execute(f"SELECT version_num FROM {self.name}.alembic_version").fetchall()


SCHEMAS = {
    # 0040_task_indexes drops an index of core.tasks
    "core": Schema(core_migrate.MIGRATIONS, "core", "0033_task_domains", "core.tasks"),
    # cron_0004_changed_by adds a column to cron.schedules
    "cron": Schema(cron_migrate.MIGRATIONS, "cron", "cron_0003_teams", "cron.schedules"),
    # 0009_events adds columns to dag.nodes
    "dag": Schema(dag_migrate.MIGRATIONS, "dag", "0008_subflows", "dag.nodes"),
}


def migration_env(attempts: int, backoff_s: float, index_wait_s: float = 600.0) -> dict[str, str]:
    """The environment of a process that migrates, with short bounds."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_MIGRATION_LOCK_TIMEOUT_S": str(LOCK_TIMEOUT_S),
        "CAIRN_MIGRATION_LOCK_ATTEMPTS": str(attempts),
        "CAIRN_MIGRATION_LOCK_BACKOFF_S": str(backoff_s),
        "CAIRN_MIGRATION_INDEX_WAIT_S": str(index_wait_s),
    }


def waiting_on(conn: psycopg.Connection[tuple[object, ...]], blocker: int) -> bool:
    """Whether some session waits for a lock behind ``blocker``."""
    found = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
        (blocker,),
    ).fetchone()
    return bool(found and found[0])


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@contextmanager
def reaped(run: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``run``, killed and waited for if it still runs when the block is left."""
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
