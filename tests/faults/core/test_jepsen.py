"""A Jepsen-style run of the whole dispatch path under faults, with real processes: two
core replicas behind a failover proxy, several worker agents, and tasks that record each
execution in a log. While they run, the test SIGKILLs agents, SIGKILLs and restarts a core
replica, and restarts PostgreSQL. Afterwards the total-queue checker: every accepted task
succeeded exactly once in core (0 lost, 0 completed twice), and every execution that is
not the one that succeeded belongs to an attempt core counted as lost, crashed or handed
back (every re-execution explained)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psycopg
import pytest

from libs.common.embedded import EmbeddedPostgres
from libs.common.settings import libpq_url
from services.core import migrate
from services.cron import migrate as cron_migrate
from services.dag import migrate as dag_migrate
from tests.support import (
    free_port,
    make_token,
    shared_dir,
    spawn_core,
    spawn_worker,
    stop_process,
    wait_for,
)
from tests.support.loopserver import LoopServer

pytestmark = pytest.mark.slow

TASKS = 200
AGENTS = 3
SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()
CORE_ENV = {
    "CAIRN_HEARTBEAT_INTERVAL_S": "0.5",
    "CAIRN_HEARTBEAT_TIMEOUT_S": "10",
    "CAIRN_PROMOTE_INTERVAL_S": "0.1",
}
EXPLAINED = {"lost", "crashed", "handed_back"}


class Proxy(LoopServer):
    """A TCP proxy on 127.0.0.1 that sends each new connection to the first backend that
    accepts it: the load balancer in front of the core replicas."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        super().__init__("proxy")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for port in self.backends:
                try:
                    up_reader, up_writer = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", port), 1.0
                    )
                except (OSError, TimeoutError):
                    continue
                self.track(up_writer)
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
                return
        finally:
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


@dataclass
class Cluster:
    pg: EmbeddedPostgres
    url: str
    home: Path
    core_ports: list[int]
    cores: list[subprocess.Popen[bytes]]
    proxy: Proxy
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    agent_no: int = 0

    @property
    def core_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def start_agent(self) -> None:
        self.agent_no += 1
        name = f"agent-{self.agent_no}"
        target = SimpleNamespace(url=self.core_url, db_url=self.url)
        self.agents.append(
            spawn_worker(target, self.home / name, name, cpu=4, memory_mb=4096)  # type: ignore[arg-type]
        )

    def start_core(self, i: int) -> subprocess.Popen[bytes]:
        return spawn_core(self.url, self.home / f"core-{i}", self.core_ports[i], **CORE_ENV)


def _dump(db_url: str) -> None:
    """What the cluster holds, printed when a run ends (the figures, or why it stalled)."""
    queries = [
        "SELECT state, count(*) FROM core.tasks GROUP BY state",
        "SELECT id, state, registered_at::time, last_heartbeat_at::time, gone_at::time"
        " FROM core.workers ORDER BY id",
        "SELECT worker_id, outcome, left(error, 80), count(*), max(started_at)::time"
        " FROM core.attempts GROUP BY 1, 2, 3 ORDER BY 1, 2",
    ]
    with contextlib.suppress(psycopg.Error), psycopg.connect(libpq_url(db_url)) as conn:
        for query in queries:
            print("jepsen:", conn.execute(query).fetchall())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="cairn-jepsen-"))
    pg = EmbeddedPostgres(root / "pg", fast=True)  # restarted cleanly: nothing to lose
    pg.start()
    for upgrade in (migrate.upgrade, cron_migrate.upgrade, dag_migrate.upgrade):
        upgrade(pg.url)
    ports = [free_port(), free_port()]
    proxy = Proxy(ports)
    made = Cluster(pg, pg.url, tmp_path, ports, [], proxy)
    try:
        made.cores = [made.start_core(0), made.start_core(1)]
        for _ in range(AGENTS):
            made.start_agent()
        yield made
    finally:
        _dump(pg.url)
        for proc in made.agents + made.cores:
            stop_process(proc, signal.SIGKILL)
        proxy.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _task(i: int, record: Path) -> dict[str, Any]:
    script = (
        f'echo "start $CAIRN_TASK_ID $CAIRN_ATTEMPT_ID" >> {record}; sleep 0.2;'
        f' echo "end $CAIRN_TASK_ID $CAIRN_ATTEMPT_ID" >> {record}'
    )
    return {
        "name": "jepsen",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", script],
        "resources": {"cpu": 0.25, "memory_mb": 64},
        "retry": {"max_attempts": 50, "base_s": 0.1, "cap_s": 2, "poison_after": 50},
        "idempotency_key": f"jepsen-{i}",
    }


