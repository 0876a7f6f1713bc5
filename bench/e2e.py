"""End to end through one worker agent running real processes.

    .venv/bin/python bench/e2e.py [--tasks 5000] [--rates 50,200,500] [--duration 10]
                                  [--slots 64] [--program true|bash|both|none]
                                  [--json results.json]

A fresh embedded PostgreSQL (durable), core as its own process (`bench/stack.py`) and one
worker agent as its own process (`python -m services.worker`, as `cairn up` starts it,
isolated as it is by default). Every task runs a real process: a bash script that appends
its task id and `$EPOCHREALTIME` (read without a fork) as one line to a shared file, so
each process records its own start. Tasks ask 0.01 CPU and 16 MB; the agent offers room
for ``--slots`` at once.

1. Throughput: ``--tasks`` tasks submitted in batches of 500; tasks/s from the first
   submission to the last task's `succeeded` (PostgreSQL's `finished_at`).
2. Latency at a steady rate: for each of ``--rates``, single submissions open-loop at that
   rate for ``--duration`` seconds (each sent at its instant, whatever the answers do),
   then created (core's `created_at`) -> process running (the process's own record):
   p50, p99 and max, and how many started within 60 s of the end of the window.

3. The floor: for each ``--program`` (``/bin/true`` and ``/bin/bash -c true`` by default),
   ``--tasks`` tasks running that program as in 1, and beside them, before and after, the
   bare isolated spawn of the same program ``--tasks`` times (``bench/floor.c``, as many
   loops as the machine has cores); the ratios Cairn/floor of CPU per task and of wall
   time per task. Cairn's CPU per task, from ``/proc``, in three parts: the agent's own +
   its reaped children's (attempts it forked itself, helpers that exited); its live
   ``cairn-spawn`` helpers' own (with their source checkers'); and their reaped
   children's, the attempts' own processes (each one's sandbox, from its clone to its
   exec, then the program). Issue 35's bar is the first two against the floor ("the
   agent and its helper, outside the task's own process"); all three against it are
   printed too. The floor's: its loops' and the programs' rusage. Wall per
   task: first submission to last ``finished_at`` over the tasks, against the floor's
   elapsed time over its spawns. The machine's CPU per task (core, PostgreSQL and this
   script too) is put beside the same floor, which holds no core and no PostgreSQL, and
   beside the whole floor: that spawn plus the cheapest queue's cost per task on the same
   PostgreSQL server, pgqueuer (the `bench` extra) enqueuing the same number of jobs in
   batches of 500 and one pgqueuer worker draining them (its process and PostgreSQL). It
   has no HTTP, no authentication and no event rows, so the ratio to it is a strict one.
   Beside the bare spawn, the same spawn with the rest of an attempt's sandbox
   (``floor -s``: ``floor.SANDBOX``), no bar: the attempts' own processes against its
   spawned processes' own (each side's from clone to exit; its loop also makes each
   tmpfs home, which Cairn's agent makes), and the machine against its whole plus the
   queue's floor, what Cairn adds to the sandbox it chose.

The bars (`../shared/DESIGN.md`): created -> process running p50 <= 10 ms at 200/s; per
task, the agent and its helper at most 1.5x the floor and the machine at most 1.5x the
whole floor (3). The batches' rate and the other rates' latencies have no bar. Everything shares the machine's cores: core, PostgreSQL, the agent, its
processes and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, deque
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import PROGRAMS, Floor, Runner, describe, ratio
from procstat import children_cpu_s, cpu_s, helpers_split_s, machine_busy_s, reaped_cpu_s
from rawhttp import Conn, request_bytes
from stack import Stack, core_stack, exit_on_sigterm, paused

from libs.common import procs
from libs.common.settings import libpq_url
from services.core import admin

# One line appended to one shared file (a write under PIPE_BUF with O_APPEND lands whole):
# a file per task cost each process an inode allocation, 0.5-0.7 ms of CPU here, which is
# the bench's recording, not the task's start.
SCRIPT = '#!/bin/bash\nprintf "%s %s\\n" "$CAIRN_TASK_ID" "$EPOCHREALTIME" >> "$E2E_DIR/starts"\n'
#: ``../shared/DESIGN.md``'s bar on this script's figures (its others: the floor's lines)
BARS = {"p50_ms_at_200": 10}


def worker_module() -> str:
    """The worker agent's module (its own package since the isolation work)."""
    if importlib.util.find_spec("services.worker") is not None:
        return "services.worker"
    return "services.core.worker"  # before the isolation work


