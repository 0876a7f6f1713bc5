"""Fleet benchmark: what waiting workers cost core and PostgreSQL, and what a task costs
with a fleet waiting (issue 30).

    .venv/bin/python bench/fleet.py [--agents 10,100,1000] [--replicas 1] [--phase-s 30]
                                    [--rate 20] [--run-ms 200] [--json results.json]
                                    [--hosts 8 --rtt-ms 1]

For each number of agents (and of core replicas), a fresh embedded PostgreSQL (durable
settings) and core (``bench/stack.py``), plus ``--replicas - 1`` more core processes on
their own ports over the same database. Simulated agents, in this process on a raw
HTTP/1.1 client (``bench/rawhttp.py``: tens of microseconds a request, where httpx would
cost milliseconds on the same two cores), do what the agent does: register, turn with a
long-poll claim of the agent's own wait (``services.worker.agent.claim_wait`` for core's
heartbeat settings), beat every heartbeat interval, and report each attempt leased after
a sampled duration (exponential, mean ``--run-ms``) on a second connection, as the
agent's courier does. The agents are spread over the replicas. With ``--hosts N`` (root) they
are spread over N simulated hosts as well: network namespaces on veth pairs, ``--rtt-ms``
away (``bench/netns.py``: ``tc netem`` where the kernel has it, else the client adds the
delay), and core's replicas listen on every address.

Three phases of ``--phase-s`` each, measured from /proc and PostgreSQL's statistics:
no agents; the agents registered and idle; the agents and ``--rate`` single submissions a
second, open loop, spread over the replicas. Per phase: turns/s, PostgreSQL commits/s
and WAL bytes/s, core's and PostgreSQL's CPU. Derived: the idle cost per agent-second
(idle less no agents, over agents x seconds) and the CPU per task (load less idle, over
the tasks), core and PostgreSQL together; created → leased p50/p99 from the database; and
at the end every task must have succeeded with exactly one attempt (0 lost, 0 run twice).

Bars (issue 30): CPU per task at 1,000 agents at most 1.2 x that at 10; idle cost at most
0.2 ms of CPU per agent-second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import Hosts
from netns import available as netns_available
from procstat import children, children_cpu_s, comm, cpu_s, reaped_cpu_s
from rawhttp import Conn, request_bytes
from sqlalchemy.ext.asyncio import create_async_engine
from stack import Stack, core_stack, exit_on_sigterm, free_port, start_core

from libs.common.models import WORKER_LEASE_HEADER
from libs.common.settings import libpq_url
from services.core import admin
from services.core.db import tokens as tokens_db
from services.worker.agent import claim_wait

TASK_PER_AGENT_BAR = 1.2
IDLE_BAR_MS = 0.2
HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S = 60.0, 180.0
IDLE_CLOSE_S = 4.0
TRUE = {
    "uri": "file:///bin/true",
    "sha256": hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest(),
}
SPEC = {
    "name": "fleet",
    "artifact": {"uri": "file:///bin/true", "sha256": "0" * 64},
    "resources": {"cpu": 0.01, "memory_mb": 1},
}


def start_real_agent(core_url: str, token: str, home: Path) -> subprocess.Popen[bytes]:
    """One real agent (``python -m services.worker``, isolation as deployed) on its own
    queue, ``real``, among the simulated ones."""
    env = {
        **os.environ,
        "CAIRN_URL": core_url,
        "CAIRN_TOKEN": token,
        "CAIRN_HOME": str(home),
        "CAIRN_WORKER_QUEUES": "real",
        "CAIRN_WORKER_SLOTS": "4",
        "CAIRN_WORKER_CPU": "1",
        "CAIRN_WORKER_MEMORY_MB": "512",
        "CAIRN_WORKER_DRAIN_GRACE_S": "2",
        "CAIRN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "CAIRN_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "CAIRN_LOG_LEVEL": "warning",
    }
    env.pop("CAIRN_DATABASE_URL", None)
    return subprocess.Popen([sys.executable, "-m", "services.worker"], env=env)


def tree_cpu_s(pid: int) -> float:
    """A process's own CPU and its live children's (the agent's sidecar and spawn
    helpers; the attempts themselves end and are reaped)."""
    return cpu_s(pid) + sum(cpu_s(p) for p in children(pid) if comm(p) != "true")


async def real_submitter(http: Http, rate: float, seconds: float, c: Counts) -> list[int]:
    """``rate`` tasks a second to the real agent's queue, each running /bin/true."""
    spec = {
        "name": "real",
        "queue": "real",
        "artifact": TRUE,
        "resources": {"cpu": 0.01, "memory_mb": 16},
    }
    ids: list[int] = []
    conn = await http.connect()
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while (due := start + n / rate) < start + seconds:
        await asyncio.sleep(max(0.0, due - loop.time()))
        n += 1
        try:
            status, body = await conn.request(http.request("/v1/tasks", spec), 30)
        except (ConnectionError, TimeoutError, OSError) as exc:
            noted(c, f"real submit {exc!r}")
            conn = await http.connect()
            continue
        if status == 201:
            ids.append(json.loads(body)["id"])
        else:
            noted(c, f"real submit {status} {body[:80]!r}")
    conn.transport.close()
    return ids


