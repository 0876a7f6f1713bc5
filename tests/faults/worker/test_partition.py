"""A real network partition: a worker agent in a network namespace of its own, joined to
the host by a veth pair, is cut off (its link down) while it runs attempts, long enough
for core to declare it dead and re-place them on another agent, then joined again. Its
late reports are refused (409, fenced), each task is re-placed once, nothing completes
twice, and the cut agent registers again."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn

from services.core.app import create_app
from services.core.settings import CoreSettings
from tests.support import free_port, isolation_env, make_token, shared_dir, stop_process, wait_for

pytestmark = pytest.mark.slow

SH = Path("/bin/sh")
SH_SHA = hashlib.sha256(SH.read_bytes()).hexdigest()
INTERVAL_S, TIMEOUT_S = 0.5, 5.0
TASKS = 3
DB = psycopg.Connection[tuple[Any, ...]]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _free_net() -> ipaddress.IPv4Network:
    """A /30 in 10.249.0.0/16 that no interface of the host uses."""
    shown = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    used = [ipaddress.ip_interface(w) for w in shown.split() if "/" in w and w[0].isdigit()]
    nets = list(ipaddress.ip_network("10.249.0.0/16").subnets(new_prefix=30))
    start = os.getpid() % len(nets)
    for net in nets[start:] + nets[:start]:
        if not any(u.network.overlaps(net) for u in used):
            return net
    raise RuntimeError("no free /30 in 10.249.0.0/16")


@dataclass
class Link:
    namespace: str
    host_side: str
    host_addr: str

    def cut(self) -> None:
        _ip("link", "set", self.host_side, "down")

    def join(self) -> None:
        _ip("link", "set", self.host_side, "up")


@pytest.fixture
def link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"cf{os.getpid() % 100000}"
    namespace, host_side, inside = f"cairn-{tag}", f"{tag}h", f"{tag}n"
    try:
        _ip("netns", "add", namespace)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"`ip netns add` is not available here: {exc}")
    try:
        net = _free_net()
        host_addr, inner_addr = (str(a) for a in net.hosts())
        _ip("link", "add", host_side, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_side)
        _ip("link", "set", host_side, "up")
        for args in (
            ["addr", "add", f"{inner_addr}/30", "dev", inside],
            ["link", "set", inside, "up"],
            ["link", "set", "lo", "up"],
        ):
            _ip("netns", "exec", namespace, "ip", *args)
        yield Link(namespace, host_side, host_addr)
    finally:
        # By the names made here only; deleting the namespace removes its end of the pair.
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", host_side], capture_output=True, timeout=20)


@dataclass
class Core:
    url: str
    db_url: str


@pytest.fixture
def core(link: Link, db_url: str, tmp_path: Path) -> Iterator[Core]:
    """Core on the host's end of the pair only: reachable from the namespace and the host."""
    port = free_port()
    settings = CoreSettings(
        home=tmp_path / "core",
        database_url=db_url,
        core_port=port,
        heartbeat_interval_s=INTERVAL_S,
        heartbeat_timeout_s=TIMEOUT_S,
        promote_interval_s=0.05,
        token_cache_s=0,
    )
    app = create_app(settings, db_url)
    config = uvicorn.Config(app, host=link.host_addr, port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name="core-partition")
    thread.start()
    wait_for(lambda: server.started, timeout=20)
    yield Core(f"http://{link.host_addr}:{port}", db_url)
    server.should_exit = True
    thread.join(timeout=15)


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        stop_process(proc, signal.SIGKILL)


def _agent(
    core: Core, home: Path, name: str, started: list, prefix: list[str], log: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": make_token(core.db_url, name, "worker"),
        "CAIRN_HOME": str(home),
        "CAIRN_WORKER_CPU": "4",
        "CAIRN_WORKER_MEMORY_MB": "4096",
        "CAIRN_LOG_LEVEL": "warning",
        "CAIRN_LOG_FORMAT": "json",
        **isolation_env(),
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "services.worker"], env=env, stderr=out
        )
    started.append(proc)
    return proc


def _workers(db: DB, principal: str) -> list[tuple[int, str]]:
    query = "SELECT id, state FROM core.workers WHERE principal = %s ORDER BY id"
    return [(int(i), str(s)) for i, s in db.execute(query, (principal,)).fetchall()]


