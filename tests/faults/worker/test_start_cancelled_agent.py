"""The real agent's attempt, cancelled once its start was sent to its spawn helper and
before the reply (its helper stopped in between, on a one-slot cgroup v1 pool, as root):
the process that start runs is killed as its reply comes, and the attempt keeps its
slot and uid (its release waits, and the agent counts no room free), and its cgroup and
uid stay on the board its sidecar reads, until that process's exit record; core was told
it started, and nothing else of it ran."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from libs.common.client import CoreClient
from libs.common.models import WORKER_LEASE_HEADER, Assignment
from services.worker.agent import Agent
from services.worker.artifacts import ArtifactCache
from services.worker.executor import AttemptSpec, RunningAttempt
from services.worker.host import Host, Prepared
from services.worker.settings import WorkerSettings
from tests.integration.core.test_dispatch import Agent as Registered
from tests.integration.core.test_dispatch import _close_agents  # noqa: F401 - closes them
from tests.support import Core, isolation_env, shell_spec
from tests.support.procs import of_uid
from tests.unit.worker.test_spawn_serving import _turns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="attempts run as uids of their own as root"),
]


def _claimed(core: Core, body: dict[str, Any]) -> tuple[int, int, str, Assignment]:
    """Submit ``body`` and claim it as a registered worker: the task's id, the worker's,
    its lease and the assignment."""
    with core.client() as alice:
        task = alice.post("/v1/tasks", json=body).raise_for_status().json()
    worker = Registered(core, "agent")  # its token: core.tokens["agent"]
    [raw] = worker.claim(most=1)
    lease = worker.http.headers[WORKER_LEASE_HEADER]
    return int(task["id"]), worker.id, lease, Assignment.model_validate(raw)


def test_an_attempt_cancelled_during_its_start_holds_its_slot_and_uid_until_its_process_ended(
    core: Core, db: Any, tmp_path: Path
) -> None:
    env = isolation_env()
    marks = Path(env["CAIRN_WORKER_RUN_DIR"]) / "marks"
    marks.mkdir(mode=0o777)
    marks.chmod(0o777)
    body = shell_spec(f"echo $$ >> {marks}/ran; exec sleep 30", resources={"memory_mb": 64})
    task_id, worker_id, lease, assignment = _claimed(core, body)
    settings = WorkerSettings(
        home=tmp_path / "worker",
        url=core.url,
        worker_isolation="user",
        worker_run_dir=Path(env["CAIRN_WORKER_RUN_DIR"]),
        worker_uid_locks=Path(env["CAIRN_WORKER_UID_LOCKS"]),
        worker_uids=env["CAIRN_WORKER_UIDS"],
        worker_slots=1,
    )
    host = Host(settings, settings.home / "logs")
    host.start()
    if host.slots is None:
        pytest.skip("no cgroup v1 hierarchy to pool here")
    held: list[Prepared] = []
    launch = host.launch

    async def stopped_first(
        prepared: Prepared, cache: ArtifactCache, spec: AttemptSpec | None = None
    ) -> RunningAttempt:
        assert prepared.slot is not None
        os.kill(prepared.slot.helper.pid, signal.SIGSTOP)  # it reads nothing meanwhile
        held.append(prepared)
        return await launch(prepared, cache, spec)

    host.launch = stopped_first  # type: ignore[method-assign]

    async def scenario() -> None:
        try:
            async with CoreClient(core.url, core.tokens["agent"]) as client:
                client.use_lease(lease)
                agent = Agent(settings, client, core.tokens["agent"], host)
                agent.worker_id = worker_id
                attempt = asyncio.create_task(agent._attempt(assignment))
                for _ in range(1000):  # until its start is sent (10 s at most)
                    await asyncio.sleep(0.01)
                    if held and held[0].slot and held[0].slot.helper._replies:
                        break
                prepared = held[0]
                assert prepared.slot is not None and prepared.identity is not None
                assert prepared.slot.helper._replies, "its start was never sent"
                helper, uid = prepared.slot.helper, prepared.identity.uid
                try:
                    attempt.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await attempt
                    await asyncio.sleep(0.2)
                    releasing = set(agent.releasing)
                    unsettled = releasing and not any(task.done() for task in releasing)
                    assert unsettled, "released before its start was settled"
                    assert agent._room()[2] == 0  # its slot is not offered to core again
                    # Still on the board: were the agent to die now, its sidecar kills
                    # what that start runs, which its helper may yet read and start.
                    await _turns(2)
                    board = agent.board.read()
                    assert board["uids"].get(str(assignment.attempt_id)) == uid, board
                    assert str(assignment.attempt_id) in board["cgroups"], board
                    # the board's attempts are the agent's
                    assert set(board["attempts"]) == {str(a) for a in agent.running}, board
                finally:
                    os.kill(helper.pid, signal.SIGCONT)
                done, _ = await asyncio.wait(releasing, timeout=10)
                assert done == releasing
                await _turns(2)
                assert agent._room()[2] == 1 and of_uid(uid) == []
                board = agent.board.read()
                assert not board["uids"] and not board["cgroups"], board
                assert set(board["attempts"]) == {str(a) for a in agent.running}, board
        finally:
            await host.close()

    asyncio.run(scenario())
    # It may have run as far as its first line before the kill, never further, and once.
    ran = (marks / "ran").read_text().split() if (marks / "ran").exists() else []
    assert len(ran) <= 1
    for pid in ran:
        assert not Path(f"/proc/{pid}").exists()
    [(state, attempts)] = db.execute(
        "SELECT t.state, count(a.id) FROM core.tasks t LEFT JOIN core.attempts a"
        " ON a.task_id = t.id WHERE t.id = %s GROUP BY t.state",
        (task_id,),
    ).fetchall()
    assert (state, attempts) == ("running", 1)  # core was told it started: not "never ran"