def noted(c: Counts, why: str) -> None:
    """An error, counted by what it was."""
    c.errors += 1
    c.why[why[:100]] = c.why.get(why[:100], 0) + 1


@dataclass
class Counts:
    turns: int = 0
    beats: int = 0
    leased: int = 0
    reported: int = 0
    submitted: int = 0
    errors: int = 0
    why: dict[str, int] = field(default_factory=dict)
    submitted_ids: list[int] = field(default_factory=list)


class Http:
    """Keep-alive raw HTTP connections to one core replica: from this host's loopback, or
    from simulated host ``index`` of ``hosts`` (its own network namespace, ``--rtt-ms``
    away)."""

    def __init__(self, port: int, token: str, hosts: Hosts | None = None, index: int = 0) -> None:
        self.port = port
        self.token = token
        self.hosts = hosts
        self.index = index
        self.host = hosts.core_addr(index % hosts.count) if hosts else "127.0.0.1"

    async def connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        if self.hosts is None:
            _, conn = await loop.create_connection(lambda: Conn(loop), self.host, self.port)
            return conn
        sock = self.hosts.socket(self.index)
        try:
            await loop.sock_connect(sock, (self.host, self.port))
        except BaseException:
            sock.close()
            raise
        delay = self.hosts.client_delay_s
        _, conn = await loop.create_connection(lambda: Conn(loop, delay), sock=sock)
        if delay:  # the handshake's round trip
            await asyncio.sleep(delay)
        return conn

    def request(self, path: str, body: Any, headers: dict[str, str] | None = None) -> bytes:
        data = json.dumps(body, separators=(",", ":")).encode()
        return request_bytes(self.host, self.port, path, data, self.token, headers)


