"""The real worker agent claims delayed work ahead and starts its process at the task's
``run_at``, never before; a cancel while it holds the lease means the process never runs;
an agent killed while holding leaves the task to another attempt."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from services.worker import state
from tests.integration.core.test_dispatch import Agent, _close_agents  # noqa: F401 - closes them
from tests.support import Core, Workers, shared_dir, shell_spec, start_core, wait_for
from tests.support.procs import children

AHEAD_S = "30"


pytestmark = pytest.mark.core(
    promote_interval_s=60.0, heartbeat_interval_s=1, heartbeat_timeout_s=4, claim_ahead_max_s=30
)


def _marking(folder: Path, run_in_s: float, db) -> dict[str, object]:
    """A task due in ``run_in_s`` (by the database's clock) whose process writes the wall
    time it runs at, as its first command, into ``folder``/<task id>."""
    at = db.execute("SELECT now() + make_interval(secs => %s)", (run_in_s,)).fetchone()[0]
    script = f"date +%s.%N > {folder}/$CAIRN_TASK_ID"
    return shell_spec(script, run_at=at.isoformat(), resources={"cpu": 0.1, "memory_mb": 32})


def _submit(core: Core, body: dict[str, object]) -> int:
    with core.client() as alice:
        answer = alice.post("/v1/tasks", json=body)
        assert answer.status_code == 201, answer.text
        return int(answer.json()["id"])


def _claimed_ahead(db, task: int) -> bool:
    row = db.execute(
        "SELECT e.at < t.run_at FROM core.task_events e JOIN core.tasks t ON t.id = e.task_id"
        " WHERE t.id = %s AND e.op = 'claim'",
        (task,),
    ).fetchone()
    return bool(row and row[0])


def _serving(db, home: Path) -> None:
    """Wait until the agent is registered and its sidecar has had core's first answer."""
    wait_for(lambda: db.execute("SELECT id FROM core.workers").fetchone(), timeout=60)
    [worker] = db.execute("SELECT id FROM core.workers").fetchone()
    wait_for((home / "workers" / str(worker) / state.ANSWER).exists, timeout=60)


def _state(db, task: int) -> str:
    return str(db.execute("SELECT state FROM core.tasks WHERE id = %s", (task,)).fetchone()[0])


def test_the_agent_leases_ahead_and_starts_each_process_no_earlier_than_its_run_at(
    core: Core, db, tmp_path: Path, workers: Workers
) -> None:
    marks = shared_dir()
    workers.start(core, tmp_path / "w", "w", CAIRN_WORKER_CLAIM_AHEAD_S=AHEAD_S)
    _serving(db, tmp_path / "w")
    # Due 4 s on: a loaded machine (CI's suite beside this test) may take seconds between a
    # submission and its lease, which must come before run_at to be "ahead".
    ids = [_submit(core, _marking(marks, 4.0 + n * 0.3, db)) for n in range(5)]
    wait_for(lambda: all(_state(db, t) == "succeeded" for t in ids), timeout=60, interval=0.1)
    for task in ids:
        assert _claimed_ahead(db, task)
        run_at = db.execute("SELECT run_at FROM core.tasks WHERE id = %s", (task,)).fetchone()[0]
        started = float((marks / str(task)).read_text())
        # Tolerance: only the clocks' granularity (microseconds in the database).
        assert started >= run_at.timestamp() - 1e-3, (task, started, run_at.timestamp())


@pytest.mark.parametrize("beat_s", [1, 60], ids=["heartbeat-answer", "check-at-start"])
def test_a_cancel_while_the_agent_holds_the_lease_means_the_process_never_runs(
    db_url: str, db, tmp_path: Path, workers: Workers, beat_s: int
) -> None:
    """Heard of through a heartbeat's answer, or (beats a minute apart) by the agent's
    check at the start. One slot: the task after it is leased only once the held one's
    slot is free again, i.e. once the agent is done with the held one."""
    core = start_core(
        db_url, tmp_path, promote_interval_s=60.0, heartbeat_interval_s=beat_s,
        heartbeat_timeout_s=3 * beat_s + 1, claim_ahead_max_s=30,
    )  # fmt: skip
    try:
        _cancel_while_held(core, db, tmp_path, workers)
    finally:
        core.stop()


def _cancel_while_held(core: Core, db, tmp_path: Path, workers: Workers) -> None:
    marks = shared_dir()
    workers.start(
        core, tmp_path / "w", "w", CAIRN_WORKER_CLAIM_AHEAD_S=AHEAD_S, CAIRN_WORKER_SLOTS="1"
    )
    # The sidecar's first beat answered: with a minute between beats, none comes until
    # well after the start_at, so only the agent's check at the start can see the cancel.
    _serving(db, tmp_path / "w")
    held = _submit(core, _marking(marks, 4.0, db))
    wait_for(lambda: _claimed_ahead(db, held), timeout=30)
    with core.client() as alice:
        assert alice.post(f"/v1/tasks/{held}/cancel").status_code == 200
    after = _submit(core, _marking(marks, 0.0, db))
    wait_for(lambda: _state(db, after) == "succeeded", timeout=60, interval=0.1)
    assert not (marks / str(held)).exists()
    assert (marks / str(after)).exists()
    assert _state(db, held) == "cancelled"
    assert db.execute(
        "SELECT count(*), count(*) FILTER (WHERE outcome = 'cancelled' AND seen_at IS NULL)"
        " FROM core.attempts WHERE task_id = %s",
        (held,),
    ).fetchone() == (1, 1)


def test_an_agent_killed_while_holding_a_lease_leaves_its_task_to_another_attempt(
    core: Core, db, tmp_path: Path, workers: Workers
) -> None:
    """The agent and its sidecar killed (no last word): the reaper declares the worker
    dead, the held attempt is lost at no cost, and another worker runs the task."""
    marks = shared_dir()
    agent = workers.start(core, tmp_path / "w", "w", CAIRN_WORKER_CLAIM_AHEAD_S=AHEAD_S)
    _serving(db, tmp_path / "w")
    task = _submit(core, _marking(marks, 20.0, db))
    wait_for(lambda: _claimed_ahead(db, task), timeout=30)
    os.kill(agent.pid, signal.SIGSTOP)  # so it cannot start its sidecar again
    for child in children(agent.pid):
        os.kill(child.pid, signal.SIGKILL)  # the sidecar (and nothing else: it holds no process)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()

    def lost() -> object:
        return db.execute(
            "SELECT a.outcome, a.seen_at IS NULL, t.state, t.attempts FROM core.attempts a"
            " JOIN core.tasks t ON t.id = a.task_id WHERE a.task_id = %s",
            (task,),
        ).fetchall()

    assert wait_for(lambda: lost()[0][0] == "lost" and lost(), timeout=30) == [
        ("lost", True, "waiting", 0)
    ]
    assert not (marks / str(task)).exists()
    db.execute("UPDATE core.tasks SET run_at = now() - interval '1 second' WHERE id = %s", (task,))
    [again] = Agent(core, "w2").claim()
    assert again["task_id"] == task and again["attempt_number"] == 2