def _artifact(root: Path) -> dict[str, str]:
    path = root / "record-start.sh"
    path.write_text(SCRIPT)
    path.chmod(0o755)
    for parent in path.parents:  # an unprivileged attempt must reach it
        parent.chmod(parent.stat().st_mode | 0o001)
    return {"uri": f"file://{path}", "sha256": hashlib.sha256(SCRIPT.encode()).hexdigest()}


def _program_artifact(path: str) -> dict[str, str]:
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {"uri": f"file://{path}", "sha256": digest}


def _spec(
    artifact: dict[str, str], records: Path, i: int, args: tuple[str, ...] = ()
) -> dict[str, Any]:
    return {
        "name": "e2e",
        "artifact": artifact,
        "args": list(args),
        "env": {"E2E_DIR": str(records)},
        "resources": {"cpu": 0.01, "memory_mb": 16},
        "retry": {"max_attempts": 1},
        "idempotency_key": f"e2e-{i}",
    }


def _start_agent(
    core_url: str, token: str, home: Path, slots: int, timings: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CAIRN_URL": core_url,
        "CAIRN_TOKEN": token,
        "CAIRN_HOME": str(home),
        "CAIRN_WORKER_SLOTS": str(slots),
        "CAIRN_WORKER_CPU": str(max(1.0, slots * 0.01)),
        "CAIRN_WORKER_MEMORY_MB": str(slots * 16 + 64),
        "CAIRN_LOG_LEVEL": "warning",
        "CAIRN_WORKER_DRAIN_GRACE_S": "2",
        "CAIRN_WORKER_TIMINGS_FILE": str(timings),
    }
    env.pop("CAIRN_DATABASE_URL", None)
    return subprocess.Popen([sys.executable, "-m", worker_module()], env=env)


def _starts(records: Path) -> dict[int, float]:
    found = {}
    for line in (records / "starts").read_text().splitlines():
        task_id, _, at = line.partition(" ")
        if task_id.isdigit() and at:
            found.setdefault(int(task_id), float(at))
    return found


def _created(database_url: str, first_id: int) -> dict[int, tuple[float, float | None, str]]:
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT id, EXTRACT(EPOCH FROM created_at), EXTRACT(EPOCH FROM finished_at), state "
            "FROM core.tasks WHERE id >= %s",
            (first_id,),
        ).fetchall()
    return {int(r[0]): (float(r[1]), float(r[2]) if r[2] is not None else None, r[3]) for r in rows}


def _leases(database_url: str, first_id: int) -> dict[int, tuple[int, float]]:
    """task id -> (its first attempt's id, when core leased it)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (task_id) task_id, id, EXTRACT(EPOCH FROM started_at)"
            " FROM core.attempts WHERE task_id >= %s ORDER BY task_id, id",
            (first_id,),
        ).fetchall()
    return {int(r[0]): (int(r[1]), float(r[2])) for r in rows}


def _claim_looks(core_url: str) -> dict[str, float]:
    """Core's counters of its turns and claims: ``cairn_claim_looks_total`` by what the
    look found (leased, empty), ``cairn_turns_total`` by kind (``turn_<kind>``), the
    reports the turns carried (``reports``), the attempts leased (``leased``), and
    PostgreSQL's committed transactions (``xacts``: all of the database's)."""
    found = {"leased": 0.0, "empty": 0.0}
    for line in httpx.get(core_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("cairn_claim_looks_total{"):
            kind = "leased" if 'outcome="leased"' in line else "empty"
            found[kind] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("cairn_turns_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[f"turn_{kind}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("cairn_turn_reports_total "):
            found["reports"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("cairn_attempts_started_total "):
            found["started"] = float(line.rsplit(" ", 1)[1])
    return found


def _xacts(database_url: str) -> float:
    """PostgreSQL's committed transactions in the bench's database so far."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return float(row[0]) if row else 0.0


