"""Dispatch benchmark: claim + report through core's HTTP API, no-op work.

    .venv/bin/python bench/dispatch.py [--tasks 20000] [--workers 4] [--max 64]
                                       [--finished N] [--json results.json]

A fresh embedded PostgreSQL (durable settings) and core as its own process
(`bench/stack.py`). The tasks are submitted first, in batches. Then ``--workers``
simulated workers, in this process, each registered with room for far more than they are
given, loop in turns as the agent does: one request reports every attempt the last turn
leased (``succeeded``) and claims up to ``--max`` more. No process is started per
task: this measures core's scheduling path (claim, lease, fenced report, the task's final
transition and its events), the part the design's bar of 6,000 tasks/s is about. The
load generator shares the 2 cores with core and PostgreSQL. At the end every task must be
``succeeded`` with exactly one attempt.

In the same run, on the same PostgreSQL server, pgqueuer (the `bench` extra) drains the
same number of no-op jobs in one process (one ``QueueManager`` with a psycopg connection,
``--pgq-batch`` jobs per dequeue, the jobs enqueued in bulk first), and the ratio
Cairn / pgqueuer is printed: the design's bar is 1.0. ``--skip-pgqueuer`` leaves it out.
Beside it, both sides' steady rates (the middle 80% of completions) and their first and
last quarters: pgqueuer's overall rate carries a start-up of about a second, which a run
of 5,000 is mostly made of (docs/benchmarks.md, "Why the ratio falls").

``--finished N`` puts N finished tasks in ``core.tasks`` first and analyses it, as a
month of retention and a nightly autovacuum leave a deployment's table: the run's
backlog then arrives on statistics that predate it (pgqueuer's queue holds no finished
jobs: it moves them to its log).

Also printed for the claim phase: the CPU per task of core and PostgreSQL against
pgqueuer's (its process and PostgreSQL) per job (bar 1.25), the share of ``core.tasks``'
and ``core.attempts``' updates that were HOT, commits per task, and the turns made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import pg_cpu_s
from procstat import cpu_s
from stack import core_stack, paused

from libs.common.client import CoreClient
from libs.common.models import AttemptReport, ClaimRequest, TaskCreate, Turn, WorkerRegister
from libs.common.settings import libpq_url
from services.core import admin

BAR = 6000
TRUE_SHA = "0" * 64


def rates(began: float, done: list[float]) -> dict[str, int]:
    """A drain's rates from its completion times: overall (from ``began``), steady (the
    middle 80% of completions, without warm-up and tail), and in its first and last
    quarters. The rate ratio is the overall one's; the quarters say whether a side's cost
    per task grows with the work done (dead index entries of claimed tasks, a growing
    events table) or is a start-up spread over the count (pgqueuer's first 600 to 1,200
    jobs drain at 500 to 1,000 a second, whatever the count: docs/benchmarks.md)."""
    marks = sorted(done)
    n = len(marks)
    if n < 10:
        return {"overall": 0, "steady": 0, "first_quarter": 0, "last_quarter": 0}
    lo, hi = marks[n // 10], marks[n * 9 // 10]
    quarter = n // 4
    first = quarter / max(marks[quarter - 1] - began, 1e-9)
    last = quarter / max(marks[-1] - marks[n - quarter - 1], 1e-9)
    return {
        "overall": round(n / max(marks[-1] - began, 1e-9)),
        "steady": round((n * 8 // 10) / (hi - lo)) if hi > lo else 0,
        "first_quarter": round(first),
        "last_quarter": round(last),
    }


# Finished tasks as a month of retention leaves them (``--finished``), then the
# statistics taken, as autovacuum takes them after a quiet night: the backlog the run
# submits next is not in them (autoanalyze waits for a tenth of the table to change).
_FINISHED = """
INSERT INTO core.tasks (owner, name, queue, kind, artifact_uri, artifact_sha256, cpu,
    memory_mb, max_attempts, backoff_cap_s, backoff_jitter, poison_after, state, finished_at)
