"""Prototype measure (issue 35, part 5): what HOT task moves would save PostgreSQL.

    .venv/bin/python bench/hot_moves.py [--tasks 20000] --schema {today,queue,queue+attempts}

One connection runs a claim + report loop straight against PostgreSQL, no core in the
loop: each transaction picks 64 waiting tasks (``FOR UPDATE SKIP LOCKED``), moves them to
``running`` with their attempts and events, and reports the previous 64 ``succeeded``
(attempt closed, task moved, event). The loop is core's lease and reports cut to their
writes, the same rows and indexes. Printed: the backend's CPU a task (``/proc``), WAL
bytes a task, and how many updates of ``core.tasks`` and ``core.attempts`` were HOT.

``--schema``: ``today`` is the migrated schema. ``queue`` is the prototype of a narrow
queue table: the claimable work in ``core.proto_queue`` (its pick index), the pick a
``DELETE ... RETURNING`` of it, and no index of ``core.tasks`` naming ``state`` or
``finished_at`` (their 14 indexes dropped; fillfactor 70, so a move can stay in its page):
the task's moves can be HOT. ``queue+attempts`` also drops the attempts' two indexes on
open attempts, so that a report's close of its attempt can be HOT. The prototype does not
count what it would add elsewhere (the queue row's insert at submit, a table of open
attempts for the reads by worker): it bounds what the design could save.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import submit_all
from stack import core_stack

from libs.common.client import CoreClient
from libs.common.models import WorkerRegister
from libs.common.settings import libpq_url
from services.core import admin

TICK = os.sysconf("SC_CLK_TCK")

# The indexes of core.tasks whose key or predicate names state (or finished_at).
STATE_INDEXES = [
    "ix_tasks_due",
    "ix_tasks_live_queue_state",
    "ix_tasks_owner_last",
    "ix_tasks_owner_waiting",
    "ix_tasks_ready_due",
    "ix_tasks_service_replicas",
    "ix_tasks_running_named",
    "ix_tasks_start_by",
    "ix_tasks_team_last",
    "ix_tasks_team_waiting",
    "ix_tasks_waiting",
    "ix_tasks_waiting_vtime",
    "ix_tasks_finished_at",
]
OPEN_ATTEMPT_INDEXES = ["ix_attempts_open_by_worker", "ix_attempts_key_open"]

PICK_TODAY = """SELECT t.id FROM core.tasks t
WHERE t.state = 'waiting' AND t.queue = 'default' AND t.run_at <= now()
ORDER BY t.priority DESC, t.vtime, t.id LIMIT 64 FOR UPDATE SKIP LOCKED"""
PICK_QUEUE = """WITH p AS (
    SELECT q.task_id FROM core.proto_queue q WHERE q.queue = 'default' AND q.run_at <= now()
    ORDER BY q.priority DESC, q.vtime, q.task_id LIMIT 64 FOR UPDATE SKIP LOCKED)
