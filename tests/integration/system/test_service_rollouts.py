"""A service kept at N replicas by core's controller, with two real agents in two zones
(docs/services.md): its replicas spread across them; a rolling update to a new artifact
ends with N replicas of it, never fewer than N ready on the way (``max_unavailable`` 0);
a new artifact whose replicas never get ready is rolled back at its deadline, and the
old replicas, never stopped, keep serving."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import Core, Workers, start_core, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent must run as root")

DB = psycopg.Connection[tuple[Any, ...]]
SERVER = """#!/usr/bin/python3
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"VERSION")
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["CAIRN_PORT_HTTP"])), H).serve_forever()
"""
BROKEN = "#!/bin/sh\nexit 3\n"


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.2, services_interval_s=0.2
    )
    yield server
    server.stop()


@pytest.fixture
def artifacts() -> Iterator[Path]:
    """A folder the attempts' uids may read (file:// artifacts are read as them)."""
    folder = Path(tempfile.mkdtemp(prefix="cairn-rollout-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def _artifact(folder: Path, name: str, text: str) -> dict[str, str]:
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return {"uri": f"file://{path}", "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _template(artifact: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "web",
        "kind": "service",
        "artifact": artifact,
        "resources": {"cpu": 0.1, "memory_mb": 256},
        "placement": {"spread": {"by": "zone"}},
        "service": {
            "ports": [{"name": "http"}],
            "readiness": {"http": {"port": "http"}, "period_s": 0.1, "failure_threshold": 1},
        },
    }


def _running(db: DB) -> list[tuple[int, str, int]]:
    """The running replicas: task id, revision, worker."""
    rows = db.execute(
        "SELECT t.id, t.labels->>'cairn.revision', a.worker_id FROM core.tasks t"
        " JOIN core.attempts a ON a.id = t.current_attempt_id"
        " WHERE t.state = 'running' ORDER BY t.id"
    ).fetchall()
    return [tuple(r) for r in rows]


def _versions(alice: httpx.Client) -> list[str]:
    items = alice.get("/v1/services/web/endpoints").json()["items"]
    return sorted(httpx.get(f"http://{r['endpoints']['http']}/").text for r in items)


def test_replicas_spread_roll_to_a_new_artifact_and_a_bad_one_is_rolled_back(
    core: Core, workers: Workers, db: DB, tmp_path: Path, artifacts: Path
) -> None:
    for zone in ("a", "b"):
        workers.start(
            core,
            tmp_path / zone,
            f"w{zone}",
            CAIRN_WORKER_LABELS=f"zone={zone}",
            CAIRN_WORKER_ADDRESS="127.0.0.1",
        )
    v1 = _artifact(artifacts, "v1", SERVER.replace("VERSION", "v1"))
    v2 = _artifact(artifacts, "v2", SERVER.replace("VERSION", "v2"))
    broken = _artifact(artifacts, "v3", BROKEN)
    rollout = {"max_surge": 1, "max_unavailable": 0, "deadline_s": 4}
    body = {"name": "web", "replicas": 2, "template": _template(v1), "rollout": rollout}
    with core.client("root", "admin") as admin:
        wait_for(lambda: len(admin.get("/v1/workers").json()["items"]) == 2, timeout=20)
    with core.client() as alice:
        created = alice.post("/v1/services", json=body)
        assert created.status_code == 201, created.text

        def state() -> dict[str, Any]:
            return alice.get("/v1/services/web").json()

        wait_for(lambda: state()["rollout_state"] == "complete", timeout=40)
        first = _running(db)
        assert [r[1] for r in first] == ["1", "1"]
        assert len({r[2] for r in first}) == 2  # one per zone
        assert _versions(alice) == ["v1", "v1"]

        # A new artifact: rolled out one at a time, never fewer than 2 ready.
        changed = alice.patch("/v1/services/web", json={"template": _template(v2)})
        assert changed.status_code == 200, changed.text
        assert changed.json()["revision"] == 2
        seen_ready: list[int] = []

        def rolled() -> bool:
            seen_ready.append(len(_versions(alice)))
            return state()["rollout_state"] == "complete"

        wait_for(rolled, timeout=40, interval=0.1)
        assert min(seen_ready) >= 2
        second = _running(db)
        assert [r[1] for r in second] == ["2", "2"]
        assert _versions(alice) == ["v2", "v2"]
        stopped = db.execute(
            "SELECT state, last_error FROM core.tasks WHERE id = ANY(%s)", ([r[0] for r in first],)
        ).fetchall()
        assert {s for s, _ in stopped} == {"cancelled"}

        # A broken artifact: its replicas never get ready; rolled back at the deadline,
        # while the replicas of revision 2 kept serving.
        alice.patch("/v1/services/web", json={"template": _template(broken)})

        def back() -> bool:
            assert len(_versions(alice)) == 2
            return state()["rollout_state"] == "rolled_back"

        wait_for(back, timeout=30, interval=0.1)
        after = state()
        assert after["revision"] == 2
        assert "revision 3 not ready within 4 s: rolled back to revision 2" in after["message"]
        wait_for(lambda: _running(db) == second, timeout=20)
        assert _versions(alice) == ["v2", "v2"]
        steps = [s["step"] for s in after["steps"]]
        assert steps[0] == "created" and "rolled_back" in steps and "stopped" in steps
        # The broken revision's tasks are all stopped.
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM core.tasks WHERE labels->>'cairn.revision' = '3'"
                    " AND state IN ('ready', 'waiting', 'running', 'failed')"
                ).fetchone()[0]
                == 0
            ),
            timeout=10,
        )


def test_a_bad_service_spec_is_refused_naming_the_field(core: Core) -> None:
    template = _template({"uri": "file:///bin/true", "sha256": "0" * 64})
    with core.client() as alice:
        for change, field in (
            ({"kind": "task"}, "body.template.kind"),
            ({"idempotency_key": "k"}, "body.template.idempotency_key"),
            ({"labels": {"cairn.revision": "9"}}, "body.template.labels"),
        ):
            body = {"name": "web", "template": {**template, **change}}
            answer = alice.post("/v1/services", json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["errors"][0]["field"] == field
        zero = {"name": "web", "template": template, "rollout": {"max_surge": 0}}
        answer = alice.post("/v1/services", json=zero)
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["field"] == "body.rollout"
        assert alice.get("/v1/services/nothing").status_code == 404