class Agent:
    """One simulated agent: a claim connection (long polls) and a report connection."""

    def __init__(self, http: Http, counts: Counts, run_ms: float, cap: int) -> None:
        self.http = http
        self.counts = counts
        self.run_ms = run_ms
        self.cap = cap
        self.id = 0
        self.headers: dict[str, str] = {}
        self.running: set[int] = set()
        self.stopping = False

    async def register(self, name: str) -> None:
        conn = await self.http.connect()
        offer = {
            "hostname": name, "queues": ["default"], "cpu": 1000, "memory_mb": 1_000_000,
            "hang_watch": True,  # as the agent: its turns are watched (last_turn_at)
        }  # fmt: skip
        status, body = await conn.request(self.http.request("/v1/workers", offer), 30)
        conn.transport.close()
        if status != 201:
            raise RuntimeError(f"register: {status} {body[:200]!r}")
        answer = json.loads(body)
        self.id = answer["worker"]["id"]
        self.headers = {WORKER_LEASE_HEADER: answer["lease"]}

    async def claim_loop(self) -> None:
        wait = claim_wait(HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S)
        # A fleet's agents start at different moments: their long polls end spread over
        # the wait, not all at once.
        await asyncio.sleep(random.uniform(0, wait))
        conn = await self.http.connect()
        used = time.monotonic()
        path = f"/v1/workers/{self.id}/turn"
        while not self.stopping:
            room = self.cap - len(self.running)
            if room <= 0:
                await asyncio.sleep(0.05)
                continue
            turn = {"claim": {"cpu": 1000, "memory_mb": 1_000_000, "max": room, "wait": wait}}
            if time.monotonic() - used > IDLE_CLOSE_S:
                # core closes a keep-alive connection idle for 5 s (uvicorn's default);
                # an HTTP client notices before it sends, and opens another
                conn.transport.close()
                conn = await self.http.connect()
            try:
                status, body = await conn.request(
                    self.http.request(path, turn, self.headers), wait + 30
                )
            except (ConnectionError, TimeoutError, OSError) as exc:
                noted(self.counts, f"turn {exc!r}")
                conn = await self.http.connect()
                continue
            used = time.monotonic()
            self.counts.turns += 1
            if status != 200:
                noted(self.counts, f"turn {status} {body[:80]!r}")
                await asyncio.sleep(0.5)
                continue
            for a in json.loads(body)["attempts"]:
                self.took(a)
                self.counts.leased += 1
                self.running.add(a["attempt_id"])
                asyncio.get_running_loop().create_task(self._run(a["attempt_id"]))

    def took(self, assignment: dict[str, Any]) -> None:
        """Each attempt as it is handed out (bench/day.py counts them)."""

    async def _run(self, attempt_id: int) -> None:
        await asyncio.sleep(random.expovariate(1000.0 / self.run_ms) if self.run_ms else 0)
        conn = await self.http.connect()
        try:
            report = {"attempt_id": attempt_id, "outcome": "succeeded", "exit_code": 0}
            path = f"/v1/workers/{self.id}/turn"
            for _ in range(5):
                try:
                    status, _ = await conn.request(
                        self.http.request(path, {"reports": [report]}, self.headers), 30
                    )
                except (ConnectionError, TimeoutError, OSError):
                    conn = await self.http.connect()
                    continue
                if status == 200:
                    self.counts.reported += 1
                    break
                noted(self.counts, f"report {status}")
        finally:
            conn.transport.close()
            self.running.discard(attempt_id)

    async def beat_loop(self) -> None:
        """The sidecar's beat, each on a fresh connection (core closes a keep-alive
        connection idle for seconds; the sidecar's client reconnects the same way)."""
        await asyncio.sleep(random.uniform(0, HEARTBEAT_INTERVAL_S))
        path = f"/v1/workers/{self.id}/heartbeat"
        while not self.stopping:
            try:
                conn = await self.http.connect()
                try:
                    status, body = await conn.request(
                        self.http.request(path, {"attempts": sorted(self.running)}, self.headers),
                        30,
                    )
                finally:
                    conn.transport.close()
                self.counts.beats += 1
                if status != 200:
                    noted(self.counts, f"beat {status} {body[:80]!r}")
            except (ConnectionError, TimeoutError, OSError) as exc:
                noted(self.counts, f"beat {exc!r}")
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)


@dataclass
class Sample:
    at: float
    core_s: float
    pg_s: float
    commits: int
    wal: int
    counts: dict[str, int]
    #: core.tasks' and core.attempts' updates and HOT updates (pg_stat_user_tables)
    updates: dict[str, int] = field(default_factory=dict)