DELETE FROM core.proto_queue q USING p WHERE q.task_id = p.task_id RETURNING q.task_id"""
CLAIM = """WITH moved AS (
    UPDATE core.tasks t SET state = 'running', version = t.version + 1, updated_at = now(),
        current_attempt_id = nextval('core.attempts_id_seq'), attempts = t.attempts + 1
    WHERE t.id = ANY(%(ids)s) AND t.state = 'waiting'
    RETURNING t.id, t.owner, t.version, t.current_attempt_id AS attempt_id,
              t.concurrency_key, t.cpu, t.memory_mb
), leased AS (
    INSERT INTO core.attempts (id, task_id, number, worker_id, charge_cpu, charge_memory_mb,
                               concurrency_key, fence_sha256, started_at)
    OVERRIDING SYSTEM VALUE
    SELECT attempt_id, id, 1, %(worker)s, cpu, memory_mb, concurrency_key,
           sha256(convert_to(gen_random_uuid()::text, 'UTF8')), now() FROM moved
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, attempt_id)
    SELECT id, version, owner, 'claim', 'waiting', 'running', attempt_id FROM moved
)
SELECT id, attempt_id FROM moved"""
REPORT = """WITH closed AS (
    UPDATE core.attempts a SET outcome = 'succeeded', ended_at = now(), exit_code = 0
    WHERE a.id = ANY(%(attempts)s) AND a.outcome IS NULL RETURNING a.id
), moved AS (
    UPDATE core.tasks t SET state = 'succeeded', version = t.version + 1, updated_at = now(),
        finished_at = now(), deferred = false
    WHERE t.id = ANY(%(ids)s) AND t.state = 'running'
    RETURNING t.id, t.owner, t.version, t.current_attempt_id
)
INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, attempt_id)
SELECT id, version, owner, 'succeed', 'running', 'succeeded', current_attempt_id FROM moved"""
COUNTS = """SELECT sum(n_tup_upd), sum(n_tup_hot_upd) FROM pg_stat_user_tables
WHERE relid IN ('core.tasks'::regclass, 'core.attempts'::regclass)"""


def backend_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def prepare(url: str, schema: str, count: int) -> None:
    """The schema asked for, and ``count`` waiting tasks copied from one submitted."""
    with psycopg.connect(url, autocommit=True) as conn:
        if schema != "today":
            for name in STATE_INDEXES:
                conn.execute(f"DROP INDEX core.{name}")
            conn.execute("ALTER TABLE core.tasks SET (fillfactor = 70)")
        if schema == "queue+attempts":
            for name in OPEN_ATTEMPT_INDEXES:
                conn.execute(f"DROP INDEX core.{name}")
            conn.execute("ALTER TABLE core.attempts SET (fillfactor = 70)")
        cols = [
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'core'"
                " AND table_name = 'tasks' AND column_name <> 'id' AND is_generated = 'NEVER'"
                " ORDER BY ordinal_position"
            )
        ]
        values = ", ".join("vtime + g" if c == "vtime" else c for c in cols)
        conn.execute(
            f"INSERT INTO core.tasks ({', '.join(cols)}) SELECT {values}"
            f" FROM core.tasks, generate_series(1, {count - 1}) g"
        )
        if schema != "today":
            conn.execute(
                "CREATE TABLE core.proto_queue (task_id bigint PRIMARY KEY, queue text NOT NULL,"
                " priority int NOT NULL, vtime float8 NOT NULL, run_at timestamptz NOT NULL)"
            )
            conn.execute(
                "INSERT INTO core.proto_queue SELECT id, queue, priority, vtime, run_at"
                " FROM core.tasks WHERE state = 'waiting'"
            )
            conn.execute(
                "CREATE INDEX ix_proto_pick ON core.proto_queue (queue, priority DESC, vtime, task_id)"
            )
        conn.execute("VACUUM ANALYZE")


def drain(url: str, schema: str, worker: int) -> dict[str, float]:
    with psycopg.connect(url) as conn:
        [pid] = conn.execute("SELECT pg_backend_pid()").fetchone() or [0]
        upd0, hot0 = conn.execute(COUNTS).fetchone() or (0, 0)
        [lsn0] = conn.execute("SELECT pg_current_wal_lsn()").fetchone() or [None]
        conn.commit()
        cpu0, began, done, last = backend_cpu_s(pid), time.perf_counter(), 0, []
        while True:
            ids = [r[0] for r in conn.execute(PICK_TODAY if schema == "today" else PICK_QUEUE)]
            leased = conn.execute(CLAIM, {"ids": ids, "worker": worker}).fetchall() if ids else []
            if last:
                params = {"attempts": [a for _, a in last], "ids": [i for i, _ in last]}
                conn.execute(REPORT, params)
                done += len(last)
            conn.commit()
            last = leased
            if not ids and not last:
                break
        cpu, elapsed = backend_cpu_s(pid) - cpu0, time.perf_counter() - began
        time.sleep(1.5)  # the backend's counts flushed
        [wal] = conn.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", (lsn0,)).fetchone() or [0]
        upd1, hot1 = conn.execute(COUNTS).fetchone() or (0, 0)
        [left] = conn.execute(
            "SELECT count(*) FROM core.tasks WHERE state <> 'succeeded'"
        ).fetchone() or [0]
    if left:
        raise SystemExit(f"{left} tasks not succeeded")
    return {
        "tasks": done,
        "tasks_per_s": round(done / elapsed),
        "backend_cpu_ms_per_task": round(cpu * 1000 / done, 4),
        "wal_bytes_per_task": round(float(wal) / done),
        "updates": int(upd1 - upd0),
        "hot": int(hot1 - hot0),
    }


async def run(args: argparse.Namespace) -> dict[str, float]:
    with core_stack("cairn-bench-hot-") as stack:
        user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
        token = await asyncio.to_thread(admin.create_token, stack.database_url, "w", "worker")
        await submit_all(stack.core_url, user, 1)
        async with CoreClient(stack.core_url, token) as core:
            me = await core.register_worker(
                WorkerRegister(hostname="w", queues=["default"], cpu=4000, memory_mb=10_000_000)
            )
        url = libpq_url(stack.database_url)
        await asyncio.to_thread(prepare, url, args.schema, args.tasks)
        return await asyncio.to_thread(drain, url, args.schema, me.worker.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--schema", choices=["today", "queue", "queue+attempts"], default="today")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    r = asyncio.run(run(args))
    print(
        f"{args.schema}: {r['tasks']} tasks, {r['tasks_per_s']} a second; backend CPU "
        f"{r['backend_cpu_ms_per_task']} ms a task; WAL {r['wal_bytes_per_task']} B a task; "
        f"{r['hot']} of {r['updates']} updates of tasks and attempts HOT"
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