def _attempts(db: DB) -> dict[int, list[tuple[int, str, int | None]]]:
    rows = db.execute(
        "SELECT task_id, id, outcome, worker_id FROM core.attempts ORDER BY task_id, id"
    ).fetchall()
    by_task: dict[int, list[tuple[int, str, int | None]]] = defaultdict(list)
    for task, attempt, outcome, worker in rows:
        by_task[task].append((attempt, outcome, worker))
    return by_task


def _task(record: Path, i: int) -> dict[str, Any]:
    # The first attempt (on the agent to be cut) outlives the partition; a retry is short.
    script = (
        f'echo "start $CAIRN_TASK_ID $CAIRN_ATTEMPT_ID" >> {record};'
        ' if [ "$CAIRN_ATTEMPT_NUMBER" = 1 ]; then sleep 120; else sleep 1; fi;'
        f' echo "end $CAIRN_TASK_ID $CAIRN_ATTEMPT_ID" >> {record}'
    )
    return {
        "name": f"partitioned-{i}",
        "artifact": {"uri": f"file://{SH}", "sha256": SH_SHA},
        "args": ["-c", script],
        "resources": {"cpu": 1, "memory_mb": 128},
        "retry": {"max_attempts": 5, "base_s": 0.1, "cap_s": 1, "jitter": False},
    }


@pytest.mark.timeout(300)
def test_a_cut_off_worker_is_fenced_its_attempts_placed_once_elsewhere_and_it_rejoins(
    link: Link, core: Core, db: DB, agents: list, tmp_path: Path
) -> None:
    record = shared_dir() / "executions.log"
    record.touch()
    record.chmod(0o666)
    cut_log = tmp_path / "cut-agent.log"
    inside = ["ip", "netns", "exec", link.namespace]
    _agent(core, tmp_path / "cut", "cut", agents, inside, cut_log)
    wait_for(lambda: [s for _, s in _workers(db, "cut")] == ["live"], timeout=60)
    [(cut_id, _)] = _workers(db, "cut")
    token = make_token(core.db_url, "alice", "user")
    with httpx.Client(base_url=core.url, headers={"Authorization": f"Bearer {token}"}) as alice:
        ids = [alice.post("/v1/tasks", json=_task(record, i)).json()["id"] for i in range(TASKS)]
    # Every task's first attempt runs on the agent in the namespace.
    wait_for(lambda: record.read_text().count("start") == TASKS, timeout=60)
    first = {task: rows[0][0] for task, rows in _attempts(db).items()}
    assert sorted(first) == sorted(ids)
    _agent(core, tmp_path / "far", "far", agents, [], tmp_path / "far-agent.log")
    wait_for(lambda: [s for _, s in _workers(db, "far")] == ["live"], timeout=60)
    [(far_id, _)] = _workers(db, "far")

    link.cut()
    try:
        # Core declares the cut worker dead and re-places its attempts on the other agent.
        wait_for(lambda: _workers(db, "cut")[0][1] == "dead", timeout=60)
        wait_for(lambda: record.read_text().count("start") == 2 * TASKS, timeout=60)
    finally:
        link.join()

    states = "SELECT count(*) FROM core.tasks WHERE state = 'succeeded'"
    wait_for(lambda: db.execute(states).fetchone() == (TASKS,), timeout=60)
    # The cut agent recovers: told it is dead, it registers again as a new worker.
    wait_for(lambda: [s for _, s in _workers(db, "cut")] == ["dead", "live"], timeout=60)

    # Its late reports, of the attempts core re-placed, were refused as stale (409).
    def refused() -> set[int]:
        found = set()
        for line in cut_log.read_text(errors="replace").splitlines():
            for attempt in first.values():
                if f"report of attempt {attempt} refused" in line and "current attempt" in line:
                    found.add(attempt)
        return found

    wait_for(lambda: refused() == set(first.values()), timeout=60)
    by_task = _attempts(db)
    for task in ids:
        # Re-placed once: lost on the cut worker, then succeeded on the other, nothing else.
        assert by_task[task] == [
            (first[task], "lost", cut_id),
            (by_task[task][1][0], "succeeded", far_id),
        ], by_task[task]
    ends = [line.split()[1] for line in record.read_text().splitlines() if line[:3] == "end"]
    assert sorted(ends) == sorted(str(t) for t in ids)  # each task ran to its end once
