"""Placement over real HTTP with a scripted worker: pending reasons, pool settings,
measured use and right-sizing."""

from __future__ import annotations

from contextlib import closing

import httpx
import pytest

from tests.support import Core, spec

pytestmark = pytest.mark.core(heartbeat_interval_s=0.2, placement_interval_s=0.1)


def _register(
    core: Core, cpu: float, memory_mb: int, queues=("default",)
) -> tuple[httpx.Client, int]:
    agent = core.client("w1", "worker")
    offer = {"hostname": "w1.test", "queues": list(queues), "cpu": cpu, "memory_mb": memory_mb}
    registered = agent.post("/v1/workers", json=offer).json()
    agent.headers["X-Cairn-Worker-Lease"] = registered["lease"]
    return agent, registered["worker"]["id"]


def _claim(agent: httpx.Client, worker: int, cpu: float, memory_mb: int) -> list[dict]:
    room = {"cpu": cpu, "memory_mb": memory_mb}
    return agent.post(f"/v1/workers/{worker}/claim", json=room).json()["attempts"]


def _reason(client: httpx.Client, task_id: int) -> str | None:
    return client.get(f"/v1/tasks/{task_id}").json()["pending_reason"]


def test_every_task_that_is_not_running_says_why(core: Core) -> None:
    agent, worker = _register(core, cpu=8, memory_mb=16384)
    with closing(agent), core.client() as alice, core.client("root", "admin") as admin:
        big = alice.post("/v1/tasks", json=spec(resources={"cpu": 6, "memory_mb": 512})).json()
        [running] = _claim(agent, worker, 8, 16384)
        assert running["task_id"] == big["id"] and _reason(alice, big["id"]) is None
        needs = alice.post("/v1/tasks", json=spec(resources={"cpu": 4, "memory_mb": 8192})).json()
        huge = alice.post("/v1/tasks", json=spec(resources={"cpu": 64, "memory_mb": 512})).json()
        gpu = alice.post("/v1/tasks", json=spec(queue="gpu")).json()
        later = alice.post("/v1/tasks", json=spec(run_at="2999-01-01T02:00:00Z")).json()
        admin.post("/v1/queues/held/pause")
        held = alice.post("/v1/tasks", json=spec(queue="held")).json()
        assert (
            _reason(alice, needs["id"]) == "needs 4 CPU / 8 GB, largest free slot 2 CPU / 15.5 GB"
        )
        assert _reason(alice, huge["id"]) == (
            "needs 64 CPU / 512 MB, larger than any worker (largest 8 CPU / 16 GB)"
        )
        assert _reason(alice, gpu["id"]) == "no live worker serves queue gpu"
        assert _reason(alice, later["id"]) == "scheduled for 2999-01-01 02:00:00 UTC"
        assert _reason(alice, held["id"]) == "queue paused"
        listed = {t["id"]: t["pending_reason"] for t in alice.get("/v1/tasks").json()["items"]}
    assert listed[gpu["id"]] == "no live worker serves queue gpu"
    assert listed[big["id"]] is None


def test_pool_settings_are_set_by_an_admin_and_checked(core: Core) -> None:
    with core.client("root", "admin") as admin, core.client() as alice:
        assert alice.patch("/v1/queues/batch", json={"overcommit": 2}).status_code == 403
        bad = admin.patch("/v1/queues/batch", json={"overcommit": 0.5})
        assert bad.status_code == 422
        assert bad.headers["content-type"].startswith("application/problem+json")
        assert "overcommit" in bad.text
        assert admin.patch("/v1/queues/batch", json={"defer_above": 1.5}).status_code == 422
        assert admin.patch("/v1/queues/batch", json={"spare": 1}).status_code == 422
        done = admin.patch("/v1/queues/batch", json={"overcommit": 3, "defer_above": 0.9}).json()
        assert (done["overcommit"], done["defer_above"]) == (3, 0.9)
        kept = admin.patch("/v1/queues/batch", json={"defer_above": None}).json()
    assert (kept["overcommit"], kept["defer_above"]) == (3, 0.8)


def test_measured_use_sizes_the_next_preemptible_charge_and_the_rightsizing(core: Core) -> None:
    agent, worker = _register(core, cpu=8, memory_mb=16384)
    body = spec(name="nightly", preemptible=True, resources={"cpu": 2, "memory_mb": 3072})
    with closing(agent), core.client() as alice, core.client("bob") as bob:
        alice.post("/v1/tasks", json=body)
        [first] = _claim(agent, worker, 8, 16384)
        assert first["charge"] == {"cpu": 2, "memory_mb": 3072}  # no history: the request
        report = {"outcome": "succeeded", "exit_code": 0, "peak_memory_mb": 1000, "cpu_seconds": 0}
        agent.post(f"/v1/workers/{worker}/attempts/{first['attempt_id']}/report", json=report)
        alice.post("/v1/tasks", json=body)
        [second] = _claim(agent, worker, 8, 16384)
        # Measured: 1000 MB; CPU below the floor of a tenth of the request.
        assert second["charge"] == {"cpu": 0.2, "memory_mb": 1000}
        [row] = alice.get("/v1/usage").json()["items"]
        assert bob.get("/v1/usage").json()["items"] == []
        assert bob.get("/v1/usage", params={"owner": "alice"}).json()["items"] == []
    assert (row["owner"], row["name"], row["attempts"]) == ("alice", "nightly", 1)
    assert (row["requested_memory_mb"], row["p95_memory_mb"]) == (3072, 1000)
    assert row["suggested_memory_mb"] == 1216 and row["suggested_cpu"] == 0.1
