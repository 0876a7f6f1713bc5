"""Peak benchmark (issue 30, part 3): single submissions at a steady rate, open loop, for
minutes, with a fleet of simulated agents waiting over several core replicas.

    .venv/bin/python bench/peak.py [--rate 500] [--minutes 10] [--agents 1000]
                                   [--replicas 2] [--run-ms 200] [--sample-s 30]
                                   [--ramp 50,100,150] [--json results.json]

The stack is ``bench/fleet.py``'s: a fresh embedded PostgreSQL (durable settings), core
replicas on their own ports over it, and ``--agents`` simulated agents on a raw HTTP
client spread over the replicas (register, long-poll claims of the real agent's wait,
heartbeats, each attempt reported after a sampled duration). Submissions go round robin
over the replicas, each from one of ``--owners`` owners, at most ``--in-flight`` at once:
an offered rate the stack cannot take shows as a lower achieved rate, not as an unbounded
pile of connections.

``--ramp`` first runs short steps (``--step-s`` each) at the rates given, to show where
the stack stops keeping up; then the main run at ``--rate`` for ``--minutes``. Every
``--sample-s``: the rate achieved, created -> leased p50/p99 of the tasks created in the
window (PostgreSQL's clock), tasks not yet leased, core's, PostgreSQL's and this
process's CPU, commits and WAL per second, the size of core's task and attempt tables and
their indexes, their dead rows and autovacuum runs. At the end: every task succeeded with
one attempt (0 lost, 0 run twice).

Bar (issue 30): 500 tasks/s for 10 minutes, 1,000 agents, two replicas: created -> leased
p99 at most 50 ms, 0 lost, 0 run twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    SPEC,
    Agent,
    Counts,
    Http,
    add_host_args,
    bulk_tokens,
    check_host_args,
    hosts_of,
    launch,
    noted,
    pg_cpu_s,
    start_replicas,
)
from netns import Hosts
from procstat import cpu_s
from rawhttp import Conn, request_bytes
from stack import core_stack, exit_on_sigterm

from libs.common.settings import libpq_url
from services.core import admin
from services.worker.agent import claim_wait

P99_BAR_MS = 50.0
TABLES = ("tasks", "attempts")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def db_sample(db: psycopg.Connection[Any]) -> dict[str, Any]:
    """PostgreSQL's clock, commits, WAL position, table sizes, dead rows, autovacuums."""
    row = db.execute(
        "SELECT now(), xact_commit, pg_current_wal_lsn() - '0/0'::pg_lsn,"
        " pg_database_size(current_database()) FROM pg_stat_database"
        " WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    tables = {
        name: {"table": t, "indexes": i, "live": live, "dead": dead, "autovacuums": av}
        for name, t, i, live, dead, av in db.execute(
            "SELECT relname, pg_table_size(relid), pg_indexes_size(relid), n_live_tup,"
            " n_dead_tup, autovacuum_count FROM pg_stat_user_tables"
            " WHERE schemaname = 'core' AND relname = ANY(%s)",
            (list(TABLES),),
        ).fetchall()
    }
    activity = {
        f"{state}/{wait or '-'}": n
        for state, wait, n in db.execute(
            "SELECT state, wait_event_type, count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY 1, 2"
        ).fetchall()
    }
    held = [
        f"{int(ms)} ms: {query}"
        for ms, query in db.execute(
            "SELECT extract(epoch FROM now() - xact_start) * 1000, left(query, 70)"
            " FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle in transaction' AND now() - xact_start > interval '100 ms'"
            " ORDER BY 1 DESC LIMIT 5"
        ).fetchall()
    ]
    return {
        "now": row[0],
        "activity": activity,
        "held": held,
        "commits": int(row[1]),
        "wal": int(row[2]),
        "database": int(row[3]),
        "tables": tables,
    }


def waits(db: psycopg.Connection[Any], since: Any, until: Any | None = None) -> dict[str, Any]:
    """created -> leased (first attempt's start) p50/p99 of the tasks created in a window,
    and how many of them are not leased yet."""
    row = db.execute(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d),"
        " percentile_cont(0.99) WITHIN GROUP (ORDER BY d), max(d), count(d),"
        " count(*) - count(d) FROM ("
        " SELECT extract(epoch FROM a.started_at - t.created_at) * 1000 AS d"
        " FROM core.tasks t LEFT JOIN core.attempts a ON a.task_id = t.id AND a.number = 1"
        " WHERE t.created_at >= %s AND (%s::timestamptz IS NULL OR t.created_at < %s)) x",
        (since, until, until),
    ).fetchone()
    assert row is not None

    def ms(v: Any) -> float | None:
        return round(float(v), 1) if v is not None else None

    return {
        "p50": ms(row[0]),
        "p99": ms(row[1]),
        "max": ms(row[2]),
        "n": row[3],
        "unleased": row[4],
    }