SELECT 'alice', 'noop', 'default', 'task', 'file:///bin/true', %s, 0.01, 1, 1, 60, false, 3,
       'succeeded', now() - interval '1 day' * random()
FROM generate_series(1, %s)
"""


def prefill(database_url: str, finished: int) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute(_FINISHED, (TRUE_SHA, finished))
        conn.execute("VACUUM ANALYZE core.tasks")


async def submit_all(core_url: str, token: str, count: int) -> None:
    spec = TaskCreate.model_validate(
        {
            "name": "noop",
            "artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA},
            "resources": {"cpu": 0.01, "memory_mb": 1},
        }
    )
    async with CoreClient(core_url, token, timeout=httpx.Timeout(60, connect=5)) as core:
        for start in range(0, count, 1000):
            await core.submit_batch([spec] * min(1000, count - start))


# What PostgreSQL counted: each table's updates and how many of them were HOT (no index
# touched), and the database's commits.
_TABLES = """
SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE schemaname = 'core' AND relname IN ('tasks', 'attempts')
"""


def pg_counts(database_url: str) -> dict[str, int]:
    """The tables' update counts and the database's commits (``pg_stat_*``), once the
    backends have flushed them (a backend flushes its counts at most once a second)."""
    time.sleep(1.5)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        found = {}
        for name, upd, hot in conn.execute(_TABLES):
            found[f"{name}_upd"], found[f"{name}_hot"] = int(upd), int(hot)
        [commits] = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone() or [0]
        found["commits"] = int(commits)
    return found


def moves(before: dict[str, int], after: dict[str, int], tasks: int) -> dict[str, Any]:
    """What the claim phase cost PostgreSQL: the HOT share of each table's updates, and
    commits per task."""
    out: dict[str, Any] = {}
    for table in ("tasks", "attempts"):
        upd = after[f"{table}_upd"] - before[f"{table}_upd"]
        hot = after[f"{table}_hot"] - before[f"{table}_hot"]
        out[f"{table}_updates"] = upd
        out[f"{table}_hot_share"] = round(hot / upd, 3) if upd else None
    out["commits_per_task"] = round((after["commits"] - before["commits"]) / max(tasks, 1), 4)
    return out


async def work(
    core_url: str,
    token: str,
    name: str,
    args: argparse.Namespace,
    done: list[float],
    turns: list[int],
    ready: asyncio.Barrier,
) -> None:
    """One simulated agent: registered (then waits at ``ready`` for the others, so the
    clock starts when all can claim, as pgqueuer's starts with its manager made and
    connected), each turn reports the attempts the last turn leased (all ``succeeded``)
    and claims again, in one request, as the real agent does."""
    async with CoreClient(core_url, token, timeout=httpx.Timeout(60, connect=5)) as core:
        me = await core.register_worker(
            WorkerRegister(hostname=name, queues=["default"], cpu=4000, memory_mb=10_000_000)
        )
        room = ClaimRequest(cpu=4000, memory_mb=10_000_000, max=args.max)
        await ready.wait()
        reports: list[AttemptReport] = []
        idle = 0
        while idle < 3:
            answer = await core.turn(me.worker.id, Turn(reports=reports, claim=room))
            turns.append(1)
            refused = [v for v in answer.reports if v.status != 200]
            if refused:
                raise SystemExit(f"reports refused: {refused[:3]}")
            now = time.perf_counter()
            done.extend(now for _ in answer.reports)
            reports = [
                AttemptReport(attempt_id=a.attempt_id, outcome="succeeded", exit_code=0)
                for a in answer.attempts
            ]
            if not answer.attempts:
                idle += 1
                await asyncio.sleep(0.2)
            else:
                idle = 0


async def pgqueuer_drain(
    database_url: str, count: int, batch: int, postmaster: int, enqueue_batch: int = 1000
) -> dict[str, Any]:
    """Enqueue ``count`` no-op jobs in bulk (``enqueue_batch`` a statement), then drain
    them with one pgqueuer worker. Installs pgqueuer's tables in the database unless they
    are there already (``bench/e2e.py`` drains once per program on one server)."""
    from pgqueuer import PsycopgDriver, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    dsn = libpq_url(database_url)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        queries = Queries(PsycopgDriver(conn))
        if not await queries.has_table(queries.qbe.settings.queue_table):
            await queries.install()
        cpu0 = time.process_time() + pg_cpu_s(postmaster)
        for start in range(0, count, enqueue_batch):
            n = min(enqueue_batch, count - start)
            await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
        enqueue_cpu = time.process_time() + pg_cpu_s(postmaster) - cpu0
    done: list[float] = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        manager = QueueManager(Queries(PsycopgDriver(conn)))

        @manager.entrypoint("noop")
        async def noop(job: object) -> None:
            done.append(time.perf_counter())

        began = time.perf_counter()
        cpu0 = time.process_time() + pg_cpu_s(postmaster)
        await manager.run(batch_size=batch, mode=QueueExecutionMode.drain)
        cpu = time.process_time() + pg_cpu_s(postmaster) - cpu0
    elapsed = max(done) - began if done else float("nan")
    return {
        "jobs": len(done),
        "rates": rates(began, done),
        # its one process (queue manager and worker) and PostgreSQL
        "cpu_ms_per_job": round(cpu * 1000 / max(len(done), 1), 3),
        "enqueue_cpu_ms_per_job": round(enqueue_cpu * 1000 / max(count, 1), 3),
        "elapsed_s": round(elapsed, 2),
        "jobs_per_s": round(len(done) / elapsed),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with core_stack("cairn-bench-dispatch-", CAIRN_HEARTBEAT_TIMEOUT_S="600") as stack:
        user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
        if args.finished:
            await asyncio.to_thread(prefill, stack.database_url, args.finished)
        submitted = time.perf_counter()
        await submit_all(stack.core_url, user, args.tasks)
        submit_s = time.perf_counter() - submitted
        tokens = [
            await asyncio.to_thread(
                admin.create_token, stack.database_url, f"bench-worker-{i}", "worker"
            )
            for i in range(args.workers)
        ]
        done: list[float] = []
        turns: list[int] = []
        before = await asyncio.to_thread(pg_counts, stack.database_url)
        ready = asyncio.Barrier(args.workers + 1)
        workers = asyncio.gather(
            *(
                work(stack.core_url, t, f"w{i}", args, done, turns, ready)
                for i, t in enumerate(tokens)
            )
        )
        all_ready = asyncio.ensure_future(ready.wait())
        await asyncio.wait({all_ready, workers}, return_when=asyncio.FIRST_COMPLETED)
        if workers.done():  # one failed before the start (its registration): say why
            all_ready.cancel()
            await workers
        began = time.perf_counter()
        core0, pg0 = cpu_s(stack.core_pid), pg_cpu_s(stack.postmaster_pid)
        await workers
        core_cpu = cpu_s(stack.core_pid) - core0
        cpu = core_cpu + pg_cpu_s(stack.postmaster_pid) - pg0
        after = await asyncio.to_thread(pg_counts, stack.database_url)
        elapsed = max(done) - began if done else float("nan")
        cairn_rates = rates(began, done)
        pgq = None
        if not args.skip_pgqueuer:
            with paused(stack.core_pid):
                pgq = await pgqueuer_drain(
                    stack.database_url, args.tasks, args.pgq_batch, stack.postmaster_pid
                )
        with psycopg.connect(libpq_url(stack.database_url)) as conn:
            states = dict(conn.execute("SELECT state, count(*) FROM core.tasks GROUP BY 1"))
            attempts = conn.execute(
                "SELECT max(n), min(n) FROM (SELECT count(*) n FROM core.attempts GROUP BY task_id) a"
            ).fetchone()
        return {
            "tasks": args.tasks,
            "finished_before": args.finished,
            "workers": args.workers,
            "max": args.max,
            "submit_s": round(submit_s, 2),
            "reported": len(done),
            "elapsed_s": round(elapsed, 2),
            "tasks_per_s": round(len(done) / elapsed) if done else 0,
            "steady_tasks_per_s": cairn_rates["steady"],
            "rates": cairn_rates,
            "states": states,
            "turns": len(turns),
            # core and PostgreSQL (the simulated agents' own CPU apart), until the last
            # worker's third empty turn
            "cpu_ms_per_task": round(cpu * 1000 / max(len(done), 1), 3),
            "core_cpu_ms_per_task": round(core_cpu * 1000 / max(len(done), 1), 3),
            **moves(before, after, len(done)),
            "attempts_per_task": list(attempts) if attempts else None,
            "bar": BAR,
            "pgqueuer": pgq,
            "ratio_to_pgqueuer": round(len(done) / elapsed / pgq["jobs_per_s"], 3)
            if pgq and done
            else None,
            "steady_ratio_to_pgqueuer": round(cairn_rates["steady"] / pgq["rates"]["steady"], 3)
            if pgq and pgq["rates"]["steady"]
            else None,
            "cpu_ratio_to_pgqueuer": round(
                cpu * 1000 / max(len(done), 1) / pgq["cpu_ms_per_job"], 3
            )
            if pgq and done
            else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pgq-batch", type=int, default=64)
    parser.add_argument("--skip-pgqueuer", action="store_true")
    parser.add_argument(
        "--finished", type=int, default=0, help="finished tasks in core.tasks before the run"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    results = [asyncio.run(run(args)) for _ in range(args.rounds)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    for r in results:
        behind = f" behind {r['finished_before']} finished" if r["finished_before"] else ""
        print(
            f"{r['reported']} tasks claimed and reported by {r['workers']} workers{behind} in "
            f"{r['elapsed_s']} s: {r['tasks_per_s']} tasks/s overall, "
            f"{r['steady_tasks_per_s']} tasks/s steady (bar {BAR}); states {r['states']}; "
            f"attempts per task max/min {r['attempts_per_task']}"
        )
        print(
            f"{r['turns']} turns; HOT share of updates: tasks {r['tasks_hot_share']} of "
            f"{r['tasks_updates']}, attempts {r['attempts_hot_share']} of "
            f"{r['attempts_updates']}; {r['commits_per_task']} commits a task; core + "
            f"PostgreSQL CPU {r['cpu_ms_per_task']} ms a task (core "
            f"{r['core_cpu_ms_per_task']})"
        )
        if r["pgqueuer"]:
            print(
                f"pgqueuer {version('pgqueuer')}, same run and server: "
                f"{r['pgqueuer']['jobs']} jobs in "
                f"{r['pgqueuer']['elapsed_s']} s, {r['pgqueuer']['jobs_per_s']} jobs/s; "
                f"cairn / pgqueuer = {r['ratio_to_pgqueuer']} (bar 1.0); CPU "
                f"{r['pgqueuer']['cpu_ms_per_job']} ms a job (its process + PostgreSQL), "
                f"cairn / pgqueuer = {r['cpu_ratio_to_pgqueuer']} (bar 1.25)"
            )
            c, q = r["rates"], r["pgqueuer"]["rates"]
            print(
                f"rates, cairn / pgqueuer (tasks or jobs a second): steady {c['steady']} / "
                f"{q['steady']} = {r['steady_ratio_to_pgqueuer']}; first quarter "
                f"{c['first_quarter']} / {q['first_quarter']}, last quarter "
                f"{c['last_quarter']} / {q['last_quarter']}"
            )
    print(f"load average at end: {os.getloadavg()}")
    if len(results) > 1:
        print(f"median overall: {statistics.median(r['tasks_per_s'] for r in results)} tasks/s")


if __name__ == "__main__":
    main()
