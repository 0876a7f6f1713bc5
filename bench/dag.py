"""DAG benchmark: a 10,000-node definition validated and ordered, and the latency from a
parent's success to its child's submission in core.

    .venv/bin/python bench/dag.py [--nodes 10000] [--chain 200] [--rounds 5] [--map 1000]

Part 1 parses a 10,000-node definition from its JSON (pydantic), checks it (names,
``depends_on``, templates) and orders it (networkx), in this process; the median and the
worst of ``--rounds`` are shown. Part 2 starts a fresh embedded PostgreSQL, core and the
DAG service as their own processes (uvicorn, uvloop), runs a chain of ``--chain`` nodes
with a worker in this process that claims and reports through core's HTTP API at once,
and takes, for every link, the child task's ``created_at`` minus the parent task's
``finished_at`` (both PostgreSQL's clock): the whole path of a success event through
core's feed, the DAG service's transaction, and the submission. Bars (DESIGN.md): under
2 s; p50 under 50 ms. Part 3 (same stack): a node hands on a list of ``--map`` items
through its outputs, the next maps over it, a fan-in follows (how long from the list's
end to its instances' submission, and from the last instance to the fan-in); and how late
runs past a 1 s ``timeout_s`` fail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libs.common.dag_models import WorkflowCreate  # noqa: E402
from libs.common.embedded import EmbeddedPostgres  # noqa: E402
from libs.common.settings import libpq_url  # noqa: E402
from services.core import admin  # noqa: E402
from services.core import migrate as core_migrate  # noqa: E402
from services.dag import migrate as dag_migrate  # noqa: E402
from services.dag.domain import graph  # noqa: E402

TRUE_SHA = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
ARTIFACT = {"uri": "file:///bin/true", "sha256": TRUE_SHA}


def layered(nodes: int, width: int = 100, seed: int = 7) -> str:
    """Layers of ``width`` nodes, each depending on 1 to 3 nodes of the layer above."""
    rng = random.Random(seed)
    body = []
    for i in range(nodes):
        layer = i // width
        above = range((layer - 1) * width, layer * width) if layer else range(0)
        deps = [f"n{j}" for j in rng.sample(above, min(len(above), rng.randint(1, 3)))]
        body.append(
            {
                "name": f"n{i}",
                "task": {"artifact": ARTIFACT, "args": ["{{ run.id }}"]},
                "depends_on": deps,
            }
        )
    return WorkflowCreate.model_validate({"name": "big", "nodes": body}).model_dump_json()


def bench_definition(nodes: int, rounds: int) -> None:
    text = layered(nodes)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        dag = graph.build(WorkflowCreate.model_validate_json(text))
        times.append(time.perf_counter() - start)
    assert len(dag.order) == nodes
    edges = sum(len(v) for v in dag.upstream.values())
    print(f"definition: {nodes} nodes, {edges} edges, {len(text) / 1e6:.1f} MB of JSON")
    print(
        f"  validated and ordered: median {statistics.median(times):.3f} s, worst {max(times):.3f} s (bar < 2 s)"
    )


def _spawn(module: str, env: dict[str, str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env}, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{module} did not start")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(core_url: str, token: str, stop: threading.Event) -> None:
    http = httpx.Client(base_url=core_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    offer = {"hostname": "bench", "queues": ["default"], "cpu": 64, "memory_mb": 2**20}
    registered = http.post("/v1/workers", json=offer).raise_for_status().json()
    wid = registered["worker"]["id"]
    http.headers["X-Cairn-Worker-Lease"] = registered["lease"]
    room = {"cpu": 64, "memory_mb": 2**20, "max": 64, "wait": 1}
    while not stop.is_set():
        for a in http.post(f"/v1/workers/{wid}/claim", json=room).json().get("attempts", []):
            if a["args"][:1] == ["hold"]:
                continue
            report: dict = {"outcome": "succeeded", "exit_code": 0}
            if a["args"][:1] == ["out"]:
                report["outputs"] = json.loads(a["args"][1])
            http.post(f"/v1/workers/{wid}/attempts/{a['attempt_id']}/report", json=report)


def _wait_run(http: httpx.Client, run_id: int) -> dict:
    while True:
        run = http.get(f"/v1/runs/{run_id}").json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            return run
        time.sleep(0.05)


def bench_map(http: httpx.Client, url: str, items: int) -> None:
    """A node hands on a list of ``items`` through its outputs; the next maps over it;
    a fan-in reads every instance's output."""
    listed = json.dumps({"files": [f"f{i}" for i in range(items)]})
    nodes = [
        {
            "name": "list",
            "task": {"artifact": ARTIFACT, "args": ["out", listed]},
            "outputs": {"files": {}},
        },
        {
            "name": "each",
            "depends_on": ["list"],
            "outputs": {"n": {}},
            "task": {"artifact": ARTIFACT, "args": ["out", '{"n": {{ map.index }}}']},
            "map": {"over": "{{ nodes.list.outputs.files }}", "max_items": items},
        },
        {"name": "sum", "depends_on": ["each"], "task": {"artifact": ARTIFACT}},
    ]
    http.post("/v1/workflows", json={"name": "map", "nodes": nodes}).raise_for_status()
    started = time.monotonic()
    run = http.post("/v1/workflows/map/runs", json={}).raise_for_status().json()
    ended = _wait_run(http, run["id"])
    took = time.monotonic() - started
    with psycopg.connect(libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT labels->>'cairn.dag/node', created_at, finished_at FROM core.tasks"
            " WHERE labels->>'cairn.dag/run' = %s",
            (str(run["id"]),),
        ).fetchall()
    by = {name: (created, finished) for name, created, finished in rows}
    each = [v for k, v in by.items() if k.startswith("each[")]
    expand = (max(c for c, _ in each) - by["list"][1]).total_seconds() * 1000
    first = (min(c for c, _ in each) - by["list"][1]).total_seconds() * 1000
    fan_in = (by["sum"][0] - max(f for _, f in each)).total_seconds() * 1000
    print(f"map: {items} instances over an upstream output, run {ended['state']} in {took:.2f} s")
    print(
        f"  list finished -> first instance submitted {first:.1f} ms, last {expand:.1f} ms;"
        f" last instance finished -> fan-in submitted {fan_in:.1f} ms"
    )


