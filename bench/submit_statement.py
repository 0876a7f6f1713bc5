"""What core's submit statement costs PostgreSQL a task, alone: batches of ``--size`` rows
(``db.tasks.submission_docs`` of a common task, as core sends them) written by one
connection through ``db.tasks.submit_docs``, the backend's CPU a task over ``--rounds``;
beside it, the same rows only read from their JSON into ``core.tasks`` records (what the
row format costs), and with ``--drop-indexes`` the statement again without any non-unique
index of ``core.tasks`` and ``core.task_events`` (what the indexes cost). A fresh
embedded PostgreSQL, migrated.

    .venv/bin/python bench/submit_statement.py [--size 1000] [--rounds 20] [--drop-indexes]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procstat import cpu_s
from stack import core_database

from libs.common.models import TaskCreate
from libs.common.settings import libpq_url
from services.core.db import tasks as tasks_db
from tests.support import spec

# The rows read into records and nothing more (SUBMIT's first step).
READ_ONLY = """SELECT count(*), sum(length(r.name))
FROM json_populate_recordset(CAST(NULL AS core.tasks), CAST(%s AS json)) AS r"""

NON_UNIQUE = """SELECT indexrelid::regclass::text FROM pg_index
WHERE indrelid IN ('core.tasks'::regclass, 'core.task_events'::regclass) AND NOT indisunique"""


async def _per_task_us(url: str, docs: list[dict[str, Any]], rounds: int, read_only: bool) -> float:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        payload = orjson.dumps(docs).decode()

        async def once() -> None:
            if read_only:
                await conn.execute(READ_ONLY, (payload,))
            else:
                await tasks_db.submit_docs(conn, docs, 1.0, [], None)

        await once()  # planned and cached
        pid = conn.info.backend_pid
        began = cpu_s(pid)
        for _ in range(rounds):
            await once()
        return (cpu_s(pid) - began) / rounds / len(docs) * 1e6
    finally:
        await conn.close()


def _empty(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE core.task_events, core.tasks CASCADE")
        conn.execute("VACUUM ANALYZE core.tasks")
        conn.execute("VACUUM ANALYZE core.task_events")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--drop-indexes", action="store_true")
    args = parser.parse_args()
    with core_database("cairn-bench-submit-") as db_url:
        url = libpq_url(db_url)
        specs = [
            TaskCreate.model_validate(spec(name=f"t{i}", labels={"team": "x"}))
            for i in range(args.size)
        ]
        docs = tasks_db.submission_docs("bench", specs)
        size = len(orjson.dumps(docs)) / len(docs)
        print(f"{args.size} rows a statement, {size:.0f} bytes of JSON a row")
        _empty(url)
        whole = asyncio.run(_per_task_us(url, docs, args.rounds, read_only=False))
        print(f"the submit statement: {whole:.1f} µs of PostgreSQL's CPU a task")
        read = asyncio.run(_per_task_us(url, docs, args.rounds, read_only=True))
        print(f"its rows read into records alone: {read:.1f} µs a task")
        if args.drop_indexes:
            with psycopg.connect(url, autocommit=True) as conn:
                names = [row[0] for row in conn.execute(NON_UNIQUE).fetchall()]
                for name in names:
                    conn.execute(f"DROP INDEX {name}")
            _empty(url)
            bare = asyncio.run(_per_task_us(url, docs, args.rounds, read_only=False))
            print(f"the statement without {len(names)} non-unique indexes: {bare:.1f} µs a task")


if __name__ == "__main__":
    main()
