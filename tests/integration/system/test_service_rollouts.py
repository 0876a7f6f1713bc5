"""A service kept at N replicas by core's controller, with two real agents in two zones
(docs/services.md): its replicas spread across them; a rolling update to a new artifact
ends with N replicas of it, never fewer than N ready on the way (``max_unavailable`` 0);
a new artifact whose replicas never get ready is rolled back at its deadline, and the
old replicas, never stopped, keep serving; one whose replicas exit at once is rolled
back after ``max_failures`` of their exits, long before its deadline. And the same through
``cairn service``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from cairn.cli import app
from tests.support import Core, Workers, cli_as, start_core, wait_for

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
CRASHING = "#!/bin/sh\nexit 1\n"


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


def _cells(line: str) -> list[str]:
    """The cells of a row of the CLI's table."""
    return [cell.strip() for cell in line.strip().strip("│┃").split("│")]


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
        for bad in (0, 1001):
            body = {"name": "web", "template": template, "rollout": {"max_failures": bad}}
            answer = alice.post("/v1/services", json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["errors"][0]["field"] == "body.rollout.max_failures"
        zero = {"name": "web", "template": template, "rollout": {"max_surge": 0}}
        answer = alice.post("/v1/services", json=zero)
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["field"] == "body.rollout"
        assert alice.get("/v1/services/nothing").status_code == 404


def test_a_revision_whose_replicas_exit_at_once_is_rolled_back_before_its_deadline(
    core: Core, workers: Workers, db: DB, tmp_path: Path, artifacts: Path
) -> None:
    workers.start(
        core, tmp_path / "w", "w", CAIRN_WORKER_LABELS="zone=a", CAIRN_WORKER_ADDRESS="127.0.0.1"
    )
    v1 = _artifact(artifacts, "v1", SERVER.replace("VERSION", "v1"))
    crashing = _artifact(artifacts, "v2", CRASHING)
    rollout = {"max_surge": 1, "max_unavailable": 0, "deadline_s": 600, "max_failures": 2}
    body = {"name": "web", "replicas": 1, "template": _template(v1), "rollout": rollout}
    with core.client() as alice:
        assert alice.post("/v1/services", json=body).status_code == 201

        def state() -> dict[str, Any]:
            return alice.get("/v1/services/web").json()

        wait_for(lambda: state()["rollout_state"] == "complete", timeout=40)
        (old,) = _running(db)
        (old_attempt,) = db.execute(
            "SELECT current_attempt_id FROM core.tasks WHERE id = %s", (old[0],)
        ).fetchone()
        # Its restarts quick (0.2 s backoff), so that two exits come at once.
        bad = {**_template(crashing), "retry": {"base_s": 0.2, "cap_s": 0.5}}
        changed = alice.patch("/v1/services/web", json={"template": bad})
        assert changed.status_code == 200, changed.text
        assert changed.json()["revision"] == 2
        wait_for(lambda: state()["rollout_state"] == "rolled_back", timeout=30, interval=0.1)
        # Back on revision 1 after two exits, ten minutes before the deadline.
        service = db.execute(
            "SELECT revision, rollout, message, updated_at - rollout_at FROM core.services"
        ).fetchone()
        assert service[:2] == (1, "rolled_back")
        assert service[2].startswith("revision 2 failed 2 times (last: exited 1)")
        assert service[2].endswith(": rolled back to revision 1")
        assert service[3].total_seconds() < 30
        (step,) = db.execute(
            "SELECT detail FROM core.service_steps WHERE step = 'rolled_back'"
        ).fetchone()
        assert step == service[2]
        audited = db.execute(
            "SELECT actor, target, before, after FROM core.audit WHERE action = 'service.rollback'"
        ).fetchall()
        assert audited == [
            (
                "cairn-services",
                "service:alice/web",
                {"revision": 2},
                {"revision": 1, "reason": step},
            )
        ]
        failed = db.execute(
            "SELECT count(*) FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id"
            " WHERE t.labels->>'cairn.revision' = '2' AND a.outcome = 'failed'"
            " AND a.exit_code = 1"
        ).fetchone()[0]
        assert failed >= 2
        # The old replica was never stopped: the same task, on the same attempt.
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM core.tasks WHERE labels->>'cairn.revision' = '2'"
                    " AND state IN ('ready', 'waiting', 'running', 'failed')"
                ).fetchone()[0]
                == 0
            ),
            timeout=10,
        )
        assert _running(db) == [old]
        row = db.execute(
            "SELECT state, current_attempt_id FROM core.tasks WHERE id = %s", (old[0],)
        ).fetchone()
        assert row == ("running", old_attempt)
        assert _versions(alice) == ["v1"]