def _turn_counts(before: dict[str, float], after: dict[str, float], tasks: int) -> dict[str, Any]:
    """Turns per task by kind, reports per reporting turn, leases per claiming turn and
    transactions per task between two readings of ``_claim_looks`` (with ``xacts``)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    kinds = ("both", "claim", "report", "other")
    claiming = d.get("turn_both", 0) + d.get("turn_claim", 0)
    reporting = d.get("turn_both", 0) + d.get("turn_report", 0)
    return {
        "turns_per_task": {k: round(d.get(f"turn_{k}", 0) / max(tasks, 1), 2) for k in kinds},
        "reports_per_reporting_turn": round(d.get("reports", 0) / max(reporting, 1), 2),
        "leased_per_claiming_turn": round(d.get("started", 0) / max(claiming, 1), 2),
        "xacts_per_task": round(d.get("xacts", 0) / max(tasks, 1), 2),
    }


def _timings(path: Path) -> dict[int, dict[str, float]]:
    """The agent's step times per attempt (``services/worker/timings.py``)."""
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        found[int(entry.pop("attempt_id"))] = entry
    return found


STEPS = ("created", "leased", "answered", "prepared", "vouched", "published", "spawned", "running")


def _steps(
    created: dict[int, tuple[float, float | None, str]],
    leases: dict[int, tuple[int, float]],
    timings: dict[int, dict[str, float]],
    starts: dict[int, float],
) -> dict[str, dict[str, float]]:
    """p50/p99 (ms) of each step of created -> running, and how often the turn that
    leased a task had been sent before the task was created (a long poll woken)."""
    gaps: dict[str, list[float]] = {f"{a}->{b}": [] for a, b in pairwise(STEPS)}
    woken = []
    # created -> leased, split: a task whose claim waited at core when it was created
    # (woken), and one that waited for the agent's next claim to be sent (created ->
    # sent), then for that claim's turn (sent -> leased).
    split: dict[str, list[float]] = {
        "woken: created->leased": [],
        "unwoken: created->claim_sent": [],
        "unwoken: claim_sent->leased": [],
    }
    for task_id, (made, _, _) in created.items():
        if task_id not in leases or task_id not in starts:
            continue
        attempt_id, leased = leases[task_id]
        agent = timings.get(attempt_id)
        if agent is None:
            continue
        at = {"created": made, "leased": leased, **agent, "running": starts[task_id]}
        for a, b in pairwise(STEPS):
            gaps[f"{a}->{b}"].append((at[b] - at[a]) * 1000)
        woken.append(agent["sent"] < made)
        if agent["sent"] < made:
            split["woken: created->leased"].append((leased - made) * 1000)
        else:
            split["unwoken: created->claim_sent"].append((agent["sent"] - made) * 1000)
            split["unwoken: claim_sent->leased"].append((leased - agent["sent"]) * 1000)
    out = {
        name: {"p50_ms": round(_pct(v, 0.5), 1), "p99_ms": round(_pct(v, 0.99), 1)}
        for name, v in gaps.items()
        if v
    }
    for name, v in split.items():
        if v:
            out[name] = {"p50_ms": round(_pct(v, 0.5), 2), "p99_ms": round(_pct(v, 0.99), 1)}
    if woken:
        out["turn_sent_before_created"] = {"share": round(sum(woken) / len(woken), 3)}
        # Attempts leased by one turn share its answer time: how many came in each.
        turns = Counter(timings[a]["answered"] for a, _ in leases.values() if a in timings)
        out["leased_per_turn"] = {"mean": round(sum(turns.values()) / len(turns), 2)}
        # How soon the agent's next claim left once a turn's leases arrived: the time no
        # claim of its own was on its way to core (one claiming turn at a time).
        sent = sorted({(timings[a]["sent"], timings[a]["answered"]) for a, _ in leases.values()
                       if a in timings})  # fmt: skip
        gaps = [(b[0] - a[1]) * 1000 for a, b in pairwise(sent) if b[0] >= a[1]]
        if gaps:
            out["answered->next_claim_sent"] = {
                "p50_ms": round(_pct(gaps, 0.5), 2),
                "p99_ms": round(_pct(gaps, 0.99), 2),
            }
    return out


AGENT_STEPS = ("answered", "prepared", "spawned", "exited", "reported")