def bench_timeout(http: httpx.Client, url: str, rounds: int = 5) -> None:
    """How late a run past its ``timeout_s`` fails (finished_at minus its deadline)."""
    nodes = [{"name": "stuck", "task": {"artifact": ARTIFACT, "args": ["hold"]}}]
    http.post("/v1/workflows", json={"name": "stuck", "nodes": nodes}).raise_for_status()
    lags = []
    for _ in range(rounds):
        run = http.post("/v1/workflows/stuck/runs", json={"timeout_s": 1}).raise_for_status()
        ended = _wait_run(http, run.json()["id"])
        with psycopg.connect(libpq_url(url)) as conn:
            lag = conn.execute(
                "SELECT EXTRACT(EPOCH FROM finished_at - deadline) FROM dag.runs WHERE id = %s",
                (ended["id"],),
            ).fetchone()[0]
        lags.append(float(lag) * 1000)
    lags.sort()
    print(
        f"timeout: {rounds} runs with timeout_s 1 failed {lags[len(lags) // 2]:.1f} ms"
        f" after their deadline (median), {lags[-1]:.1f} ms at most"
    )


def bench_release(chain: int, mapped: int = 1000) -> None:
    root = Path(tempfile.mkdtemp(prefix="cairn-bench-dag-"))
    server = EmbeddedPostgres(root / "pg")
    url = server.start()
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    try:
        core_migrate.upgrade(url)
        dag_migrate.upgrade(url)
        core_port, dag_port = _free_port(), _free_port()
        core_url, dag_url = f"http://127.0.0.1:{core_port}", f"http://127.0.0.1:{dag_port}"
        common = {
            "CAIRN_DATABASE_URL": url,
            "CAIRN_HOME": str(root),
            "CAIRN_MIGRATE_ON_START": "false",
            "CAIRN_LOG_LEVEL": "warning",
        }
        procs.append(
            _spawn("services.core", {**common, "CAIRN_CORE_PORT": str(core_port)}, core_url)
        )
        dag_env = {
            **common,
            "CAIRN_DAG_PORT": str(dag_port),
            "CAIRN_URL": core_url,
            "CAIRN_TOKEN": admin.create_token(url, "dag", "service"),
        }
        procs.append(_spawn("services.dag", dag_env, dag_url))
        threading.Thread(
            target=_worker,
            args=(core_url, admin.create_token(url, "w", "worker"), stop),
            daemon=True,
        ).start()
        user = {"Authorization": f"Bearer {admin.create_token(url, 'alice', 'user')}"}
        nodes = [{"name": "n0", "task": {"artifact": ARTIFACT}}]
        nodes += [
            {"name": f"n{i}", "task": {"artifact": ARTIFACT}, "depends_on": [f"n{i - 1}"]}
            for i in range(1, chain)
        ]
        with httpx.Client(base_url=dag_url, headers=user, timeout=30) as http:
            http.post("/v1/workflows", json={"name": "chain", "nodes": nodes}).raise_for_status()
            run = http.post("/v1/workflows/chain/runs", json={}).raise_for_status().json()
            started = time.monotonic()
            while http.get(f"/v1/runs/{run['id']}").json()["state"] not in ("succeeded", "failed"):
                time.sleep(0.1)
            took = time.monotonic() - started
        with psycopg.connect(libpq_url(url)) as conn:
            rows = conn.execute(
                "SELECT (labels->>'cairn.dag/node'), created_at, finished_at FROM core.tasks"
            ).fetchall()
        by = {name: (created, finished) for name, created, finished in rows}
        lags = sorted(
            (by[f"n{i}"][0] - by[f"n{i - 1}"][1]).total_seconds() * 1000 for i in range(1, chain)
        )
        p = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]  # noqa: E731
        print(f"release: a chain of {chain} nodes ran in {took:.2f} s")
        print(
            f"  parent finished -> child submitted: p50 {p(0.5):.1f} ms, p90 {p(0.9):.1f} ms, p99 {p(0.99):.1f} ms, max {lags[-1]:.1f} ms (bar p50 < 50 ms)"
        )
        with httpx.Client(base_url=dag_url, headers=user, timeout=30) as http:
            bench_map(http, url, mapped)
            bench_timeout(http, url)
    finally:
        stop.set()
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(20)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--map", type=int, default=1000, help="instances of the mapped node")
    args = parser.parse_args()
    bench_definition(args.nodes, args.rounds)
    bench_release(args.chain, args.map)


if __name__ == "__main__":
    main()
