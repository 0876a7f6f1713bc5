"""``core.tasks`` is analysed after 5,000 changed rows, however large (migration
``0047_tasks_analyze``): a backlog that arrives on a table of finished tasks gets
statistics that know of it at autovacuum's next look, not once a tenth of the table has
changed. On a server of the test's own (autovacuum looks every second there), a table of
100,000 finished tasks analysed, then 6,000 waiting: under PostgreSQL's default (10,050
rows here) nothing would analyse it, and the promoter's next-due look walks every
waiting task's index entry; analysed, it reads none."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from services.core import migrate
from services.core.db import tasks as tasks_db
from tests.support.plans import analyzed, insert_tasks, rows_read

FINISHED, BACKLOG = 100_000, 6_000
DB = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def db() -> Iterator[DB]:
    root = Path(tempfile.mkdtemp(prefix="cairn-analyze-"))
    server = EmbeddedPostgres(root / "pg", fast=True)
    try:
        url = server.start()
        migrate.upgrade(url)
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET autovacuum_naptime = 1")
            conn.execute("SELECT pg_reload_conf()")
            yield conn
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _analysed(db: DB) -> int:
    row = db.execute(
        "SELECT autoanalyze_count FROM pg_stat_user_tables"
        " WHERE schemaname = 'core' AND relname = 'tasks'"
    ).fetchone()
    return int(row[0]) if row else 0


def _analysed_again(db: DB, count: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _analysed(db) <= count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_backlog_on_a_large_table_of_finished_tasks_is_analysed_at_once(db: DB) -> None:
    insert_tasks(db, FINISHED, "succeeded", finished_at="now() - interval '1 day'")
    # autovacuum analyses the young table once (under any setting), then the backlog
    assert _analysed_again(db, 0, 30)
    before = _analysed(db)
    insert_tasks(db, BACKLOG)
    assert _analysed_again(db, before, 15), "core.tasks was not analysed after its backlog"
    with db.transaction(force_rollback=True):
        plan = analyzed(db, tasks_db.NEXT_DUE, {"after_s": 0.5}, generic=False)
    assert rows_read(plan, "tasks") < 100, plan
