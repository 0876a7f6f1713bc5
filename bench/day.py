"""A compressed day (issue 30, part 3): single tasks from thousands of owners, cron
schedules and DAG runs among them, with retention shortened so that the database's size
must level off, and every service's memory watched.

    .venv/bin/python bench/day.py [--tasks 1000000] [--rate 100] [--owners 10000]
                                  [--agents 200] [--replicas 2] [--schedules 200]
                                  [--runs-per-min 30] [--retention-s 300] [--json out.json]

The stack: a fresh embedded PostgreSQL (durable settings), ``--replicas`` core replicas,
the cron service and the DAG service as their own processes, and ``--agents`` simulated
agents (``bench/fleet.py``'s: long-poll claims, heartbeats, each attempt reported after a
sampled duration). ``--owners`` people each hold a token; single submissions come at
``--rate`` a second, round robin over the owners and the replicas, until ``--tasks``;
``--schedules`` minutely cron schedules of owners among them fire their own tasks; a
diamond workflow (four nodes) runs ``--runs-per-min`` times a minute from owners among
them. Core keeps finished tasks ``--retention-s`` (``CAIRN_RETENTION_DAYS``, the audit log
the same), purging each ``--purge-s``.

Every ``--sample-s``: tasks submitted and finished, the services' resident memory (each
core replica, cron, dag), the database's size and core's task and attempt tables'. At the
end, from what the agents were handed and what the database holds: every single
submission succeeded, no task was handed out twice, every cron fire made one task, every
run succeeded. The database's growth per task (tables and indexes, once retention holds
the live rows steady) extrapolates to a month of retention at the documents' million
tasks a day.

Bar (issue 30): 0 lost, 0 run twice, every service's resident memory within 1.2x of its
size after the first minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    SPEC,
    Agent,
    Counts,
    Http,
    bulk_tokens,
    launch,
    start_replicas,
)
from peak import Submitter, db_sample
from stack import core_stack, exit_on_sigterm, free_port, start_service

from libs.common.settings import libpq_url
from services.core import admin
from services.worker.agent import claim_wait

MEMORY_BAR = 1.2
DAY_TASKS, MONTH_DAYS = 1_000_000, 30


class Seen(Agent):
    """A simulated agent that also notes each task it is handed (run twice: a task
    handed out more than once) and what made it (cron, a DAG run, or a person)."""

    handed: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    by_kind: dict[str, set[int]] = {}

    def took(self, assignment: dict[str, Any]) -> None:
        Seen.handed[assignment["task_id"]] += 1
        kind = (assignment["args"] or ["single"])[0]
        Seen.kinds[kind] += 1
        Seen.by_kind.setdefault(kind, set()).add(assignment["task_id"])


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def relations(db: psycopg.Connection[Any]) -> dict[str, float]:
    """The 15 largest tables (with their indexes and TOAST), in MB."""
    return {
        name: round(size / 2**20, 2)
        for name, size in db.execute(
            "SELECT n.nspname || '.' || c.relname, pg_total_relation_size(c.oid)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
            " ORDER BY 2 DESC LIMIT 15"
        ).fetchall()
    }


#: what made a task, in its first argument: a person's single submission has none
NODE = {**{k: v for k, v in SPEC.items() if k != "name"}, "args": ["dag"]}
DIAMOND = {
    "name": "diamond",
    "nodes": [
        {"name": "a", "task": NODE},
        {"name": "b", "task": NODE, "depends_on": ["a"]},
        {"name": "c", "task": NODE, "depends_on": ["a"]},
        {"name": "d", "task": NODE, "depends_on": ["b", "c"]},
    ],
}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    days = args.retention_s / 86400
    env = {
        "CAIRN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "CAIRN_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "CAIRN_RETENTION_DAYS": f"{days:.9f}",
        "CAIRN_AUDIT_RETENTION_DAYS": f"{days:.9f}",
        "CAIRN_RETENTION_INTERVAL_S": str(args.purge_s),
        **dict(item.split("=", 1) for item in args.core_env),
    }
    with core_stack("cairn-bench-day-", **env) as stack:
        procs: list[subprocess.Popen[bytes]] = []
        out: dict[str, Any] = {"samples": []}
        try:
            ports = start_replicas(stack, args.replicas, procs, **env)
            services: dict[str, int] = {
                f"core{i}": pid for i, pid in enumerate([stack.core_pid, *(p.pid for p in procs)])
            }
            common = {
                "CAIRN_DATABASE_URL": stack.database_url,
                "CAIRN_MIGRATE_ON_START": "false",
                "CAIRN_LOG_LEVEL": "warning",
                "CAIRN_URL": stack.core_url,
            }
            cron_port, dag_port = free_port(), free_port()
            cron_url, dag_url = f"http://127.0.0.1:{cron_port}", f"http://127.0.0.1:{dag_port}"
            for module, name, port, url in (
                ("services.cron", "cron", cron_port, cron_url),
                ("services.dag", "dag", dag_port, dag_url),
            ):
                token = await asyncio.to_thread(
                    admin.create_token, stack.database_url, name, "service"
                )
                proc = await asyncio.to_thread(
                    start_service,
                    module,
                    {
                        **common,
                        "CAIRN_HOME": str(stack.root / name),
                        f"CAIRN_{name.upper()}_PORT": str(port),
                        "CAIRN_TOKEN": token,
                    },
                    url,
                )
                procs.append(proc)
                services[name] = proc.pid
            worker = await asyncio.to_thread(
                admin.create_token, stack.database_url, "fleet", "worker"
            )
            owners = await asyncio.to_thread(bulk_tokens, stack.database_url, args.owners)
            c = Counts()
            fleet, loops = await launch(Seen, ports, worker, c, args.agents, args.run_ms, args.cap)
            # schedules and workflows, each of an owner of its own
            step = max(1, args.owners // max(1, args.schedules))
            async with httpx.AsyncClient(timeout=30) as http:
                for i in range(args.schedules):
                    owner = owners[(i * step) % len(owners)]
                    body = {
                        "name": f"minutely-{i}",
                        "expression": "* * * * *",
                        "target": {"kind": "task", "task": {**SPEC, "args": ["cron"]}},
                    }
                    r = await http.post(
                        cron_url + "/v1/schedules",
                        json=body,
                        headers={"Authorization": f"Bearer {owner}"},
                    )
                    r.raise_for_status()
                flow_owners = owners[: max(1, min(50, len(owners)))]
                for owner in flow_owners:
                    r = await http.post(
                        dag_url + "/v1/workflows",
                        json=DIAMOND,
                        headers={"Authorization": f"Bearer {owner}"},
                    )
                    r.raise_for_status()
            await asyncio.sleep(claim_wait(HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S) + 2)
            submitter = Submitter([Http(p, "") for p in ports], owners, args.in_flight, c)
            runs: list[int] = []
            run_errors: Counter[str] = Counter()

            async def start_runs(seconds: float) -> None:
                async with httpx.AsyncClient(timeout=30) as http:
                    n = 0
                    started = time.monotonic()
                    while time.monotonic() - started < seconds:
                        owner = flow_owners[n % len(flow_owners)]
                        try:
                            r = await http.post(
                                dag_url + "/v1/workflows/diamond/runs",
                                json={},
                                headers={"Authorization": f"Bearer {owner}"},
                            )
                            if r.status_code == 201:
                                runs.append(r.json()["id"])
                            else:
                                run_errors[str(r.status_code)] += 1
                        except httpx.HTTPError as exc:
                            run_errors[type(exc).__name__] += 1
                        n += 1
                        await asyncio.sleep(60 / args.runs_per_min)

            seconds = args.tasks / args.rate
            t0 = time.monotonic()
            main = asyncio.create_task(submitter.run(args.rate, seconds))
            flows = asyncio.create_task(start_runs(seconds))
            with psycopg.connect(libpq_url(stack.database_url), autocommit=True) as db:
                while not main.done():
                    await asyncio.wait({main}, timeout=args.sample_s)
                    d = db_sample(db)
                    point = {
                        "t_s": round(time.monotonic() - t0),
                        "submitted": c.submitted,
                        "reported": c.reported,
                        "handed": dict(Seen.kinds),
                        "rss_mb": {name: rss_mb(pid) for name, pid in services.items()},
                        "database_mb": round(d["database"] / 2**20, 1),
                        "tables_mb": {
                            name: round((t["table"] + t["indexes"]) / 2**20, 1)
                            for name, t in d["tables"].items()
                        },
                        "live_tasks": d["tables"].get("tasks", {}).get("live"),
                        "errors": c.errors,
                    }
                    if not out.get("relations_first_minute") and point["t_s"] >= 60:
                        out["relations_first_minute"] = relations(db)
                    out["samples"].append(point)
                    print(json.dumps(point), flush=True)
                await flows
                # no more fires: what cron recorded is what must have run
                cron_proc = procs[-2]
                cron_proc.send_signal(signal.SIGTERM)
                cron_proc.wait(30)
                fired = [
                    task_id
                    for (task_id,) in db.execute(
                        "SELECT task_id FROM cron.fires WHERE outcome = 'submitted'"
                    ).fetchall()
                ]
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:
                    unhanded = set(fired) - Seen.by_kind.get("cron", set())
                    open_runs = db.execute(
                        "SELECT count(*) FROM dag.runs WHERE id = ANY(%s)"
                        " AND state NOT IN ('succeeded', 'failed', 'cancelled')",
                        (runs,),
                    ).fetchone()
                    if (
                        c.reported >= sum(Seen.handed.values())
                        and not (open_runs or [0])[0]
                        and not unhanded
                    ):
                        break
                    await asyncio.sleep(1)
                await asyncio.sleep(2)
                for agent in fleet:
                    agent.stopping = True
                for task in loops:
                    task.cancel()
                ids = set(c.submitted_ids)
                out["single"] = {
                    "submitted": len(ids),
                    "not_handed": len(ids - Seen.handed.keys()),
                }
                out["handed_twice"] = sum(1 for n in Seen.handed.values() if n > 1)
                out["handed"] = dict(Seen.kinds)
                out["runs"] = {
                    "started": len(runs),
                    "states": dict(
                        db.execute(
                            "SELECT state, count(*) FROM dag.runs WHERE id = ANY(%s) GROUP BY 1",
                            (runs,),
                        ).fetchall()
                    ),
                    "errors": dict(run_errors),
                }
                out["cron"] = {
                    "fires": dict(
                        db.execute("SELECT outcome, count(*) FROM cron.fires GROUP BY 1").fetchall()
                    ),
                    "not_handed": sum(1 for t in fired if t not in Seen.by_kind.get("cron", set())),
                }
                # what an unfinished run waits on: its nodes, and their tasks in core
                out["unfinished_runs"] = [
                    f"run {run_id} node {name}: {state} try {try_number}, task {task_id}"
                    f" {task_state or '-'}, node updated {updated}"
                    for run_id, name, state, try_number, task_id, task_state, updated in db.execute(
                        "SELECT n.run_id, n.name, n.state, n.try_number, n.task_id, t.state,"
                        " n.updated_at FROM dag.nodes n JOIN dag.runs r ON r.id = n.run_id"
                        " LEFT JOIN core.tasks t ON t.id = n.task_id"
                        " WHERE r.id = ANY(%s) AND r.state NOT IN"
                        " ('succeeded', 'failed', 'cancelled')"
                        " AND n.state NOT IN ('succeeded', 'skipped')"
                        " ORDER BY 1, 2 LIMIT 40",
                        (runs,),
                    ).fetchall()
                ]
                out["relations_end"] = relations(db)
                out["errors"], out["why"] = c.errors, c.why
        finally:
            for proc in reversed(procs):
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return out


def summary(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    samples = out["samples"]
    base = next((s for s in samples if s["t_s"] >= 60), samples[0])
    last = samples[-1]
    memory = {
        name: round(last["rss_mb"][name] / base["rss_mb"][name], 2)
        for name in base["rss_mb"]
        if base["rss_mb"][name] and last["rss_mb"].get(name)
    }
    # growth per task once retention holds: the last half of the run
    mid = samples[len(samples) // 2]
    tasks = max(1, last["submitted"] - mid["submitted"])
    return {
        "memory_ratio": memory,
        "database_mb": [mid["database_mb"], last["database_mb"]],
        "live_tasks": [mid["live_tasks"], last["live_tasks"]],
        "per_task_bytes_at_end": round(
            sum(last["tables_mb"].values()) * 2**20 / max(1, last["live_tasks"] or 1)
        ),
        "tasks_in_second_half": tasks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=DAY_TASKS, help="single submissions")
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--owners", type=int, default=10_000)
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--runs-per-min", type=float, default=30.0)
    parser.add_argument("--retention-s", type=float, default=300.0)
    parser.add_argument("--purge-s", type=float, default=10.0)
    parser.add_argument("--run-ms", type=float, default=200.0)
    parser.add_argument("--cap", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=128)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--core-env", action="append", default=[])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    out = asyncio.run(run(args))
    out["summary"] = summary(out, args)
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
