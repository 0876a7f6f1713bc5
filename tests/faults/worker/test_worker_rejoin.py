"""A worker agent that core declared dead (an outage, a partition) stops the attempts
core re-placed and registers again, instead of exiting and taking its host out."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.worker import test_worker as base
from tests.faults.worker.test_worker import shell, start_worker
from tests.support import Core, shared_dir, wait_for

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


SLOW_SIDECAR = """
import sys, time
if "services.worker.sidecar" in sys.orig_argv:
    time.sleep(3 * {timeout})  # a sidecar that starts slower than the heartbeat timeout
"""


def test_a_worker_is_not_declared_dead_while_its_sidecar_starts(
    core: Core,
    db: DB,
    tmp_path: Path,
    workers: list[subprocess.Popen[bytes]],
) -> None:
    # A fresh interpreter's imports alone took 5 to 9 s on a loaded host; here the sidecar
    # is made to start in three heartbeat timeouts, whatever the host's load.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_SIDECAR.format(timeout=base.TIMEOUT_S))
    path = os.pathsep.join(p for p in (str(slow), os.environ.get("PYTHONPATH")) if p)
    start_worker(core, tmp_path / "w", workers, PYTHONPATH=path)
    with core.client("alice") as alice:
        # It runs past the timeout, before the sidecar's first beat.
        task = alice.post("/v1/tasks", json=shell(f"sleep {2 * base.TIMEOUT_S}")).json()
        wait_for(
            lambda: alice.get(f"/v1/tasks/{task['id']}").json()["state"] == "succeeded",
            timeout=60,
        )
    # One registration, never declared dead; the attempt ran once.
    assert [s for _, s in _workers(db)] == ["live"]
    outcomes = db.execute("SELECT outcome FROM core.attempts").fetchall()
    assert outcomes == [("succeeded",)]
