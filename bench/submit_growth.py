"""Does a single submit cost more as ``core.tasks`` grows? PostgreSQL's side alone.

    .venv/bin/python bench/submit_growth.py [--rows 1000000] [--step 200000]
                                            [--fastupdate on|off] [--durable]

A fresh embedded PostgreSQL (``--fast`` settings unless ``--durable``), migrated
(``stack.core_database``). On one connection, submissions stored as core stores them
(``tasks_db.submit_docs``: the statement and its parameters are core's own): 2,000
single submits (one task a statement, as ``POST /v1/tasks`` sends a lone one), timed by
the backend's own CPU (``/proc/<pid>/stat``) and by the wall clock; then ``--step``
tasks added in batches of 1,000; again, until ``--rows``. Each line also shows how many
autovacuums and autoanalyzes of ``core.tasks`` have run so far. ``--fastupdate`` sets
the labels GIN index's pending list on or off first.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_s
from stack import core_database

from libs.common.models import TaskCreate
from libs.common.settings import libpq_url
from services.core.db import tasks as tasks_db

SPEC = {
    "name": "bench-task",
    "artifact": {"uri": "file:///bin/true", "sha256": "a" * 64},
    "args": ["--items", "10", "--mode", "fast"],
    "env": {"BENCH": "1", "LEVEL": "info"},
    "labels": {"team": "bench", "run": "submit"},
}
SAMPLE = 2000


async def run(args: argparse.Namespace) -> None:
    with core_database("cairn-growth-", fast=not args.durable) as url:
        [doc] = tasks_db.submission_docs("bench", [TaskCreate.model_validate(SPEC)])
        conn = await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True)
        try:
            await conn.execute(
                f"ALTER INDEX core.ix_tasks_labels SET (fastupdate = {args.fastupdate})"
            )
            pid, rows = conn.info.backend_pid, 0
            while rows <= args.rows:
                cpu0, wall0 = cpu_s(pid), time.perf_counter()
                for _ in range(SAMPLE):
                    await tasks_db.submit_docs(conn, [doc], 1.0)
                cpu1, wall1 = cpu_s(pid), time.perf_counter()
                found = await conn.execute(
                    "SELECT autovacuum_count, autoanalyze_count FROM pg_stat_user_tables"
                    " WHERE schemaname = 'core' AND relname = 'tasks'"
                )
                vacuums = await found.fetchone()
                print(
                    f"fastupdate={args.fastupdate} rows={rows:>9,}"
                    f"  backend CPU {(cpu1 - cpu0) / SAMPLE * 1e6:5.0f} us/submit"
                    f"  wall {(wall1 - wall0) / SAMPLE * 1e6:6.0f} us/submit"
                    f"  autovacuums/analyzes so far {vacuums}",
                    flush=True,
                )
                rows += SAMPLE
                for _ in range(args.step // 1000):
                    await tasks_db.submit_docs(conn, [doc] * 1000, 1.0)
                rows += args.step // 1000 * 1000
        finally:
            await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--step", type=int, default=200_000)
    parser.add_argument("--fastupdate", choices=("on", "off"), default="on")
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous_commit on")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
