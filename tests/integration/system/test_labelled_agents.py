"""Placement by label with real worker agents: two agents registered with the labels of
their settings (``CAIRN_WORKER_LABELS``); work that requires a label runs only on the
agent that has it, and work no agent matches waits, saying which selector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Core, Workers, shell_spec, start_core, wait_for


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.2)
    yield server
    server.stop()


def test_work_that_requires_a_label_runs_only_on_the_agent_that_has_it(
    core: Core, workers: Workers, tmp_path: Path
) -> None:
    workers.start(core, tmp_path / "ssd", "ssd", CAIRN_WORKER_LABELS="disk=ssd,zone=a")
    workers.start(core, tmp_path / "hdd", "hdd", CAIRN_WORKER_LABELS="disk=hdd,zone=b")
    with core.client("root", "admin") as admin, core.client() as alice:
        fleet = wait_for(lambda: len(w := admin.get("/v1/workers").json()["items"]) == 2 and w)
        ids = {w["labels"]["disk"]: w["id"] for w in fleet}
        ssd = shell_spec("exit 0", placement={"required": ["disk=ssd"]})
        tasks = [alice.post("/v1/tasks", json=ssd).json()["id"] for _ in range(2)]
        nvme = shell_spec("exit 0", placement={"required": ["disk in (nvme)"]})
        stuck = alice.post("/v1/tasks", json=nvme).json()["id"]

        def done() -> bool:
            states = [alice.get(f"/v1/tasks/{t}").json()["state"] for t in tasks]
            return states == ["succeeded"] * 2

        wait_for(done, timeout=20)
        for task in tasks:
            [attempt] = alice.get(f"/v1/tasks/{task}/attempts").json()["items"]
            assert attempt["worker_id"] == ids["ssd"]
        waiting = alice.get(f"/v1/tasks/{stuck}").json()
        assert waiting["state"] == "waiting"
        assert waiting["pending_reason"] == "no live worker matches disk in (nvme) (queue default)"
        assert waiting["attempts"] == 0