def _submit_all(url: str, token: str, record: Path, accepted: dict[int, int]) -> None:
    """Every task in batches, each batch again until core takes it (the keys make that
    safe): what core acknowledged is recorded."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        for start in range(0, TASKS, 50):
            batch = [_task(i, record) for i in range(start, min(start + 50, TASKS))]
            while True:
                try:
                    answer = http.post("/v1/tasks/batch", json={"tasks": batch})
                except httpx.TransportError:
                    continue
                if answer.status_code in (200, 201):
                    for i, item in zip(range(start, TASKS), answer.json()["tasks"], strict=False):
                        accepted[i] = item["id"]
                    break


def _succeeded(db_url: str) -> int:
    try:
        with psycopg.connect(libpq_url(db_url), connect_timeout=2) as conn:
            row = conn.execute("SELECT count(*) FROM core.tasks WHERE state = 'succeeded'")
            return int(row.fetchone()[0])  # type: ignore[index]
    except psycopg.OperationalError:
        return -1


def _progress(cluster: Cluster, by: int, timeout: float = 90) -> None:
    base = max(0, _succeeded(cluster.url))
    wait_for(lambda: _succeeded(cluster.url) >= min(TASKS, base + by), timeout, interval=0.2)


def _inject(cluster: Cluster) -> None:
    """The faults, each once the cluster has made some progress since the last."""
    _progress(cluster, 40, timeout=300)
    cluster.agents[0].send_signal(signal.SIGKILL)
    cluster.faults["agent SIGKILL"] += 1
    cluster.start_agent()
    _progress(cluster, 40)
    cluster.cores[0].send_signal(signal.SIGKILL)
    cluster.cores[0].wait()
    cluster.faults["core replica SIGKILL"] += 1
    _progress(cluster, 40)
    cluster.cores[0] = cluster.start_core(0)
    _progress(cluster, 40)
    cluster.pg.stop()
    cluster.faults["PostgreSQL restart"] += 1
    cluster.pg.start()
    _progress(cluster, 40)
    cluster.agents[1].send_signal(signal.SIGKILL)
    cluster.faults["agent SIGKILL"] += 1
    cluster.start_agent()


@dataclass
class Verdict:
    tasks: int
    lost: list[int]
    succeeded_twice: list[int]
    unexplained: list[tuple[int, int, str]]
    executions: int
    re_executions: int
    completed_again: int


def check(db_url: str, accepted: dict[int, int], record: Path) -> Verdict:
    """The total-queue checker over what core holds and what the executions wrote."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        states = dict(conn.execute("SELECT id, state FROM core.tasks").fetchall())
        outcomes = {
            a: (t, o) for a, t, o in conn.execute("SELECT id, task_id, outcome FROM core.attempts")
        }
    wins: Counter[int] = Counter(t for t, o in outcomes.values() if o == "succeeded")
    started: dict[int, set[int]] = defaultdict(set)
    ended: dict[int, set[int]] = defaultdict(set)
    for line in record.read_text().splitlines():
        what, task, attempt = line.split()
        (started if what == "start" else ended)[int(task)].add(int(attempt))
    ids = set(accepted.values())
    unexplained = [
        (task, attempt, str(outcomes.get(attempt, (task, "unknown"))[1]))
        for task, attempts in started.items()
        for attempt in attempts
        if outcomes.get(attempt, (task, None))[1] not in EXPLAINED | {"succeeded"}
    ]
    return Verdict(
        tasks=len(ids),
        lost=sorted(t for t in ids if states.get(t) != "succeeded"),
        succeeded_twice=sorted(t for t, n in wins.items() if n > 1),
        unexplained=unexplained,
        executions=sum(len(a) for a in started.values()),
        re_executions=sum(len(a) - 1 for a in started.values()),
        completed_again=sum(max(0, len(a) - 1) for a in ended.values()),
    )


@pytest.mark.timeout(1200)
def test_no_task_is_lost_or_completed_twice_through_kills_and_a_database_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Where every attempt's uid may append (the tests' tmp folders are 0700).
    record = shared_dir() / "executions.log"
    record.touch()
    record.chmod(0o666)
    token = make_token(cluster.url, "jepsen", "user")
    accepted: dict[int, int] = {}
    submitter = threading.Thread(
        target=_submit_all, args=(cluster.core_url, token, record, accepted), daemon=True
    )
    submitter.start()
    _inject(cluster)
    submitter.join(timeout=120)
    assert len(accepted) == TASKS
    wait_for(lambda: _succeeded(cluster.url) == TASKS, timeout=480, interval=0.5)
    verdict = check(cluster.url, accepted, record)
    print(f"jepsen: {dict(cluster.faults)} -> {verdict}")  # the figures for the docs
    assert verdict.tasks == TASKS
    assert verdict.lost == []
    assert verdict.succeeded_twice == []
    assert verdict.unexplained == []
    assert sum(cluster.faults.values()) == 4