def test_the_cli_creates_shows_rolls_lists_and_removes_a_service(
    core: Core,
    workers: Workers,
    db: DB,
    tmp_path: Path,
    artifacts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cli = cli_as(core, monkeypatch, tmp_path)
    workers.start(
        core, tmp_path / "w", "w", CAIRN_WORKER_LABELS="zone=a", CAIRN_WORKER_ADDRESS="127.0.0.1"
    )
    v1 = _artifact(artifacts, "v1", SERVER.replace("VERSION", "v1"))
    v2 = _artifact(artifacts, "v2", SERVER.replace("VERSION", "v2"))
    spec = tmp_path / "web.json"
    spec.write_text(json.dumps(_template(v1)))

    def complete(revision: int) -> bool:
        row = db.execute("SELECT revision, rollout FROM core.services").fetchone()
        return row == (revision, "complete")

    made = cli.invoke(app, ["service", "create", "web", "-f", str(spec), "--max-failures", "2"])
    assert made.exit_code == 0, made.output
    assert "service web: created: revision 1, 1 replicas" in made.output
    wait_for(lambda: complete(1), timeout=40)
    shown = cli.invoke(app, ["service", "get", "web"])
    assert shown.exit_code == 0, shown.output
    ((port,),) = db.execute(
        "SELECT a.ports->>'http' FROM core.tasks t JOIN core.attempts a"
        " ON a.id = t.current_attempt_id WHERE t.state = 'running'"
    ).fetchall()
    for text in ("1/1 of revision 1", f"http 127.0.0.1:{port}", "max failures 2"):
        assert text in shown.output
    assert [_cells(line)[1] for line in shown.output.splitlines() if "Z │" in line] == [
        "created",
        "starting",
        "complete",
    ]

    # A new artifact on the same template: rolled out.
    rolled = cli.invoke(app, ["service", "set", "web", "--artifact", v2["uri"]])
    assert rolled.exit_code == 0, rolled.output
    assert "revision 2, 1 replicas, rollout progressing" in rolled.output
    wait_for(lambda: complete(2), timeout=40)
    # Complete: nothing left to roll back to.
    assert db.execute("SELECT previous, previous_revision FROM core.services").fetchone() == (
        None,
        None,
    )
    got = json.loads(cli.invoke(app, ["--json", "service", "get", "web"]).output)
    assert got["template"]["artifact"] == v2
    assert got["rollout"]["max_failures"] == 2  # kept
    assert [e["ready"] for e in got["endpoints"]] == [True]
    (address,) = got["endpoints"][0]["endpoints"].values()
    assert httpx.get(f"http://{address}/").text == "v2"
    listed = cli.invoke(app, ["service", "ls"])
    assert _cells(listed.output.splitlines()[3])[:5] == ["web", "2", "complete", "1/1", "1"]

    refused = cli.invoke(app, ["service", "set", "web", "--max-failures", "0"])
    assert refused.exit_code != 0
    assert "rollout.max_failures" in refused.output

    removed = cli.invoke(app, ["service", "rm", "web"])
    assert removed.exit_code == 0, removed.output
    assert db.execute("SELECT count(*) FROM core.services").fetchone() == (0,)
    live = db.execute(
        "SELECT count(*) FROM core.tasks WHERE state IN ('ready', 'waiting', 'running', 'failed')"
    ).fetchone()
    assert live == (0,)
    gone = cli.invoke(app, ["service", "get", "web"])
    assert gone.exit_code == 1 and "404" in gone.output