def _held(
    leases: dict[int, tuple[int, float]], timings: dict[int, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """How long the agent holds an attempt, step by step (p50/p99 ms): where its slot's
    time goes while throughput is measured."""
    gaps: dict[str, list[float]] = {f"{a}->{b}": [] for a, b in pairwise(AGENT_STEPS)}
    for attempt_id, _ in leases.values():
        at = timings.get(attempt_id, {})
        for a, b in pairwise(AGENT_STEPS):
            if a in at and b in at:
                gaps[f"{a}->{b}"].append((at[b] - at[a]) * 1000)
    return {
        name: {"p50_ms": round(_pct(v, 0.5), 1), "p99_ms": round(_pct(v, 0.99), 1)}
        for name, v in gaps.items()
        if v
    }


def _cpu_counters(stack: Stack, agent_pid: int, *, end: bool = False) -> dict[str, float]:
    """CPU seconds so far of each process and of the machine. The walks of ``/proc`` for
    the helpers and the backends cost this process a few milliseconds (0.29 s when each
    helper had a walk of its own, which the machine's figure and the bench's then
    counted): they are made outside the window of this process's own CPU and the
    machine's, after reading those at the window's start and before them at its
    ``end``."""

    def edges() -> dict[str, float]:
        return {"bench": cpu_s(os.getpid()), "machine": machine_busy_s()}

    first = edges() if end else {}
    helpers, attempts = helpers_split_s(agent_pid)
    counters = {
        "agent": cpu_s(agent_pid),
        "reaped": reaped_cpu_s(agent_pid),
        "helpers": helpers,
        "attempts": attempts,
        "core": cpu_s(stack.core_pid) + children_cpu_s(stack.core_pid),
        "postgres": cpu_s(stack.postmaster_pid) + children_cpu_s(stack.postmaster_pid),
    }
    return {**counters, **(first if end else edges())}


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _wait_final(database_url: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM core.tasks WHERE state IN ('succeeded', 'dead', 'cancelled')"
            ).fetchone()
            if row and row[0] >= count:
                return
            time.sleep(0.2)
    # Not all final in time: say where they are, and why the last ones failed.
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        states = conn.execute("SELECT state, count(*) FROM core.tasks GROUP BY state").fetchall()
        errors = conn.execute(
            "SELECT DISTINCT last_error FROM core.tasks WHERE last_error IS NOT NULL LIMIT 5"
        ).fetchall()
    print(f"not final after {timeout_s} s: {dict(states)}; errors {[e[0] for e in errors]}")


def _errors(database_url: str, first_id: int) -> list[str]:
    """A few distinct reasons tasks from ``first_id`` on did not succeed."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT DISTINCT last_error FROM core.tasks WHERE id >= %s AND state <> 'succeeded'"
            " AND last_error IS NOT NULL LIMIT 5",
            (first_id,),
        ).fetchall()
        tails = conn.execute(
            "SELECT DISTINCT a.log_tail FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
            " WHERE t.id >= %s AND t.state <> 'succeeded' AND a.log_tail IS NOT NULL LIMIT 3",
            (first_id,),
        ).fetchall()
    return [r[0] for r in rows] + [f"log: {r[0][-300:]}" for r in tails]


def _attempts(database_url: str) -> dict[int, int]:
    """How many tasks had how many attempts (every task of the run: each should have one)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT n, count(*) FROM (SELECT count(*) n FROM core.attempts GROUP BY task_id) a"
            " GROUP BY n ORDER BY n"
        ).fetchall()
    return {int(n): int(c) for n, c in rows}


def _max_id(database_url: str) -> int:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute("SELECT COALESCE(max(id), 0) FROM core.tasks").fetchone()
    return int(row[0]) if row else 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def throughput(
    core_url: str,
    token: str,
    artifact: dict[str, str],
    records: Path,
    count: int,
    base: int,
    args: tuple[str, ...] = (),
) -> float:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=core_url, headers=headers, timeout=60) as http:
        began = time.time()
        for start in range(0, count, 500):
            batch = [
                _spec(artifact, records, base + i, args)
                for i in range(start, min(count, start + 500))
            ]
            answer = await http.post("/v1/tasks/batch", json={"tasks": batch})
            answer.raise_for_status()
    return began