def pg_cpu_s(postmaster: int) -> float:
    """The postmaster's own CPU, its reaped children's, and its live children's."""
    return cpu_s(postmaster) + reaped_cpu_s(postmaster) + children_cpu_s(postmaster)


def sample(db: psycopg.Connection[Any], cores: list[int], postmaster: int, c: Counts) -> Sample:
    row = db.execute(
        "SELECT xact_commit, pg_current_wal_lsn() - '0/0'::pg_lsn FROM pg_stat_database"
        " WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    counts = {k: v for k, v in vars(c).items() if isinstance(v, int)}
    updates: dict[str, int] = {}
    for name, upd, hot in db.execute(
        "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE schemaname = 'core' AND relname IN ('tasks', 'attempts')"
    ):
        updates[f"{name}_upd"], updates[f"{name}_hot"] = int(upd), int(hot)
    return Sample(
        time.monotonic(),
        sum(cpu_s(p) for p in cores),
        pg_cpu_s(postmaster),
        int(row[0]),
        int(row[1]),
        counts,
        updates,
    )


def hot_share(a: Sample, b: Sample) -> dict[str, Any]:
    """Of each table's updates between two samples, the HOT share (no index touched)."""
    out: dict[str, Any] = {}
    for table in ("tasks", "attempts"):
        upd = b.updates.get(f"{table}_upd", 0) - a.updates.get(f"{table}_upd", 0)
        hot = b.updates.get(f"{table}_hot", 0) - a.updates.get(f"{table}_hot", 0)
        out[table] = f"{hot}/{upd}"
    return out


def phase(a: Sample, b: Sample) -> dict[str, float]:
    s = b.at - a.at
    return {
        "seconds": round(s, 2),
        "turns_per_s": round((b.counts["turns"] - a.counts["turns"]) / s, 1),
        "beats_per_s": round((b.counts["beats"] - a.counts["beats"]) / s, 1),
        "tasks": b.counts["submitted"] - a.counts["submitted"],
        "commits_per_s": round((b.commits - a.commits) / s, 1),
        "wal_kb_per_s": round((b.wal - a.wal) / s / 1024, 1),
        "core_ms_per_s": round((b.core_s - a.core_s) / s * 1000, 1),
        "pg_ms_per_s": round((b.pg_s - a.pg_s) / s * 1000, 1),
    }


def start_replicas(
    stack: Stack, count: int, procs: list[subprocess.Popen[bytes]], **env: str
) -> list[int]:
    """``count - 1`` more core replicas beside the stack's, on ports of their own, each
    added to ``procs`` as it starts (the caller stops them); every replica's port, the
    stack's first."""
    ports = [int(stack.core_url.rsplit(":", 1)[1])]
    for _ in range(count - 1):
        port = free_port()
        procs.append(start_core(stack.database_url, stack.root / f"home-{port}", port, **env))
        ports.append(port)
    return ports


async def launch(
    kind: type[Agent],
    ports: list[int],
    token: str,
    c: Counts,
    count: int,
    run_ms: float,
    cap: int,
    hosts: Hosts | None = None,
) -> tuple[list[Agent], list[asyncio.Task[None]]]:
    """``count`` simulated agents spread over the replicas (and over the simulated hosts,
    when there are), registered 50 at a time, with their claim and heartbeat loops
    running."""
    n = len(ports)
    fleet = [kind(Http(ports[i % n], token, hosts, i // n), c, run_ms, cap) for i in range(count)]
    for start in range(0, count, 50):
        await asyncio.gather(
            *(a.register(f"sim-{start + j}") for j, a in enumerate(fleet[start:][:50]))
        )
    loops = [asyncio.create_task(a.claim_loop()) for a in fleet]
    loops += [asyncio.create_task(a.beat_loop()) for a in fleet]
    return fleet, loops


def bulk_tokens(database_url: str, owners: int) -> list[str]:
    """One token for each of ``owners`` people, made in one transaction (the CLI's
    ``admin.create_token`` would open a connection each)."""

    async def make() -> list[str]:
        engine = create_async_engine(database_url)
        try:
            async with engine.begin() as conn:
                return [
                    (
                        await tokens_db.create(
                            conn,
                            principal=f"owner-{i}",
                            role="user",
                            name="bench",
                            created_by="bench",
                        )
                    )[0]
                    for i in range(owners)
                ]
        finally:
            await engine.dispose()

    return asyncio.run(make())


async def submitter(https: list[Http], rate: float, seconds: float, c: Counts) -> None:
    """Open loop: one single submission every 1/rate s, round robin over the replicas,
    on as many connections as are busy."""
    idle: list[list[Conn]] = [[] for _ in https]
    pending: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        conn = idle[i].pop() if idle[i] else await https[i].connect()
        status, body = await conn.request(https[i].request("/v1/tasks", SPEC), 30)
        if status == 201:
            c.submitted += 1
            c.submitted_ids.append(json.loads(body)["id"])
        else:
            noted(c, f"submit {status} {body[:80]!r}")
        idle[i].append(conn)

    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while (due := start + n / rate) < start + seconds:
        await asyncio.sleep(max(0.0, due - loop.time()))
        task = loop.create_task(one(n % len(https)))
        pending.add(task)
        task.add_done_callback(pending.discard)
        n += 1
    if pending:
        await asyncio.wait(pending, timeout=60)


async def run_one(args: argparse.Namespace, agents: int, replicas: int) -> dict[str, Any]:
    env = {
        "CAIRN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "CAIRN_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        **dict(item.split("=", 1) for item in args.core_env),
    }
    hosts = hosts_of(args, env)
    with contextlib.ExitStack() as made:
        if hosts is not None:
            made.enter_context(hosts)
        return await measure(args, agents, replicas, env, hosts)


async def measure(
    args: argparse.Namespace,
    agents: int,
    replicas: int,
    env: dict[str, str],
    hosts: Hosts | None,
) -> dict[str, Any]:
    with core_stack("cairn-bench-fleet-", **env) as stack:
        extra: list[subprocess.Popen[bytes]] = []
        try:
            ports = start_replicas(stack, replicas, extra, **env)
            cores = [stack.core_pid, *(p.pid for p in extra)]
            worker = await asyncio.to_thread(
                admin.create_token, stack.database_url, "fleet", "worker"
            )
            user = await asyncio.to_thread(admin.create_token, stack.database_url, "alice", "user")
            c = Counts()
            real: subprocess.Popen[bytes] | None = None
            real_ids: list[int] = []
            with psycopg.connect(libpq_url(stack.database_url), autocommit=True) as db:
                await asyncio.sleep(2)
                s0 = sample(db, cores, stack.postmaster_pid, c)
                await asyncio.sleep(args.phase_s)
                s1 = sample(db, cores, stack.postmaster_pid, c)
                fleet, loops = await launch(
                    Agent, ports, worker, c, agents, args.run_ms, args.cap, hosts
                )
                if args.real_rate:
                    real_token = await asyncio.to_thread(
                        admin.create_token, stack.database_url, "real", "worker"
                    )
                    real = start_real_agent(stack.core_url, real_token, stack.root / "real")
                # every claim is waiting (the agents start spread over a claim's wait)
                await asyncio.sleep(claim_wait(HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S) + 2)
                s2 = sample(db, cores, stack.postmaster_pid, c)
                r2 = tree_cpu_s(real.pid) if real else 0.0
                await asyncio.sleep(args.phase_s)
                s3 = sample(db, cores, stack.postmaster_pid, c)
                r3, t3 = tree_cpu_s(real.pid) if real else 0.0, time.monotonic()
                submit_https = [Http(p, user) for p in ports]
                jobs = [submitter(submit_https, args.rate, args.phase_s, c)]
                if real:
                    jobs.append(real_submitter(submit_https[0], args.real_rate, args.phase_s, c))
                _, *more = await asyncio.gather(*jobs)
                real_ids = more[0] if more else []
                s4 = sample(db, cores, stack.postmaster_pid, c)
                deadline = time.monotonic() + 60
                while c.reported < c.submitted and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                while real_ids and time.monotonic() < deadline:
                    left = db.execute(
                        "SELECT count(*) FROM core.tasks WHERE id = ANY(%s)"
                        " AND state <> 'succeeded'",
                        (real_ids,),
                    ).fetchone()
                    if left is None or left[0] == 0:
                        break
                    await asyncio.sleep(0.2)
                r5, t5 = tree_cpu_s(real.pid) if real else 0.0, time.monotonic()
                for a in fleet:
                    a.stopping = True
                for task in loops:
                    task.cancel()
                ids = c.submitted_ids
                lat = db.execute(
                    "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d),"
                    " percentile_cont(0.99) WITHIN GROUP (ORDER BY d), count(*) FROM ("
                    " SELECT extract(epoch FROM a.started_at - t.created_at) * 1000 AS d"
                    " FROM core.tasks t JOIN core.attempts a ON a.task_id = t.id AND a.number = 1"
                    " WHERE t.id = ANY(%s)) x",
                    (ids,),
                ).fetchone()
                states: dict[str, int] = dict(
                    db.execute(
                        "SELECT state, count(*) FROM core.tasks WHERE id = ANY(%s) GROUP BY 1",
                        (ids,),
                    ).fetchall()
                )
                real_states = dict(
                    db.execute(
                        "SELECT state, count(*) FROM core.tasks WHERE id = ANY(%s) GROUP BY 1",
                        (real_ids,),
                    ).fetchall()
                )
                twice = db.execute(
                    "SELECT count(*) FROM (SELECT task_id FROM core.attempts"
                    " WHERE task_id = ANY(%s) GROUP BY 1 HAVING count(*) > 1) x",
                    (ids,),
                ).fetchone()
        finally:
            if real is not None:
                real.send_signal(signal.SIGTERM)
                real.wait(30)
            for proc in extra:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
    none, idle, load = phase(s0, s1), phase(s2, s3), phase(s3, s4)
    idle_ms = (
        idle["core_ms_per_s"] + idle["pg_ms_per_s"] - none["core_ms_per_s"] - none["pg_ms_per_s"]
    ) / agents
    tasks = max(1, load["tasks"] + len(real_ids))
    per_task_ms = (
        (load["core_ms_per_s"] + load["pg_ms_per_s"] - idle["core_ms_per_s"] - idle["pg_ms_per_s"])
        * load["seconds"]
        / tasks
    )
    return {
        "agents": agents,
        "replicas": replicas,
        "hosts": {
            "count": hosts.count,
            "rtt_ms": hosts.rtt_ms,
            "delay_by": "client" if hosts.client_delay_s else "netem",
        }
        if hosts
        else None,
        "no_agents": none,
        "idle": idle,
        "load": load,
        "idle_ms_per_agent_s": round(idle_ms, 4),
        "cpu_ms_per_task": round(per_task_ms, 2),
        "commits_per_task": round(
            (load["commits_per_s"] - idle["commits_per_s"]) * load["seconds"] / tasks, 2
        ),
        # the load phase's (PostgreSQL flushes a backend's counts within a second)
        "hot_updates": hot_share(s3, s4),
        "created_to_leased_ms": {
            "p50": round(lat[0], 1) if lat and lat[0] is not None else None,
            "p99": round(lat[1], 1) if lat and lat[1] is not None else None,
            "n": lat[2] if lat else 0,
        },
        "submitted": c.submitted,
        "states": states,
        "run_twice": twice[0] if twice else None,
        "errors": c.errors,
        "why": c.why,
        "real_agent": {
            "tasks": len(real_ids),
            "idle_ms_per_s": round((r3 - r2) / idle["seconds"] * 1000, 2),
            # its CPU from the load's start until its last task ended, less its idle rate
            "cpu_ms_per_task": round(
                ((r5 - r3) - (r3 - r2) / idle["seconds"] * (t5 - t3))
                * 1000
                / max(1, len(real_ids)),
                2,
            ),
            "states": real_states,
        }
        if real_ids
        else None,
    }


def add_host_args(parser: argparse.ArgumentParser) -> None:
    """The options that put the simulated agents on simulated hosts (``netns.Hosts``)."""
    parser.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="simulated hosts: the agents spread over this many network namespaces (root)",
    )
    parser.add_argument("--rtt-ms", type=float, default=1.0, help="added round trip (--hosts)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="netem jitter (--hosts)")


def check_host_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.hosts and (why := netns_available()):
        parser.error(f"--hosts: {why}")


def hosts_of(args: argparse.Namespace, env: dict[str, str]) -> Hosts | None:
    """The simulated hosts the options ask for (to be entered), with core's replicas then
    listening on every address (``env``), or None."""
    if not args.hosts:
        return None
    env["CAIRN_BIND_HOST"] = "0.0.0.0"  # reached from the simulated hosts' veths
    return Hosts(args.hosts, args.rtt_ms, args.jitter_ms)


def hosted(r: dict[str, Any]) -> str:
    h = r["hosts"]
    return f" on {h['count']} hosts {h['rtt_ms']} ms away ({h['delay_by']})" if h else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="10,100,1000")
    parser.add_argument("--replicas", default="1")
    parser.add_argument("--phase-s", type=float, default=30.0, help="at least a claim's wait")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--run-ms", type=float, default=200.0)
    parser.add_argument("--cap", type=int, default=4, help="attempts an agent runs at once")
    parser.add_argument(
        "--core-env", action="append", default=[], help="KEY=VALUE for every core replica"
    )
    parser.add_argument(
        "--real-rate", type=float, default=0.0, help="tasks/s for one real agent among them"
    )
    add_host_args(parser)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_host_args(parser, args)
    exit_on_sigterm()
    results = []
    for replicas in (int(r) for r in args.replicas.split(",")):
        for agents in (int(n) for n in args.agents.split(",")):
            r = asyncio.run(run_one(args, agents, replicas))
            results.append(r)
            print(
                f"{agents:5d} agents{hosted(r)}, {replicas} core: idle {r['idle']['turns_per_s']} turns/s,"
                f" {r['idle']['commits_per_s']} commits/s, core {r['idle']['core_ms_per_s']}"
                f" + PG {r['idle']['pg_ms_per_s']} ms/s -> {r['idle_ms_per_agent_s']} ms per"
                f" agent-second (bar {IDLE_BAR_MS}); load {r['load']['tasks']} tasks:"
                f" {r['cpu_ms_per_task']} ms CPU and {r['commits_per_task']} commits a task,"
                f" HOT updates {r['hot_updates']},"
                f" created->leased p50 {r['created_to_leased_ms']['p50']} ms"
                f" p99 {r['created_to_leased_ms']['p99']} ms; states {r['states']},"
                f" real agent {r['real_agent']},"
                f" run twice {r['run_twice']}, errors {r['errors']} {r['why']}",
                flush=True,
            )
    for replicas in {r["replicas"] for r in results}:
        rows = {r["agents"]: r for r in results if r["replicas"] == replicas}
        if len(rows) > 1:
            lo, hi = rows[min(rows)], rows[max(rows)]
            ratio = hi["cpu_ms_per_task"] / lo["cpu_ms_per_task"]
            print(
                f"{replicas} core: CPU per task at {max(rows)} agents / at {min(rows)} ="
                f" {ratio:.2f} (bar {TASK_PER_AGENT_BAR})"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