class Submitter:
    """Open loop: one single submission every 1/rate s, round robin over the replicas and
    over the owners' tokens, at most ``in_flight`` at once (a submission that would pass
    it waits: the achieved rate falls behind the offered one)."""

    def __init__(self, https: list[Http], tokens: list[str], in_flight: int, c: Counts) -> None:
        self.https = https
        self.tokens = tokens
        self.slots = asyncio.Semaphore(in_flight)
        self.idle: list[list[Conn]] = [[] for _ in https]
        self.c = c
        self.n = 0
        self.late = 0

    async def _one(self, i: int, token: str, key: str) -> None:
        """One submission, with an idempotency key: a keep-alive connection core closed
        while it sat idle is met by sending again on a fresh one, as an HTTP client
        does, and the key makes a second send of the same submission harmless."""
        try:
            http = self.https[i]
            data = json.dumps({**SPEC, "idempotency_key": key}, separators=(",", ":")).encode()
            for fresh in (False, True):
                conn = self.idle[i].pop() if self.idle[i] and not fresh else await http.connect()
                try:
                    status, body = await conn.request(
                        request_bytes("127.0.0.1", http.port, "/v1/tasks", data, token), 30
                    )
                    break
                except (ConnectionError, TimeoutError, OSError) as exc:
                    conn.transport.close()
                    if fresh:
                        noted(self.c, f"submit {exc!r}")
                        return
            if status in (200, 201):
                self.c.submitted += 1
                self.c.submitted_ids.append(json.loads(body)["id"])
            else:
                noted(self.c, f"submit {status} {body[:80]!r}")
            self.idle[i].append(conn)
        finally:
            self.slots.release()

    async def run(self, rate: float, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        pending: set[asyncio.Task[None]] = set()
        k = 0
        while (due := start + k / rate) < start + seconds:
            await asyncio.sleep(max(0.0, due - loop.time()))
            if self.slots.locked():
                self.late += 1
            await self.slots.acquire()
            token = self.tokens[self.n % len(self.tokens)]
            task = loop.create_task(self._one(self.n % len(self.https), token, f"bench-{self.n}"))
            pending.add(task)
            task.add_done_callback(pending.discard)
            self.n += 1
            k += 1
        if pending:
            await asyncio.wait(pending, timeout=60)


def owners_tokens(database_url: str, owners: int) -> list[str]:
    return [admin.create_token(database_url, f"owner-{i}", "user") for i in range(owners)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "CAIRN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "CAIRN_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        **dict(item.split("=", 1) for item in args.core_env),
    }
    hosts = hosts_of(args, env)
    with contextlib.ExitStack() as made:
        if hosts is not None:
            made.enter_context(hosts)
        return await measure(args, env, hosts)


async def measure(
    args: argparse.Namespace, env: dict[str, str], hosts: Hosts | None
) -> dict[str, Any]:
    with core_stack("cairn-bench-peak-", **env) as stack:
        extra: list[subprocess.Popen[bytes]] = []
        try:
            ports = start_replicas(stack, args.replicas, extra, **env)
            cores = [stack.core_pid, *(p.pid for p in extra)]
            worker = await asyncio.to_thread(
                admin.create_token, stack.database_url, "fleet", "worker"
            )
            tokens = await asyncio.to_thread(bulk_tokens, stack.database_url, args.owners)
            c = Counts()
            fleet, loops = await launch(
                Agent, ports, worker, c, args.agents, args.run_ms, args.cap, hosts
            )
            await asyncio.sleep(claim_wait(HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S) + 2)
            submitter = Submitter([Http(p, "") for p in ports], tokens, args.in_flight, c)
            out: dict[str, Any] = {"ramp": [], "windows": []}
            with psycopg.connect(libpq_url(stack.database_url), autocommit=True) as db:

                def point() -> dict[str, Any]:
                    return {
                        **db_sample(db),
                        "at": time.monotonic(),
                        "core": sum(cpu_s(p) for p in cores),
                        "pg": pg_cpu_s(stack.postmaster_pid),
                        "bench": own_cpu_s(),
                        "submitted": c.submitted,
                        "late": submitter.late,
                    }

                def window(a: dict[str, Any], b: dict[str, Any], rate: float) -> dict[str, Any]:
                    s = b["at"] - a["at"]
                    tasks = b["submitted"] - a["submitted"]
                    w = {
                        "offered_per_s": rate,
                        "achieved_per_s": round(tasks / s, 1),
                        "late": b["late"] - a["late"],
                        "since": a["now"],
                        "until": b["now"],
                        "created_to_leased_ms": waits(db, a["now"], b["now"]),
                        "core_ms_per_s": round((b["core"] - a["core"]) / s * 1000),
                        "pg_ms_per_s": round((b["pg"] - a["pg"]) / s * 1000),
                        "bench_ms_per_s": round((b["bench"] - a["bench"]) / s * 1000),
                        "cpu_ms_per_task": round(
                            (b["core"] - a["core"] + b["pg"] - a["pg"]) * 1000 / max(1, tasks), 2
                        ),
                        "commits_per_s": round((b["commits"] - a["commits"]) / s),
                        "wal_kb_per_s": round((b["wal"] - a["wal"]) / s / 1024),
                        "database_mb": round(b["database"] / 2**20, 1),
                        "tables": b["tables"],
                        "connections": b["activity"],
                        "held_over_100ms": b["held"],
                        "errors": c.errors,
                        "why": dict(c.why),
                    }
                    print(json.dumps(w, default=str), flush=True)
                    return w

                for rate in (float(r) for r in args.ramp.split(",") if r):
                    a = point()
                    await submitter.run(rate, args.step_s)
                    b = point()
                    await asyncio.sleep(2)  # the last ones leased
                    out["ramp"].append(window(a, b, rate))
                first = point()
                main = asyncio.create_task(submitter.run(args.rate, args.minutes * 60))
                a = first
                while not main.done():
                    await asyncio.wait({main}, timeout=args.sample_s)
                    b = point()
                    out["windows"].append(window(a, b, args.rate))
                    a = b
                last = a  # taken as the submissions ended
                await asyncio.sleep(2)  # the last ones leased
                deadline = time.monotonic() + 120
                while c.reported < c.submitted and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                for agent in fleet:
                    agent.stopping = True
                for task in loops:
                    task.cancel()
                ids = c.submitted_ids
                # again, now that every task is leased (at a sample, the newest were not)
                for w in out["ramp"] + out["windows"]:
                    w["created_to_leased_ms"] = waits(db, w.pop("since"), w.pop("until"))
                out["main"] = {
                    "offered_per_s": args.rate,
                    "seconds": round(last["at"] - first["at"], 1),
                    "submitted": last["submitted"] - first["submitted"],
                    "late": last["late"] - first["late"],
                    "created_to_leased_ms": waits(db, first["now"], last["now"]),
                    "cpu_ms_per_task": round(
                        (last["core"] - first["core"] + last["pg"] - first["pg"])
                        * 1000
                        / max(1, last["submitted"] - first["submitted"]),
                        2,
                    ),
                    "wal_kb_per_task": round(
                        (last["wal"] - first["wal"])
                        / 1024
                        / max(1, last["submitted"] - first["submitted"]),
                        2,
                    ),
                    "growth_mb": {
                        name: round(
                            (
                                last["tables"][name]["table"]
                                + last["tables"][name]["indexes"]
                                - first["tables"][name]["table"]
                                - first["tables"][name]["indexes"]
                            )
                            / 2**20,
                            1,
                        )
                        for name in TABLES
                    },
                }
                out["states"] = dict(
                    db.execute(
                        "SELECT state, count(*) FROM core.tasks WHERE id = ANY(%s) GROUP BY 1",
                        (ids,),
                    ).fetchall()
                )
                twice = db.execute(
                    "SELECT count(*) FROM (SELECT task_id FROM core.attempts"
                    " WHERE task_id = ANY(%s) GROUP BY 1 HAVING count(*) > 1) x",
                    (ids,),
                ).fetchone()
                out["run_twice"] = twice[0] if twice else None
                out["submitted"] = c.submitted
                out["errors"], out["why"] = c.errors, c.why
        finally:
            for proc in extra:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--owners", type=int, default=100)
    parser.add_argument("--run-ms", type=float, default=200.0)
    parser.add_argument("--cap", type=int, default=4, help="attempts an agent runs at once")
    parser.add_argument("--in-flight", type=int, default=128, help="submissions at once")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--ramp", default="", help="rates of short steps before the run")
    parser.add_argument("--step-s", type=float, default=20.0)
    parser.add_argument(
        "--core-env", action="append", default=[], help="KEY=VALUE for every core replica"
    )
    add_host_args(parser)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_host_args(parser, args)
    exit_on_sigterm()
    out = asyncio.run(run(args))
    m = out["main"]
    lat = m["created_to_leased_ms"]
    print(
        f"{args.agents} agents, {args.replicas} core replicas, offered {args.rate}/s for"
        f" {m['seconds']} s: achieved {m['submitted'] / m['seconds']:.1f}/s"
        f" ({m['late']} submissions waited for a free slot); created -> leased p50"
        f" {lat['p50']} ms, p99 {lat['p99']} ms (bar {P99_BAR_MS}), max {lat['max']} ms;"
        f" {m['cpu_ms_per_task']} ms CPU (core + PostgreSQL) and {m['wal_kb_per_task']} KB WAL"
        f" a task; growth {m['growth_mb']} MB; states {out['states']},"
        f" run twice {out['run_twice']}, errors {out['errors']} {out['why']}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
