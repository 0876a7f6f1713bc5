"""A long-lived ``kind: service``: its restart backoff resets after a healthy run, only
recent crashes count towards burying it, and its host's death never does."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
import pytest

from tests.support import Core, spec, wait_for

pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)

DB = psycopg.Connection[tuple[Any, ...]]
ROOM = {"cpu": 4, "memory_mb": 4096, "max": 1, "wait": 2}


def _register(http: httpx.Client) -> int:
    offer = {"hostname": "w", "queues": ["default"], "cpu": 4, "memory_mb": 4096}
    registered = http.post("/v1/workers", json=offer).json()
    http.headers["X-Cairn-Worker-Lease"] = registered["lease"]
    return int(registered["worker"]["id"])


def _claim(http: httpx.Client, db: DB, worker: int, task_id: int) -> int:
    """Make the task due now and take its next attempt (seen running by a heartbeat)."""
    db.execute("UPDATE core.tasks SET run_at = now() WHERE id = %s", (task_id,))
    wait_for(lambda: _state(db, task_id) == "waiting", timeout=10)
    (attempt,) = http.post(f"/v1/workers/{worker}/claim", json=ROOM).json()["attempts"]
    beat = http.post(f"/v1/workers/{worker}/heartbeat", json={"attempts": [attempt["attempt_id"]]})
    assert beat.status_code == 200
    return int(attempt["attempt_id"])


def _report(http: httpx.Client, worker: int, attempt: int, outcome: str) -> None:
    path = f"/v1/workers/{worker}/attempts/{attempt}/report"
    assert http.post(path, json={"outcome": outcome, "exit_code": 1}).status_code == 200


def _state(db: DB, task_id: int) -> str:
    row = db.execute("SELECT state FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _wait_s(db: DB, task_id: int) -> float:
    row = db.execute(
        "SELECT EXTRACT(EPOCH FROM run_at - now()) FROM core.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row is not None
    return float(row[0])


def _service(core: Core) -> int:
    with core.client("alice") as alice:
        answer = alice.post("/v1/tasks", json=spec(kind="service"))
        assert answer.status_code == 201, answer.text
        return int(answer.json()["id"])


def test_a_healthy_run_resets_the_restart_backoff(core: Core, db: DB) -> None:
    task_id = _service(core)
    with core.client("w", "worker") as http:
        worker = _register(http)
        for _ in range(10):  # ten quick exits: the backoff grows
            _report(http, worker, _claim(http, db, worker, task_id), "failed")
        assert _wait_s(db, task_id) > 600
        attempt = _claim(http, db, worker, task_id)
        db.execute(
            "UPDATE core.attempts SET started_at = now() - interval '11 minutes' WHERE id = %s",
            (attempt,),
        )
        _report(http, worker, attempt, "failed")
    assert _state(db, task_id) == "failed"
    assert _wait_s(db, task_id) < 60  # the first step of the curve again


def test_only_crashes_within_the_window_bury_a_service(core: Core, db: DB) -> None:
    task_id = _service(core)
    with core.client("w", "worker") as http:
        worker = _register(http)
        for _ in range(2):
            _report(http, worker, _claim(http, db, worker, task_id), "crashed")
        db.execute(
            "UPDATE core.attempts SET started_at = started_at - interval '2 hours',"
            " ended_at = ended_at - interval '2 hours' WHERE task_id = %s",
            (task_id,),
        )
        _report(http, worker, _claim(http, db, worker, task_id), "crashed")
        assert _state(db, task_id) == "failed"  # two of its three crashes are old
        for _ in range(2):
            _report(http, worker, _claim(http, db, worker, task_id), "crashed")
    assert _state(db, task_id) == "dead"


def test_a_hosts_death_never_counts_against_a_service(core: Core, db: DB) -> None:
    task_id = _service(core)
    with core.client("w", "worker") as http:
        for _ in range(4):
            worker = _register(http)
            _claim(http, db, worker, task_id)
            # The host goes silent: the reaper declares it dead with its attempt.
            wait_for(lambda: _state(db, task_id) != "running", timeout=15)
            assert _state(db, task_id) in ("failed", "waiting")
    crashes = db.execute("SELECT crashes FROM core.tasks WHERE id = %s", (task_id,)).fetchone()
    assert crashes == (0,)
