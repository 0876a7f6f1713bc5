"""Does a single submit cost more as ``core.tasks`` grows? PostgreSQL's side alone.

    .venv/bin/python bench/submit_growth.py [--rows 1000000] [--step 200000]
                                            [--fastupdate on|off] [--durable]

A fresh embedded PostgreSQL (``--fast`` settings unless ``--durable``), migrated. On one
connection: 2,000 single submits (``tasks_db.SUBMIT`` of one task, as ``POST /v1/tasks``
sends it), timed by the backend's own CPU (``/proc/<pid>/stat``) and by the wall clock;
then ``--step`` tasks added in batches of 1,000; again, until ``--rows``. Each line also
shows how many autovacuums and autoanalyzes of ``core.tasks`` have run so far.
``--fastupdate`` sets the labels GIN index's pending list on or off first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_s

from libs.common import pipeline
from libs.common.embedded import EmbeddedPostgres
from libs.common.models import TaskCreate
from libs.common.settings import libpq_url
from services.core import migrate
from services.core.db import tasks as tasks_db
from services.core.domain.sharing import FairShare

SPEC = {
    "name": "bench-task",
    "artifact": {"uri": "file:///bin/true", "sha256": "a" * 64},
    "args": ["--items", "10", "--mode", "fast"],
    "env": {"BENCH": "1", "LEVEL": "info"},
    "labels": {"team": "bench", "run": "submit"},
}
SAMPLE = 2000


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="cairn-growth-"))
    pg = EmbeddedPostgres(work / "pg", fast=not args.durable)
    try:
        url = pg.start()
        migrate.upgrade(url)
        doc = {**tasks_db._row_doc(TaskCreate.model_validate(SPEC)), "owner": "bench"}
        fair = FairShare()
        params = {
            "quantum": 1.0,
            "fair_share": fair.by,
            "fair_half_life": fair.half_life_s,
            "fair_unit": fair.unit_cpu_s,
        }
        one = {**params, "rows": json.dumps([doc]), "waits": json.dumps([None])}
        batch = {**params, "rows": json.dumps([doc] * 1000), "waits": json.dumps([None] * 1000)}
        sql = pipeline.driver_sql(tasks_db.SUBMIT, postgresql_psycopg.dialect())  # type: ignore[no-untyped-call]
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            conn.execute(f"ALTER INDEX core.ix_tasks_labels SET (fastupdate = {args.fastupdate})")
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            pid, rows = int(row[0]), 0
            while rows <= args.rows:
                cpu0, wall0 = cpu_s(pid), time.perf_counter()
                for _ in range(SAMPLE):
                    conn.execute(sql, one).fetchall()
                cpu1, wall1 = cpu_s(pid), time.perf_counter()
                vacuums = conn.execute(
                    "SELECT autovacuum_count, autoanalyze_count FROM pg_stat_user_tables"
                    " WHERE schemaname = 'core' AND relname = 'tasks'"
                ).fetchone()
                print(
                    f"fastupdate={args.fastupdate} rows={rows:>9,}"
                    f"  backend CPU {(cpu1 - cpu0) / SAMPLE * 1e6:5.0f} us/submit"
                    f"  wall {(wall1 - wall0) / SAMPLE * 1e6:6.0f} us/submit"
                    f"  autovacuums/analyzes so far {vacuums}",
                    flush=True,
                )
                rows += SAMPLE
                for _ in range(args.step // 1000):
                    conn.execute(sql, batch).fetchall()
                rows += args.step // 1000 * 1000
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--step", type=int, default=200_000)
    parser.add_argument("--fastupdate", choices=("on", "off"), default="on")
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous_commit on")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
