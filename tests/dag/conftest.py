"""The DAG service served in a thread over real HTTP, talking to a real core, and a
worker that claims and reports through core's real worker API."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from libs.common.dag_models import RUN_FINAL
from services.dag.app import create_app
from services.dag.settings import DagSettings
from tests.support import TRUE_SHA, Core, free_port, make_token, serve_in_thread, wait_for


@dataclass
class DagServer:
    url: str
    core: Core
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, name: str = "alice", role: str = "user") -> httpx.Client:
        if name not in self.core.tokens:
            self.core.tokens[name] = make_token(self.core.db_url, name, role)
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.core.tokens[name]}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def dag_settings(core_url: str, db_url: str, home: Path, port: int, token: str) -> DagSettings:
    return DagSettings(
        home=home,
        database_url=db_url,
        url=core_url,
        token=token,
        dag_port=port,
        feed_wait_s=2.0,
        retry_base_s=0.05,
        retry_cap_s=0.5,
        token_cache_s=0,
    )


def start_dag(core: Core, home: Path, core_url: str | None = None) -> DagServer:
    port = free_port()
    token = make_token(core.db_url, f"dag-service-{port}", "service")
    settings = dag_settings(core_url or core.url, core.db_url, home, port, token)
    server, thread = serve_in_thread(create_app(settings, core.db_url), port, "dag")
    return DagServer(f"http://127.0.0.1:{port}", core, server, thread)


@pytest.fixture
def dag(core: Core, tmp_path: Path) -> Iterator[DagServer]:
    server = start_dag(core, tmp_path / "dag")
    yield server
    server.stop()


def outcome_of(args: list[str]) -> str:
    """How the test worker ends a task: by its first argument. ``ok``; ``out JSON``:
    succeeds with JSON as its outputs; ``fail`` (dead at once); ``fail-below N TRY``:
    fails while the node's try is below N; ``hold``: never reported."""
    if not args or args[0] in ("ok", "out"):
        return "succeeded"
    if args[0] == "fail-below":
        return "failed" if int(args[2]) < int(args[1]) else "succeeded"
    return {"fail": "failed", "hold": "hold"}[args[0]]


class Worker:
    """A worker in a thread: claims through core's HTTP API and reports at once, as
    ``outcome_of`` says. Counts how often each task was handed out."""

    def __init__(self, core: Core, name: str = "test-worker", delay_s: float = 0) -> None:
        self.delay_s = delay_s
        self.http = core.client(name, "worker")
        offer = {"hostname": name, "queues": ["default"], "cpu": 4096, "memory_mb": 2**25}
        registered = self.http.post("/v1/workers", json=offer).raise_for_status().json()
        self.id = registered["worker"]["id"]
        self.http.headers["X-Cairn-Worker-Lease"] = registered["lease"]
        self.claims: Counter[int] = Counter()
        self.held: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, daemon=True, name=name)
        self._thread.start()

    def _work(self) -> None:
        room = {"cpu": 4096, "memory_mb": 2**25, "max": 256, "wait": 0.3}
        while not self._stop.is_set():
            try:
                answer = self.http.post(f"/v1/workers/{self.id}/claim", json=room)
            except httpx.TransportError:
                continue
            for attempt in answer.json().get("attempts", []):
                self.claims[attempt["task_id"]] += 1
                outcome = outcome_of(attempt["args"])
                if outcome == "hold":
                    self.held.append(attempt["task_id"])
                    continue
                report = {"outcome": outcome, "exit_code": 0 if outcome == "succeeded" else 1}
                if attempt["args"][:1] == ["out"]:
                    report["outputs"] = json.loads(attempt["args"][1])
                if outcome == "failed":
                    report["retryable"] = False
                time.sleep(self.delay_s)
                path = f"/v1/workers/{self.id}/attempts/{attempt['attempt_id']}/report"
                self.http.post(path, json=report)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.http.close()


@pytest.fixture
def worker(core: Core) -> Iterator[Worker]:
    started = Worker(core)
    yield started
    started.stop()


def node(name: str, *depends_on: str, args: tuple[str, ...] = ("ok",), **extra: Any) -> dict:
    task = {"artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA}, "args": list(args)}
    task.update(extra.pop("task", {}))
    return {"name": name, "task": task, "depends_on": list(depends_on), **extra}


def workflow(name: str, nodes: list[dict], **extra: Any) -> dict:
    return {"name": name, "nodes": nodes, **extra}


@dataclass
class Runner:
    http: httpx.Client
    started: list[int] = field(default_factory=list)

    def define(self, body: dict) -> dict:
        answer = self.http.post("/v1/workflows", json=body)
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    def start(self, name: str, **body: Any) -> dict:
        answer = self.http.post(f"/v1/workflows/{name}/runs", json=body)
        assert answer.status_code == 201, answer.text
        return answer.json()

    def get(self, run_id: int) -> dict:
        return self.http.get(f"/v1/runs/{run_id}").raise_for_status().json()

    def wait_end(self, run_id: int, timeout: float = 60) -> dict:
        def ended() -> dict | None:
            run = self.get(run_id)
            return run if run["state"] in RUN_FINAL else None

        return wait_for(ended, timeout=timeout, interval=0.05)

    def run(self, body: dict, timeout: float = 60, **start: Any) -> dict:
        self.define(body)
        return self.wait_end(self.start(body["name"], **start)["id"], timeout)


@pytest.fixture
def runner(dag: DagServer) -> Iterator[Runner]:
    with dag.client() as http:
        yield Runner(http)


def states(run: dict) -> dict[str, str]:
    return {n["name"]: n["state"] for n in run["nodes"]}
