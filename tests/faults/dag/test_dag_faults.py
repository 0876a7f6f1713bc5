"""The DAG service killed with SIGKILL mid-run (a run with branches), and core answering
5xx for a while: every run still ends, and no node is released or run twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.fixtures.dag import DagServer, Runner, Worker, node, start_dag, workflow
from tests.support import Core, free_port, make_token, serve_in_thread, stop_process, wait_for

pytestmark = pytest.mark.slow


def _layered(name: str, width: int) -> dict:
    """root, then ``width`` pairs (mid -> tail), then a sink waiting for every tail."""
    nodes = [node("root")]
    for i in range(width):
        nodes += [node(f"mid{i}", "root"), node(f"tail{i}", f"mid{i}")]
    nodes.append(node("sink", *(f"tail{i}" for i in range(width))))
    return workflow(name, nodes)


def _branching(name: str, width: int, skipped: list[int]) -> dict:
    """``_layered`` whose middle nodes branch: mid I runs only when root said go and I is
    not in ``params.skipped``; the sink joins whatever ran."""
    body = _layered(name, width)
    body["nodes"][0]["task"]["args"] = ["out", json.dumps({"go": True})]
    body["nodes"][0]["outputs"] = {"go": {}}
    for spec in body["nodes"]:
        if spec["name"].startswith("mid"):
            index = spec["name"].removeprefix("mid")
            spec["when"] = f"nodes.root.outputs.go and {index} not in params.skipped"
    body["nodes"][-1]["trigger_rule"] = "none_failed_min_one_success"
    body["params"] = {"skipped": skipped}
    return body


def _tasks_per_node(db: psycopg.Connection, run_id: int) -> Counter[str]:
    rows = db.execute(
        "SELECT labels->>'cairn.dag/node' FROM core.tasks WHERE labels->>'cairn.dag/run' = %s",
        (str(run_id),),
    ).fetchall()
    return Counter(name for (name,) in rows)


def _spawn_dag(core: Core, home: Path, port: int, token: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CAIRN_DATABASE_URL": core.db_url,
        "CAIRN_URL": core.url,
        "CAIRN_TOKEN": token,
        "CAIRN_HOME": str(home),
        "CAIRN_DAG_PORT": str(port),
        "CAIRN_FEED_WAIT_S": "1",
        "CAIRN_RETRY_BASE_S": "0.05",
        "CAIRN_MIGRATE_ON_START": "false",
        "CAIRN_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.dag"], env=env)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the DAG service exited with {proc.returncode}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=60, interval=0.1)
    return proc


def test_kill_9_mid_run_then_restart_finishes_and_runs_no_node_twice_nor_a_skipped_branch(
    core: Core, db: psycopg.Connection, tmp_path: Path
) -> None:
    port = free_port()
    token = make_token(core.db_url, "dag-service", "service")
    proc = _spawn_dag(core, tmp_path, port, token)
    worker = Worker(core, delay_s=0.01)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {make_token(core.db_url, 'alice', 'user')}"},
        timeout=10,
    )
    try:
        runner = Runner(http)
        runner.define(_branching("crash", 25, skipped=[3, 7, 11]))
        run_id = runner.start("crash")["id"]
        for threshold in (8, 30):

            def progressed(at_least: int = threshold) -> bool:
                (done,) = db.execute(
                    "SELECT count(*) FROM dag.nodes WHERE run_id = %s AND state = 'succeeded'",
                    (run_id,),
                ).fetchone()
                return done >= at_least

            wait_for(progressed, timeout=60)
            stop_process(proc, signal.SIGKILL)
            proc = _spawn_dag(core, tmp_path, port, token)
        run = runner.wait_end(run_id, timeout=90)
    finally:
        http.close()
        worker.stop()
        stop_process(proc)
    assert run["state"] == "succeeded"
    skipped = {f"{part}{i}" for i in (3, 7, 11) for part in ("mid", "tail")}
    stored = dict(
        db.execute("SELECT name, state FROM dag.nodes WHERE run_id = %s", (run_id,)).fetchall()
    )
    assert {n for n, s in stored.items() if s == "skipped"} == skipped
    assert {s for n, s in stored.items() if n not in skipped} == {"succeeded"}
    per_node = _tasks_per_node(db, run_id)
    assert len(per_node) == 46 and set(per_node.values()) == {1}  # 52 nodes, 6 skipped
    assert not skipped & set(per_node)
    assert len(worker.claims) == 46 and set(worker.claims.values()) == {1}


class FlakyCore:
    """A proxy in front of the real core. While ``faults`` lasts, a submission is either
    refused with 503 before core sees it, or passed to core and its answer replaced by a
    502 (the task exists, the caller does not know); feed reads get 503."""

    def __init__(self, core_url: str, faults: int) -> None:
        self.core_url = core_url
        self.faults = faults
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])

    def _fault(self) -> int | None:
        with self.lock:
            if self.faults <= 0:
                return None
            self.faults -= 1
            return 502 if self.faults % 2 else 503

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        submitting = request.method == "POST" and path.startswith("/v1/tasks")
        fault = self._fault() if submitting or path == "/v1/events" else None
        if fault == 503:
            self.seen["refused"] += 1
            return Response(status_code=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with httpx.AsyncClient(base_url=self.core_url, timeout=40) as client:
            answer = await client.request(
                request.method, path, params=request.query_params, content=await request.body(),
                headers=headers,
            )  # fmt: skip
        if fault == 502:
            self.seen["answer lost"] += 1
            await asyncio.sleep(0)
            return Response(status_code=502)
        return Response(
            answer.content, answer.status_code, media_type=answer.headers.get("content-type")
        )


@pytest.fixture
def flaky(core: Core) -> Iterator[tuple[FlakyCore, str]]:
    proxy = FlakyCore(core.url, faults=0)
    port = free_port()
    server, thread = serve_in_thread(proxy.app, port, "flaky-core")
    yield proxy, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)


def test_core_answering_5xx_for_a_while_delays_releases_but_never_doubles_them(
    core: Core, flaky: tuple[FlakyCore, str], db: psycopg.Connection, tmp_path: Path
) -> None:
    proxy, proxy_url = flaky
    dag: DagServer = start_dag(core, tmp_path / "dag", core_url=proxy_url)
    worker = Worker(core)
    try:
        with dag.client() as http:
            runner = Runner(http)
            runner.define(_layered("flaky", 10))
            proxy.faults = 12
            run = runner.wait_end(runner.start("flaky")["id"], timeout=90)
    finally:
        worker.stop()
        dag.stop()
    assert proxy.faults == 0
    assert proxy.seen["answer lost"] >= 3 and proxy.seen["refused"] >= 3
    assert run["state"] == "succeeded"
    per_node = _tasks_per_node(db, run["id"])
    assert len(per_node) == 22 and set(per_node.values()) == {1}
    assert set(worker.claims.values()) == {1}


def test_kill_9_while_sub_workflows_run_starts_no_child_twice(
    core: Core, db: psycopg.Connection, tmp_path: Path
) -> None:
    """Parent nodes each run a child workflow; the DAG process is killed with SIGKILL
    once some children exist, and started again: each parent node has one child run,
    and every child node ran one task."""
    port = free_port()
    token = make_token(core.db_url, "dag-service", "service")
    proc = _spawn_dag(core, tmp_path, port, token)
    worker = Worker(core, delay_s=0.02)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {make_token(core.db_url, 'alice', 'user')}"},
        timeout=10,
    )
    subs = [f"s{i}" for i in range(3)]
    try:
        runner = Runner(http)
        runner.define(workflow("child", [node("a"), node("b", "a")]))
        nodes = [{"name": s, "workflow": {"name": "child"}} for s in subs]
        runner.define(workflow("parent", [*nodes, node("sink", *subs)]))
        run_id = runner.start("parent")["id"]

        def children() -> int:
            (count,) = db.execute(
                "SELECT count(*) FROM dag.runs WHERE parent_run_id = %s", (run_id,)
            ).fetchone()
            return int(count)

        wait_for(lambda: children() >= 1, timeout=30, interval=0.02)
        stop_process(proc, signal.SIGKILL)
        proc = _spawn_dag(core, tmp_path, port, token)
        run = runner.wait_end(run_id, timeout=60)
    finally:
        http.close()
        worker.stop()
        stop_process(proc)
    assert run["state"] == "succeeded"
    rows = db.execute(
        "SELECT parent_node, count(*), min(state), max(state) FROM dag.runs"
        " WHERE parent_run_id = %s GROUP BY parent_node",
        (run_id,),
    ).fetchall()
    assert sorted(rows) == [(s, 1, "succeeded", "succeeded") for s in subs]
    child_tasks = db.execute(
        "SELECT count(*), count(DISTINCT t.id) FROM dag.runs r JOIN dag.nodes n ON n.run_id = r.id"
        " JOIN core.tasks t ON t.id = n.task_id WHERE r.parent_run_id = %s",
        (run_id,),
    ).fetchone()
    assert child_tasks == (6, 6)
    assert len(worker.claims) == 7 and set(worker.claims.values()) == {1}  # and the sink