async def steady(
    core_url: str,
    token: str,
    artifact: dict[str, str],
    records: Path,
    rate: float,
    duration_s: float,
    base: int,
) -> tuple[int, float]:
    """Single submissions, open loop: each sent at its instant on a free keep-alive
    connection (the last one freed; a new one when none is free), whatever the answers
    do; returns how many were accepted and the rate actually sent. The raw client
    (``rawhttp``) keeps the load generator's CPU off the two cores being measured: httpx
    cost this process 8-10 ms a submission at 200/s, more than core and the agent together."""
    url = urlsplit(core_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    loop = asyncio.get_running_loop()
    free: deque[Conn] = deque()

    async def connect() -> Conn:
        _, conn = await loop.create_connection(lambda: Conn(loop), host, port)
        return conn

    for conn in await asyncio.gather(*(connect() for _ in range(64))):
        free.append(conn)

    async def submit(i: int) -> bool:
        body = json.dumps(_spec(artifact, records, base + i)).encode()
        data = request_bytes(host, port, "/v1/tasks", body, token)
        for attempt in range(3):  # a connection the server closed: again (the key dedups)
            while free and free[-1].closed:
                free.pop()
            conn = free.pop() if free and attempt < 2 else await connect()
            try:
                status, _ = await conn.request(data, 30)
            except (OSError, ConnectionError):
                conn.transport.close()
                continue
            free.append(conn)
            return status == 201
        return False

    total = int(rate * duration_s)
    began = loop.time()
    sent: list[asyncio.Task[bool]] = []
    for i in range(total):
        delay = began + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent.append(asyncio.create_task(submit(i)))
    # What was offered: a sender that falls behind its instants offers less than the rate.
    offered = (total - 1) / (loop.time() - began) if total > 1 else rate
    answers = await asyncio.gather(*sent, return_exceptions=True)
    for conn in free:
        conn.transport.close()
    return sum(1 for a in answers if a is True), offered


def _latencies(
    created: dict[int, tuple[float, float | None, str]], starts: dict[int, float]
) -> list[float]:
    return [(starts[i] - made) * 1000 for i, (made, _, _) in created.items() if i in starts]


async def against_floor(
    stack: Stack,
    agent_pid: int,
    token: str,
    records: Path,
    program: str,
    count: int,
    base: int,
    runner: Runner,
) -> dict[str, Any]:
    """``count`` tasks running ``program``, the floor of the same program before and
    after them; what each cost per task. The caller's tasks are all final before."""
    command = PROGRAMS[program]
    artifact = _program_artifact(command[0])
    done = _final_count(stack.database_url)
    await throughput(stack.core_url, token, artifact, records, 20, base, command[1:])
    _wait_final(stack.database_url, done + 20, 60)
    floor, sandboxed, jobs = Floor(), Floor(), os.cpu_count() or 1
    runner.run_both(command, count, floor, sandboxed, jobs)
    first = _max_id(stack.database_url) + 1
    before = _cpu_counters(stack, agent_pid)
    turns_before = {**_claim_looks(stack.core_url), "xacts": _xacts(stack.database_url)}
    began = await throughput(
        stack.core_url, token, artifact, records, count, base + 100, command[1:]
    )
    _wait_final(stack.database_url, done + 20 + count, 600)
    after = _cpu_counters(stack, agent_pid, end=True)
    turns = {**_claim_looks(stack.core_url), "xacts": _xacts(stack.database_url)}
    runner.run_both(command, count, floor, sandboxed, jobs, sandboxed_first=True)
    created = _created(stack.database_url, first)
    ended = [f for _, f, s in created.values() if f is not None and s == "succeeded"]
    cpu = {name: (after[name] - before[name]) * 1000 / count for name in after}
    # issue 35's bar: the agent and its helpers, outside the tasks' own processes
    overhead = cpu["agent"] + cpu["reaped"] + cpu["helpers"]
    cairn_cpu = overhead + cpu["attempts"]
    wall = (max(ended) - began) * 1000 / len(ended) if ended else 0.0
    with paused(stack.core_pid, agent_pid):  # their idle loops are not the floor's
        queue = await _queue_floor(stack, count)
    whole = floor.cpu_ms + queue["cpu_ms"] if floor.spawns and queue else None
    # The same with the floor's spawn given the rest of an attempt's sandbox: what the
    # agent, its helpers, core and PostgreSQL cost beyond the isolation Cairn chose.
    whole_sandboxed = sandboxed.cpu_ms + queue["cpu_ms"] if sandboxed.spawns and queue else None
    return {
        "program": " ".join(command),
        "succeeded": len(ended),
        "cairn_cpu_ms": round(cairn_cpu, 3),
        "agent_cpu_ms": round(cpu["agent"] + cpu["reaped"], 3),
        "helpers_cpu_ms": round(cpu["helpers"], 3),
        "attempts_cpu_ms": round(cpu["attempts"], 3),
        "overhead_ratio": ratio(overhead, floor.cpu_ms) if floor.spawns else None,
        "attempts_ratio": ratio(cpu["attempts"], floor.cpu_ms) if floor.spawns else None,
        "machine_cpu_ms": round(cpu["machine"], 3),
        "cairn_wall_ms": round(wall, 3),
        "floor_cpu_ms": round(floor.cpu_ms, 3) if floor.spawns else None,
        "floor_wall_ms": round(floor.wall_ms, 3) if floor.spawns else None,
        "floor_jobs": jobs,
        "floor": describe(floor) if floor.spawns else "not measured (no C compiler)",
        "cpu_ratio": ratio(cairn_cpu, floor.cpu_ms) if floor.spawns else None,
        "machine_ratio": ratio(cpu["machine"], floor.cpu_ms) if floor.spawns else None,
        "wall_ratio": ratio(wall, floor.wall_ms) if floor.spawns else None,
        "queue_floor": queue,
        "whole_floor_cpu_ms": round(whole, 3) if whole else None,
        "whole_ratio": ratio(cpu["machine"], whole) if whole else None,
        "sandboxed": describe(sandboxed, sandbox=True) if sandboxed.spawns else None,
        "sandboxed_cpu_ms": round(sandboxed.cpu_ms, 3) if sandboxed.spawns else None,
        "sandboxed_child_cpu_ms": round(sandboxed.child_cpu_ms, 3) if sandboxed.spawns else None,
        # like for like: each side's spawned processes, from their clone to their exit
        "attempts_sandboxed_ratio": (
            ratio(cpu["attempts"], sandboxed.child_cpu_ms) if sandboxed.spawns else None
        ),
        "whole_sandboxed_cpu_ms": round(whole_sandboxed, 3) if whole_sandboxed else None,
        "whole_sandboxed_ratio": (
            ratio(cpu["machine"], whole_sandboxed) if whole_sandboxed else None
        ),
        "turns": _turn_counts(turns_before, turns, count),
        "load": _load(),
    }


async def _queue_floor(stack: Stack, count: int) -> dict[str, Any] | None:
    """What the cheapest queue on this PostgreSQL spends to take ``count`` tasks in and
    hand each out and back: pgqueuer (the `bench` extra) enqueuing them in batches of
    500, as the run submits its tasks, and one pgqueuer worker draining them (its
    process and PostgreSQL, per job); None without pgqueuer."""
    from dispatch import pgqueuer_drain  # imports pgqueuer only when it drains

    try:
        got = await pgqueuer_drain(
            stack.database_url, count, 64, stack.postmaster_pid, enqueue_batch=500
        )
    except ImportError:
        return None
    per_job = got["enqueue_cpu_ms_per_job"] + got["cpu_ms_per_job"]
    return {**got, "cpu_ms": round(per_job, 3)}


def _final_count(database_url: str) -> int:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT count(*) FROM core.tasks WHERE state IN ('succeeded', 'dead', 'cancelled')"
        ).fetchone()
    return int(row[0]) if row else 0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with core_stack(
        "cairn-bench-e2e-", CAIRN_HEARTBEAT_INTERVAL_S="5", CAIRN_HEARTBEAT_TIMEOUT_S="60"
    ) as stack:
        # Beside the agent's run folder, which its attempts share with the host (each
        # attempt gets a private /tmp and /var/tmp only where the run folder is not).
        records = stack.root / "records"
        records.mkdir()
        records.chmod(0o1777)
        (records / "starts").touch()
        (records / "starts").chmod(0o666)  # every attempt's uid appends its line
        artifact = _artifact(stack.root)
        user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
        worker = await asyncio.to_thread(
            admin.create_token, stack.database_url, "bench-worker", "worker"
        )
        timings = stack.root / "timings.jsonl"
        agent = _start_agent(
            stack.core_url, worker, stack.root / "worker-home", args.slots, timings
        )
        results: dict[str, Any] = {"slots": args.slots, "worker_module": worker_module()}
        try:
            # Warm-up: the artifact fetched and cached, the agent registered.
            await throughput(stack.core_url, user, artifact, records, 20, 10**9)
            _wait_final(stack.database_url, 20, 60)
            done_before = 20
            first = _max_id(stack.database_url) + 1
            load_before = _load()
            cpu_before = _cpu_counters(stack, agent.pid)
            began = await throughput(stack.core_url, user, artifact, records, args.tasks, 0)
            _wait_final(stack.database_url, done_before + args.tasks, args.timeout)
            cpu_after = _cpu_counters(stack, agent.pid, end=True)
            created = _created(stack.database_url, first)
            ended = [f for _, f, s in created.values() if f is not None and s == "succeeded"]
            results["states"] = dict(Counter(s for _, _, s in created.values()))
            results["errors"] = _errors(stack.database_url, first)
            results["throughput"] = {
                "tasks": args.tasks,
                "succeeded": len(ended),
                "elapsed_s": round(max(ended) - began, 2) if ended else None,
                "tasks_per_s": round(len(ended) / (max(ended) - began)) if ended else 0,
                "held": _held(_leases(stack.database_url, first), _timings(timings)),
                # Where the machine's CPU went, per task: the agent's own and its reaped
                # children's, its spawn helpers' own, the attempts they reaped (until
                # 2026-12-08 "helpers" held these too), core's, PostgreSQL's live
                # processes', and the whole machine's (the tasks and this script too).
                "cpu_ms_per_task": {
                    name: round((cpu_after[name] - cpu_before[name]) * 1000 / args.tasks, 2)
                    for name in cpu_after
                },
                "load": f"{load_before} -> {_load()}",
            }
            done_before += args.tasks
            base = 10**6
            for rate in args.rates:
                first = _max_id(stack.database_url) + 1
                # The looks' counts (an HTTP call to core, a connection to PostgreSQL)
                # outside the CPU window.
                looks_before = _claim_looks(stack.core_url)
                looks_before["xacts"] = _xacts(stack.database_url)
                cpu_before = _cpu_counters(stack, agent.pid)
                window = time.monotonic()
                accepted, offered = await steady(
                    stack.core_url, user, artifact, records, rate, args.duration, base
                )
                _wait_final(stack.database_url, done_before + accepted, 60)
                cpu_after = _cpu_counters(stack, agent.pid, end=True)
                looks = _claim_looks(stack.core_url)
                looks["xacts"] = _xacts(stack.database_url)
                window = time.monotonic() - window
                done_before += accepted
                created = _created(stack.database_url, first)
                starts = _starts(records)
                lat = _latencies(created, starts)
                results[f"rate_{rate:g}"] = {
                    "rate": rate,
                    "offered_per_s": round(offered, 1),
                    "accepted": accepted,
                    "started": len(lat),
                    "p50_ms": round(_pct(lat, 0.5), 1) if lat else None,
                    "p99_ms": round(_pct(lat, 0.99), 1) if lat else None,
                    "max_ms": round(max(lat), 1) if lat else None,
                    "load": _load(),
                    "window_s": round(window, 2),
                    "cpu_ms_per_task": {
                        name: round(
                            (cpu_after[name] - cpu_before[name]) * 1000 / max(accepted, 1), 2
                        )
                        for name in cpu_after
                    },
                    "steps": _steps(
                        created, _leases(stack.database_url, first), _timings(timings), starts
                    ),
                    # looks by woken waiting claims (a claim's first look is in its turn)
                    "claim_looks_per_task": {
                        found: round((looks[found] - looks_before[found]) / max(accepted, 1), 2)
                        for found in ("leased", "empty")
                    },
                    "turns": _turn_counts(looks_before, looks, accepted),
                }
                base += 10**6
            with Runner() as runner:
                for program in args.programs:
                    results[f"floor_{program}"] = await against_floor(
                        stack, agent.pid, user, records, program, args.tasks, base, runner
                    )
                    base += 10**6
            results["attempts"] = _attempts(stack.database_url)
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
            shutil.rmtree(records, ignore_errors=True)
        return results


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 200.0, 500.0]
    )
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--program", choices=[*PROGRAMS, "both", "none"], default="both")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.programs = {"both": list(PROGRAMS), "none": []}.get(args.program, [args.program])
    # The load generator's collector as the services have theirs: at the default it was a
    # third of this process's CPU at 200/s (perf), on the two cores the run measures.
    procs.settle_collector()
    results = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    t = results["throughput"]
    print(f"states of the throughput tasks: {results['states']}; errors {results['errors']}")
    print(
        f"throughput: {t['succeeded']} of {t['tasks']} tasks succeeded in {t['elapsed_s']} s: "
        f"{t['tasks_per_s']} tasks/s (no bar); load {t['load']}"
    )
    print(
        "    CPU ms per task: "
        + ", ".join(f"{name} {ms}" for name, ms in t["cpu_ms_per_task"].items())
    )
    for step, figures in t["held"].items():
        print(f"    {step}: {figures}")
    for key, r in results.items():
        if key.startswith("rate_"):
            print(
                f"steady {r['rate']:g}/s (sent at {r['offered_per_s']}/s): {r['accepted']} accepted, {r['started']} started; "
                f"created -> running p50 {r['p50_ms']} ms"
                + (f" (bar {BARS['p50_ms_at_200']} ms)" if r["rate"] == 200 else "")
                + f", p99 {r['p99_ms']} ms, max {r['max_ms']} ms; load {r['load']}"
            )
            print(
                f"    CPU ms per task over {r['window_s']} s: "
                + ", ".join(f"{name} {ms}" for name, ms in r["cpu_ms_per_task"].items())
            )
            for step, figures in r["steps"].items():
                print(f"    {step}: {figures}")
            print(f"    woken claims' looks per task: {r['claim_looks_per_task']}")
            print(f"    turns: {r['turns']}")
    for key, f in results.items():
        if key.startswith("floor_"):
            _print_floor(f)
    print(f"tasks by their number of attempts (one each expected): {results['attempts']}")


