"""A workflow hop through the whole system (issue 35, "The hop"): `cairn up` (embedded
PostgreSQL, core, cron, dag and one real agent under isolation), then a chain of
``--chain`` nodes each running ``/bin/true`` (or ``--program bash``: ``bash -c true``),
and a fan-out of ``--fanout`` such nodes behind one root.

    .venv/bin/python bench/chain.py [--chain 400] [--fanout 200] [--program true|bash]

Printed: the chain's time, run created -> run succeeded by the run's own timestamps (bar:
10 s for 400, 25 ms a hop; Windmill's published single-worker figure is 19.7 s), and where
a hop's time goes, from each task's and attempt's own timestamps (PostgreSQL's clock):
- **release**: the previous node's attempt ended -> the next node's task created (core's
  event feed, the DAG service's transaction, its submission);
- **claim**: task created -> attempt started (the wake-up and the lease);
- **run**: attempt started -> attempt ended (spawn under isolation, the program, the
  report).
And the CPU a hop of each process (core, dag, the agent with its helpers and attempts,
PostgreSQL) and of the whole machine (busy time: other load counts in it), from ``/proc``.
The fan-out: run created -> all 200 succeeded, the same way (bar 3 s). The machine's load average is
printed before and after: take figures on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.procstat import (  # noqa: E402
    children_cpu_s,
    cpu_s,
    helpers_cpu_s,
    machine_busy_s,
    reaped_cpu_s,
)
from bench.stack import exit_on_sigterm, free_port  # noqa: E402

PROGRAMS = {"true": ("/bin/true", []), "bash": ("/bin/bash", ["-c", "true"])}
_LOOK_S = 0.25  # how often the bench looks whether a run ended


def _artifact(path: str) -> dict[str, str]:
    return {"uri": f"file://{path}", "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


class Up:
    """`cairn up` in a home of its own, on free ports; stopped with Ctrl-C's signal."""

    def __init__(self, root: Path) -> None:
        self.home = root / "home"
        port, dag = free_port(), free_port()
        self.core_url, self.dag_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dag}"
        env = {
            **os.environ,
            "CAIRN_HOME": str(self.home),
            "CAIRN_CORE_PORT": str(port),
            "CAIRN_CRON_PORT": str(free_port()),
            "CAIRN_DAG_PORT": str(dag),
            "CAIRN_DAG_URL": self.dag_url,
            "CAIRN_URL": self.core_url,
            "CAIRN_LOG_LEVEL": "warning",
        }
        env.pop("CAIRN_DATABASE_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cairn", "up"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "Ctrl-C stops everything" in line:
                break
        else:
            raise SystemExit("cairn up ended early")
        # Drained in the background, so the services' log never fills the pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout or []], daemon=True).start()
        token = (self.home / "admin-token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        self.core = httpx.Client(base_url=self.core_url, headers=headers, timeout=30)
        self.dag = httpx.Client(base_url=self.dag_url, headers=headers, timeout=30)

    def cpu(self, *, end: bool = False) -> dict[str, float]:
        """CPU seconds so far of each service (core, dag, the worker agent with its spawn
        helpers and the attempts it reaped, PostgreSQL's postmaster and backends) and of
        the whole machine. The machine's is read before the walks of ``/proc`` at the
        window's ``end`` and after them at its start, so that their cost is not in it."""
        machine = machine_busy_s() if end else None
        pids = {
            name: pid
            for name, pid, _ in json.loads((self.home / "up.json").read_text())["services"]
        }
        pg = int((self.home / "pg" / "data" / "postmaster.pid").read_text().split()[0])
        agent = pids["worker"]
        return {
            "core": cpu_s(pids["core"]),
            "dag": cpu_s(pids["dag"]),
            "agent": cpu_s(agent) + helpers_cpu_s(agent) + reaped_cpu_s(agent),
            "postgres": cpu_s(pg) + children_cpu_s(pg),
            "machine": machine if machine is not None else machine_busy_s(),
        }

    def stop(self) -> None:
        self.core.close()
        self.dag.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _at(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def _run(up: Up, name: str, nodes: list[dict[str, Any]], timeout_s: float) -> tuple[float, dict]:
    """Run the workflow; (its time from created to finished, by the run's own timestamps,
    the run with its nodes). Waits by listing the workflow's runs, without their nodes:
    reading a run of hundreds of nodes every few milliseconds would load the DAG service
    (two cores) with the bench's own reads. Every ``_LOOK_S``: the run's own timestamps
    time it, so how soon the bench sees its end changes no figure, and listing every
    50 ms was 15 % of the DAG service's CPU during a chain (py-spy)."""
    up.dag.post("/v1/workflows", json={"name": name, "nodes": nodes}).raise_for_status()
    began = time.monotonic()
    run = up.dag.post(f"/v1/workflows/{name}/runs", json={}).raise_for_status().json()
    while True:
        listed = up.dag.get("/v1/runs", params={"workflow": name, "limit": 1})
        light = next(r for r in listed.raise_for_status().json()["items"] if r["id"] == run["id"])
        if light["state"] in ("succeeded", "failed", "cancelled"):
            run = up.dag.get(f"/v1/runs/{run['id']}").raise_for_status().json()
            took = _at(run["finished_at"]) - _at(run["created_at"])  # type: ignore[operator]
            return took, run
        if time.monotonic() - began > timeout_s:
            raise SystemExit(f"{name}: not done in {timeout_s} s ({light['state']})")
        time.sleep(_LOOK_S)


def _times(up: Up, task_id: int) -> tuple[float, float, float]:
    """(task created, attempt started, attempt ended) of a task's last attempt."""
    task = up.core.get(f"/v1/tasks/{task_id}").raise_for_status().json()
    attempts = up.core.get(f"/v1/tasks/{task_id}/attempts").raise_for_status().json()
    last = attempts["items"][-1] if isinstance(attempts, dict) else attempts[-1]
    created, started, ended = (
        _at(task["created_at"]),
        _at(last["started_at"]),
        _at(last["ended_at"]),
    )
    assert created is not None and started is not None and ended is not None
    return created, started, ended


def _looks(up: Up) -> dict[str, float]:
    """Core's looks by woken waiting claims so far, by what they found (leased, empty);
    a claim's first look, in its own turn, is not counted. Beside them the agent's turns
    by what they carried (``turn_<kind>``: ``cairn_turns_total``)."""
    found = {"leased": 0.0, "empty": 0.0}
    for line in up.core.get("/metrics").text.splitlines():
        if line.startswith("cairn_claim_looks_total{"):
            kind = "leased" if 'outcome="leased"' in line else "empty"
            found[kind] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("cairn_turns_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[f"turn_{kind}"] = float(line.rsplit(" ", 1)[1])
    return found


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"p50 {statistics.median(values) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=400)
    parser.add_argument("--fanout", type=int, default=200)
    parser.add_argument("--program", choices=sorted(PROGRAMS), default="true")
    args = parser.parse_args()
    exit_on_sigterm()
    path, argv = PROGRAMS[args.program]
    task = {"artifact": _artifact(path), "args": argv}
    root = Path(tempfile.mkdtemp(prefix="cairn-chain-bench-"))
    root.chmod(0o755)  # the embedded server's own user reads below it
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    up = Up(root)
    try:
        # A warm-up run: the first attempt verifies and caches the artifact.
        _run(up, "warm", [{"name": "n0", "task": task}], 60)
        chain = [{"name": "n0", "task": task}] + [
            {"name": f"n{i}", "task": task, "depends_on": [f"n{i - 1}"]}
            for i in range(1, args.chain)
        ]
        looks = _looks(up)
        before = up.cpu()
        took, run = _run(up, "chain", chain, 30 + args.chain)
        after, looked = up.cpu(end=True), _looks(up)
        print(
            f"chain of {args.chain} ({args.program}): {run['state']} in {took:.2f} s, "
            f"{took / args.chain * 1000:.1f} ms a hop (bar: 10 s for 400)"
        )
        print(
            "  CPU a hop: "
            + ", ".join(
                f"{name} {(after[name] - before[name]) / args.chain * 1000:.1f} ms"
                for name in before
            )
        )
        print(
            "  woken claims' looks and turns by kind a hop: "
            + ", ".join(f"{k} {(looked[k] - looks[k]) / args.chain:.2f}" for k in looks)
        )
        by_name = {n["name"]: n for n in run["nodes"]}
        times = [_times(up, by_name[f"n{i}"]["task_id"]) for i in range(args.chain)]
        release = [times[i][0] - times[i - 1][2] for i in range(1, len(times))]
        claim = [started - created for created, started, _ in times]
        ran = [ended - started for _, started, ended in times]
        print(f"  release (ended -> next created): {_ms(release)}")
        print(f"  claim (created -> started):      {_ms(claim)}")
        print(f"  run (started -> ended):          {_ms(ran)}")
        if args.fanout:
            fan = [{"name": "root", "task": task}] + [
                {"name": f"f{i}", "task": task, "depends_on": ["root"]} for i in range(args.fanout)
            ]
            took, run = _run(up, "fanout", fan, 60 + args.fanout)
            print(
                f"fan-out of {args.fanout} behind one root: {run['state']} in {took:.2f} s "
                "(bar: 3 s)"
            )
    finally:
        up.stop()
        shutil.rmtree(root, ignore_errors=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
