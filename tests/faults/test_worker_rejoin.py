"""A worker agent that core declared dead (an outage, a partition) stops the attempts
core re-placed and registers again, instead of exiting and taking its host out."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults import test_worker as base
from tests.faults.test_worker import shell, start_worker
from tests.support import Core, shared_dir, start_core, wait_for

pytestmark = pytest.mark.slow
core = base.core
workers = base.workers
DB = psycopg.Connection[tuple[Any, ...]]


def _workers(db: DB) -> list[tuple[Any, ...]]:
    return db.execute("SELECT id, state FROM core.workers ORDER BY id").fetchall()


def test_an_agent_told_it_is_dead_kills_its_attempts_and_registers_again(
    core: Core,
    db: DB,
    tmp_path: Path,
    workers: list[subprocess.Popen[bytes]],
) -> None:
    agent = start_worker(core, tmp_path / "w", workers)
    wait_for(lambda: [s for _, s in _workers(db)] == ["live"], timeout=30)
    marker = shared_dir() / "still-running"
    with core.client("alice") as alice:
        script = f"while true; do touch {marker}; sleep 0.1; done"
        long_id = alice.post("/v1/tasks", json=shell(script)).json()["id"]
        wait_for(marker.exists, timeout=30)
        # The reaper's verdict, as after a partition: the worker is dead, its attempt lost.
        db.execute("UPDATE core.workers SET state = 'dead', gone_at = now()")
        db.execute(
            "UPDATE core.attempts SET outcome = 'lost', ended_at = now() WHERE outcome IS NULL"
        )
        db.execute(
            "UPDATE core.tasks SET state = 'cancelled', finished_at = now() WHERE id = %s",
            (long_id,),
        )
        wait_for(lambda: [s for _, s in _workers(db)] == ["dead", "live"], timeout=30)
        marker.unlink()
        assert agent.poll() is None
        task = alice.post("/v1/tasks", json=shell("exit 0")).json()
        done = wait_for(
            lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "succeeded",
            timeout=30,
        )
        assert done
    assert not marker.exists()  # the abandoned attempt's process was killed


@pytest.fixture
def brisk_core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    # A heartbeat timeout shorter than a fresh interpreter's start (the sidecar's imports
    # alone take about that long on an idle host, several seconds on a loaded one).
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0
    )
    yield server
    server.stop()


def test_a_worker_is_not_declared_dead_while_its_sidecar_starts(
    brisk_core: Core,
    db: DB,
    tmp_path: Path,
    workers: list[subprocess.Popen[bytes]],
) -> None:
    start_worker(brisk_core, tmp_path / "w", workers)
    with brisk_core.client("alice") as alice:
        task = alice.post("/v1/tasks", json=shell("sleep 1")).json()
        wait_for(
            lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "succeeded",
            timeout=60,
        )
    # One registration, never declared dead; the attempt ran once.
    assert [s for _, s in _workers(db)] == ["live"]
    outcomes = db.execute("SELECT outcome FROM core.attempts").fetchall()
    assert outcomes == [("succeeded",)]