def _print_floor(f: dict[str, Any]) -> None:
    print(
        f"{f['program']}: {f['succeeded']} tasks; load {f['load']}\n"
        f"    Cairn CPU per task (the agent, its helpers and their attempts) "
        f"{f['cairn_cpu_ms']} ms, wall per task {f['cairn_wall_ms']} ms; machine CPU per "
        f"task {f['machine_cpu_ms']} ms"
    )
    print(
        f"    of Cairn's: the agent {f['agent_cpu_ms']} ms, its helpers {f['helpers_cpu_ms']} "
        f"ms, the attempts' own processes (their sandbox from clone to exec, and the "
        f"program) {f['attempts_cpu_ms']} ms"
    )
    print(
        f"    floor ({f['floor']}; {f['floor_jobs']} loops): CPU per spawn "
        f"{f['floor_cpu_ms']} ms (its loops + the program), wall per spawn {f['floor_wall_ms']} ms"
    )
    print(
        f"    agent + helpers / floor: CPU {f['overhead_ratio']} (bar 1.5x); the attempts' "
        f"own processes / floor {f['attempts_ratio']}; all of Cairn's / floor: CPU "
        f"{f['cpu_ratio']}, wall {f['wall_ratio']}; machine/floor CPU {f['machine_ratio']} "
        "(that floor holds no core nor PostgreSQL)"
    )
    print(f"    turns: {f['turns']}")
    if f["sandboxed"] is not None:
        print(
            f"    the floor with the rest of an attempt's sandbox ({f['sandboxed']}): CPU per "
            f"spawn {f['sandboxed_cpu_ms']} ms, its spawned processes' {f['sandboxed_child_cpu_ms']}"
            f" ms; the attempts' own processes / those {f['attempts_sandboxed_ratio']} (no bar)"
        )
    q = f["queue_floor"]
    if q is None:
        print("    the whole floor: not measured (pgqueuer, the `bench` extra, not installed)")
        return
    print(
        f"    the queue's floor: pgqueuer enqueued {q['jobs']} jobs at "
        f"{q['enqueue_cpu_ms_per_job']} ms and drained them at {q['cpu_ms_per_job']} ms of CPU "
        f"a job (its process + PostgreSQL); the whole floor (spawn + queue) "
        f"{f['whole_floor_cpu_ms']} ms; machine/whole floor CPU {f['whole_ratio']} (bar 1.5x)"
    )
    if f["whole_sandboxed_ratio"] is not None:
        print(
            f"    machine / (the sandboxed floor + the queue's, {f['whole_sandboxed_cpu_ms']} ms) "
            f"{f['whole_sandboxed_ratio']}: what the agent, its helpers, core and PostgreSQL add "
            "to the sandbox Cairn chose (no bar)"
        )


if __name__ == "__main__":
    main()
