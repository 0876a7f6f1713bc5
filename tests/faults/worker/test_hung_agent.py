"""A worker agent that hangs (SIGSTOP: its event loop stands still) while its sidecar runs
on: the sidecar kills its attempts and tells core, which buries the worker, loses the
attempt and retries its task; the agent, woken, joins afresh and the task completes."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.faults.worker import test_worker as base
from tests.faults.worker.test_worker import shell, start_worker
from tests.support import Core, shared_dir, start_core, wait_for
from tests.support.procs import alive

pytestmark = pytest.mark.slow
workers = base.workers
DB = psycopg.Connection[tuple[Any, ...]]
#: the hang bound: the sidecar acts at half of it, core at the whole
HANG_S = 6.0


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(
        db_url, tmp_path / "core", heartbeat_interval_s=0.2, heartbeat_timeout_s=base.TIMEOUT_S,
        agent_hang_timeout_s=HANG_S,
    )  # fmt: skip
    yield server
    server.stop()


def _sidecar_of(agent: int) -> int | None:
    """The agent's sidecar, among its children (None before it started)."""
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    for child in map(int, children):
        with contextlib.suppress(FileNotFoundError):
            if b"services.worker.sidecar" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


def _workers(db: DB) -> list[tuple[Any, ...]]:
    return db.execute("SELECT id, state FROM core.workers ORDER BY id").fetchall()


def _agent(
    core: Core, db: DB, tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], int]:
    """A real agent, registered, and its sidecar's pid."""
    agent = start_worker(core, tmp_path / "w", workers)
    wait_for(lambda: [s for _, s in _workers(db)] == ["live"], timeout=30)
    return agent, wait_for(lambda: _sidecar_of(agent.pid), timeout=30)


def test_an_agent_stopped_while_its_sidecar_runs_has_its_attempt_killed_and_lost(
    core: Core, db: DB, tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> None:
    agent, sidecar = _agent(core, db, tmp_path, workers)
    pidfile, again = shared_dir() / "pid", shared_dir() / "again"
    # The first attempt runs for good (its hard timeout lives in the hung agent); the
    # retry ends at once.
    script = f"if [ -e {again} ]; then exit 0; fi; touch {again}; echo $$ > {pidfile}; sleep 600"
    body = shell(script, retry={"max_attempts": 3, "base_s": 0.1, "jitter": False})
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=body).json()["id"]
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30)
        orphan = int(pidfile.read_text())
        [(worker, _)] = _workers(db)
        stopped = time.monotonic()
        agent.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: not alive(orphan), timeout=HANG_S)
            killed_s = time.monotonic() - stopped
            wait_for(lambda: _workers(db) == [(worker, "dead")], timeout=HANG_S)
            assert alive(sidecar), "the sidecar runs on beside the stopped agent"
            outcome, error, state = db.execute(
                "SELECT a.outcome, a.error, t.state FROM core.attempts a"
                " JOIN core.tasks t ON t.id = a.task_id WHERE a.task_id = %s",
                (task,),
            ).fetchone()
            assert outcome == "lost" and "agent hung" in error, error
            assert state in ("failed", "waiting")  # retried after its backoff
            beat = db.execute("SELECT last_heartbeat_at FROM core.workers").fetchone()
            time.sleep(1.0)  # five heartbeat intervals: the sidecar beats no more
            assert db.execute("SELECT last_heartbeat_at FROM core.workers").fetchone() == beat
        finally:
            agent.send_signal(signal.SIGCONT)
        assert killed_s < HANG_S
        # Woken, the agent reads that it is dead, joins afresh, and the retry runs there.
        wait_for(lambda: _state(alice, task) == "succeeded", timeout=60)
    assert agent.poll() is None
    rows = db.execute(
        "SELECT a.outcome, w.state FROM core.attempts a JOIN core.workers w ON w.id = a.worker_id"
        " ORDER BY a.id"
    ).fetchall()
    assert rows == [("lost", "dead"), ("succeeded", "live")]
    assert not alive(sidecar)


def _state(alice: Any, task_id: int) -> str:
    return str(alice.get(f"/v1/tasks/{task_id}").json()["state"])


def test_a_hung_agents_task_with_no_attempt_left_is_dead_and_its_sidecar_ends_with_it(
    core: Core, db: DB, tmp_path: Path, workers: list[subprocess.Popen[bytes]]
) -> None:
    agent, sidecar = _agent(core, db, tmp_path, workers)
    pidfile = shared_dir() / "pid"
    body = shell(f"echo $$ > {pidfile}; sleep 600", retry={"max_attempts": 1})
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=body).json()["id"]
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30)
        orphan = int(pidfile.read_text())
        agent.send_signal(signal.SIGSTOP)
        wait_for(lambda: not alive(orphan), timeout=HANG_S)
        wait_for(lambda: _state(alice, task) == "dead", timeout=HANG_S)
        final = alice.get(f"/v1/tasks/{task}").json()
    assert "agent hung" in final["last_error"]
    assert [s for _, s in _workers(db)] == ["dead"]
    # Killed while stopped, the agent takes its sidecar with it (its pidfd wakes it).
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    wait_for(lambda: not alive(sidecar), timeout=10)
    assert [s for _, s in _workers(db)] == ["dead"]  # no last word turned it into "left"
