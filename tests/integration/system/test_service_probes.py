"""Services' probes run by a real agent (docs/services.md): a tiny HTTP server is the
service; its readiness flips are seen through core's endpoints API and in the database,
a failing liveness probe kills it with a clear error and its restart policy starts it
again; with egress ``none`` the probes reach into the replica's own network namespace,
and an exec probe runs inside its sandbox."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import SH, SH_SHA, Core, Workers, spec, start_core, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent must run as root")

DB = psycopg.Connection[tuple[Any, ...]]
PYTHON = Path(os.path.realpath("/usr/bin/python3"))
# /ready and /live answer 200 until /unready or /sick is asked; /ready again by /ready-again.
SERVER = """
import http.server, os
state = {"ready": True, "live": True}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        flips = {"/unready": ("ready", False), "/ready-again": ("ready", True),
                 "/sick": ("live", False)}
        if self.path in flips:
            key, value = flips[self.path]
            state[key] = value
        ok = {"/ready": state["ready"], "/live": state["live"]}.get(self.path, True)
        self.send_response(200 if ok else 503 if self.path == "/ready" else 500)
        self.end_headers()
    def log_message(self, *args):
        pass
port = int(os.environ["CAIRN_PORT_HTTP"])
http.server.ThreadingHTTPServer(("0.0.0.0", port), H).serve_forever()
"""
FAST = {"period_s": 0.2, "timeout_s": 1, "failure_threshold": 2}


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.2)
    yield server
    server.stop()


def _service(name: str, service: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    digest = hashlib.sha256(PYTHON.read_bytes()).hexdigest()
    return spec(
        name=name,
        kind="service",
        artifact={"uri": f"file://{PYTHON}", "sha256": digest},
        args=["-c", SERVER],
        resources={"cpu": 0.1, "memory_mb": 256},
        service=service,
        **overrides,
    )


def _attempt(db: DB, task_id: int) -> tuple[Any, ...]:
    """The task's current attempt: id, ready, address, ports, outcome (all None before
    its first)."""
    row = db.execute(
        "SELECT a.id, a.ready, a.address, a.ports, a.outcome"
        " FROM core.tasks t JOIN core.attempts a ON a.id = t.current_attempt_id"
        " WHERE t.id = %s",
        (task_id,),
    ).fetchone()
    return tuple(row) if row is not None else (None,) * 5


def test_readiness_flips_show_in_the_api_and_a_failing_liveness_probe_restarts_it(
    core: Core, workers: Workers, db: DB, tmp_path: Path
) -> None:
    workers.start(core, tmp_path / "w", "w", CAIRN_WORKER_ADDRESS="127.0.0.1")
    service = {
        "ports": [{"name": "http"}],
        "startup": {"tcp": {"port": "http"}, "period_s": 0.1, "failure_threshold": 100},
        "readiness": {"http": {"path": "/ready", "port": "http"}, **FAST},
        "liveness": {"http": {"path": "/live", "port": "http"}, **FAST},
    }
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=_service("web", service))
        assert answer.status_code == 201, answer.text
        task = answer.json()["id"]

        def ready_endpoints() -> list[dict[str, Any]]:
            return alice.get("/v1/services/web/endpoints").json()["items"]

        [replica] = wait_for(ready_endpoints, timeout=30)
        first, ready, address, ports, *_ = _attempt(db, task)
        assert (replica["attempt_id"], ready, address) == (first, True, "127.0.0.1")
        assert replica["endpoints"] == {"http": f"127.0.0.1:{ports['http']}"}
        url = f"http://{replica['endpoints']['http']}"
        # Not ready: gone from the endpoints, still running, its flag false in the database.
        assert httpx.get(f"{url}/unready").status_code == 200
        wait_for(lambda: not ready_endpoints(), timeout=10)
        [unready] = alice.get("/v1/services/web/endpoints?all=true").json()["items"]
        assert unready["ready"] is False
        assert _attempt(db, task)[1:2] == (False,)
        [listed] = alice.get(f"/v1/tasks/{task}/attempts").json()["items"]
        assert (listed["ready"], listed["ports"]) == (False, ports)
        httpx.get(f"{url}/ready-again")
        wait_for(ready_endpoints, timeout=10)
        # Sick: the liveness probe kills it, and the service is started again.
        httpx.get(f"{url}/sick")
        wait_for(lambda: _attempt(db, task)[4] is not None, timeout=30)
        outcome, error = db.execute(
            "SELECT outcome, error FROM core.attempts WHERE id = %s", (first,)
        ).fetchone()
        assert outcome == "failed"
        assert error == "liveness probe failed: HTTP 500 from GET /live"
        db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task,))
        [again] = wait_for(ready_endpoints, timeout=30)
        assert again["attempt_id"] != first


def test_probes_reach_a_replica_in_its_own_network_and_exec_runs_in_its_sandbox(
    core: Core, workers: Workers, db: DB, tmp_path: Path
) -> None:
    with core.client("root", "admin") as admin:
        sealed = admin.patch("/v1/queues/sealed", json={"egress": {"mode": "none"}})
        assert sealed.status_code == 200, sealed.text
    workers.start(core, tmp_path / "w", "w", CAIRN_WORKER_QUEUES="sealed")
    # The exec probe looks at the replica's private /tmp, as the replica's uid: the mark
    # the server's shell leaves there, removed after a while.
    marked = f"echo $(id -u) > /tmp/alive; (sleep 4; rm /tmp/alive) & exec {PYTHON} -c '{SERVER}'"
    service = {
        "ports": [{"name": "http"}],
        "readiness": {"tcp": {"port": "http"}, "period_s": 0.1, "failure_threshold": 1},
        "liveness": {
            "exec": {"command": ["sh", "-c", 'test "$(cat /tmp/alive)" = "$(id -u)"']},
            **FAST,
        },
    }
    body = _service("sealed-web", service, queue="sealed")
    body["artifact"] = {"uri": f"file://{SH}", "sha256": SH_SHA}
    body["args"] = ["-c", marked]
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=body)
        assert answer.status_code == 201, answer.text
        task = answer.json()["id"]
        wait_for(lambda: _attempt(db, task)[1] is True, timeout=30)
        first, _, address, ports, *_ = _attempt(db, task)
        assert address is None  # its own network: no address other hosts reach
        assert ports["http"] > 0
        # Ready, yet nobody on the host's network listens there: the probe went inside.
        listed = alice.get("/v1/services/sealed-web/endpoints").json()["items"]
        assert [r["endpoints"] for r in listed] == [{}]
    wait_for(lambda: _attempt(db, task)[0] != first or _attempt(db, task)[4], timeout=30)
    outcome, error, lived = db.execute(
        "SELECT outcome, error, EXTRACT(EPOCH FROM ended_at - started_at)"
        " FROM core.attempts WHERE id = %s",
        (first,),
    ).fetchone()
    assert outcome == "failed"
    assert error.startswith("liveness probe failed: sh -c"), error
    assert "exited 1" in error
    assert lived > 3.5  # the probe passed while the mark was there


def test_bad_probe_specs_are_refused_naming_the_field(core: Core) -> None:
    cases = [
        ({"readiness": {"period_s": 1}}, "body.service.readiness"),
        ({"liveness": {"tcp": {"port": "web"}}}, "body.service.liveness.tcp.port"),
        ({"ports": [{"name": "a"}, {"name": "a"}]}, "body.service.ports.1.name"),
        ({"startup": {"tcp": {"port": 80}, "period_s": 0}}, "body.service.startup.period_s"),
    ]
    with core.client() as alice:
        for service, field in cases:
            answer = alice.post("/v1/tasks", json=_service("bad", service))
            assert answer.status_code == 422, answer.text
            assert answer.json()["errors"][0]["field"] == field, answer.text
        plain = spec(service={"ports": [{"name": "http"}]})
        answer = alice.post("/v1/tasks", json=plain)
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["field"] == "body.service"
