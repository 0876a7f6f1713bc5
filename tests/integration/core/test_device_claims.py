"""Countable devices over real HTTP and the real claim SQL (docs/placement.md, "Devices"):
a worker leases gpu work only while it has the GPUs free, whatever room it says it has;
an owner's (and a team's) gpu quota holds the next gpu task with a reason; right-sizing
shows the devices asked for; bad device names and counts are 422s naming the field; the
CLI submits, shows and sets them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cairn.cli import app
from tests.integration.core.test_bad_input import problem
from tests.integration.system.test_metrics import scrape, value
from tests.support import Core, cli_as, register_worker, spec

ROOM = {"cpu": 64, "memory_mb": 65536, "max": 16}
GPU = {"cpu": 1, "memory_mb": 256, "devices": {"gpu": 1}}


def _claim(http: Any, worker: int) -> list[dict[str, Any]]:
    answer = http.post(f"/v1/workers/{worker}/claim", json=ROOM)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["attempts"])


def _offer(devices: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "hostname": "h",
        "queues": ["default"],
        "cpu": 64,
        "memory_mb": 65536,
        **({"devices": devices} if devices else {}),
    }


def test_a_worker_leases_gpu_work_only_onto_free_gpus(
    core: Core,
    db: psycopg.Connection[tuple[object, ...]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    with (
        core.client("agent-gpu", "worker") as gpu_http,
        core.client("agent-cpu", "worker") as cpu_http,
        core.client() as alice,
    ):
        gpu_worker = register_worker(gpu_http, _offer({"gpu": 2}))
        cpu_worker = register_worker(cpu_http, _offer())
        ids = [alice.post("/v1/tasks", json=spec(resources=GPU)).json()["id"] for _ in range(2)]
        cli = cli_as(core, monkeypatch, tmp_path)  # the third through ``cairn submit``
        submitted = cli.invoke(
            app,
            ["--json", "submit", "t", "--artifact", "file:///bin/true", "--sha256", "0" * 64,
             "--cpu", "1", "--memory-mb", "256", "--devices", "gpu=1"],
        )  # fmt: skip
        assert submitted.exit_code == 0, submitted.output
        ids.append(json.loads(submitted.output)["id"])
        bad = cli.invoke(app, ["submit", "t", "--artifact", "file:///bin/true", "--devices", "x"])
        assert bad.exit_code != 0 and "--devices" in bad.output
        assert _claim(cpu_http, cpu_worker) == []  # no GPU: it takes none of them
        leased = _claim(gpu_http, gpu_worker)
        assert [a["task_id"] for a in leased] == ids[:2]
        assert [a["charge"]["devices"] for a in leased] == [{"gpu": 1}] * 2
        assert [a["resources"]["devices"] for a in leased] == [{"gpu": 1}] * 2
        assert _claim(gpu_http, gpu_worker) == []  # both GPUs held
        stored = db.execute(
            "SELECT charge_devices FROM core.attempts WHERE worker_id = %s ORDER BY id",
            [gpu_worker],
        ).fetchall()
        assert stored == [({"gpu": 1},), ({"gpu": 1},)]
        waiting = alice.get(f"/v1/tasks/{ids[2]}").json()
        assert waiting["resources"]["devices"] == {"gpu": 1}
        assert "0 gpu (short of gpu)" in waiting["pending_reason"]
        shown = cli.invoke(app, ["get", str(ids[2])])
        assert shown.exit_code == 0 and "gpu 1" in shown.output and "short of gpu" in shown.output
        with core.client("root", "admin") as admin:
            fleet = admin.get("/v1/workers").json()["items"]
        [worker] = [w for w in fleet if w["id"] == gpu_worker]
        assert worker["devices"] == {"gpu": 2} and worker["used_devices"] == {"gpu": 2}
        fleet_cli = cli_as(core, monkeypatch, tmp_path, "root", "admin")
        listed = fleet_cli.invoke(app, ["workers"])
        assert listed.exit_code == 0 and "gpu 2/2" in listed.output

        report = {"outcome": "succeeded", "exit_code": 0, "cpu_seconds": 1, "peak_memory_mb": 9}
        first = leased[0]["attempt_id"]
        answer = gpu_http.post(f"/v1/workers/{gpu_worker}/attempts/{first}/report", json=report)
        assert answer.status_code == 200, answer.text
        assert [a["task_id"] for a in _claim(gpu_http, gpu_worker)] == ids[2:]

        [row] = alice.get("/v1/usage").json()["items"]
        assert row["requested_devices"] == {"gpu": 1.0}


def test_an_owners_gpu_quota_holds_the_next_gpu_task(
    core: Core, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with (
        core.client("root", "admin") as admin,
        core.client("agent", "worker") as http,
        core.client() as alice,
    ):
        cli = cli_as(core, monkeypatch, tmp_path, "root", "admin")
        shown = cli.invoke(app, ["quota", "alice", "--devices", "gpu=1", "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)[0]["quota"]["max_devices"] == {"gpu": 1}
        refused = cli.invoke(app, ["quota", "alice", "--devices", "gpu=one"])
        assert refused.exit_code != 0 and "--devices" in refused.output
        worker = register_worker(http, _offer({"gpu": 4}))
        ids = [alice.post("/v1/tasks", json=spec(resources=GPU)).json()["id"] for _ in range(2)]
        plain = alice.post("/v1/tasks", json=spec()).json()["id"]
        assert sorted(a["task_id"] for a in _claim(http, worker)) == [ids[0], plain]
        held = alice.get(f"/v1/tasks/{ids[1]}").json()
        assert held["pending_reason"] == "owner at quota (gpu 1/1)"
        usage = admin.get("/v1/owners/alice/usage").json()
        assert usage["running"]["devices"] == {"gpu": 1} and usage["at_quota"] == ["gpu"]
        samples = scrape(core.url)
        assert value(samples, "cairn_owners_at_quota", quota="devices") == 1
        table = cli.invoke(app, ["quota", "alice"])
        assert table.exit_code == 0 and "gpu 1/1" in table.output

        # A team's device quota bounds the sum over its members' team tasks.
        assert admin.post("/v1/teams", json={"name": "ml"}).status_code == 201
        for member in ("bob", "carol"):
            assert admin.put(f"/v1/teams/ml/members/{member}").status_code == 200
        admin.patch("/v1/teams/ml/share", json={"max_devices": {"gpu": 1}}).raise_for_status()
        with core.client("bob") as bob, core.client("carol") as carol:
            team_gpu = spec(resources=GPU, team="ml")
            mine = bob.post("/v1/tasks", json=team_gpu).json()["id"]
            theirs = carol.post("/v1/tasks", json=team_gpu).json()["id"]
            assert [a["task_id"] for a in _claim(http, worker)] == [mine]
            held = carol.get(f"/v1/tasks/{theirs}").json()
            assert held["pending_reason"] == "team ml at quota (gpu 1/1)"


BAD = [
    ({"GPU": 1}, ".GPU"),
    ({"gpu": 0}, ".gpu"),
    ({"gpu": 100_000}, ".gpu"),
    ({f"d{i}": 1 for i in range(9)}, ""),
    ({"gpu": "two"}, ".gpu"),
]


def test_bad_devices_are_refused_naming_the_field(core: Core) -> None:
    with (
        core.client() as alice,
        core.client("root", "admin") as admin,
        core.client("agent", "worker") as http,
    ):
        for devices, where in BAD:
            bad = spec(resources={"devices": devices})
            problem(alice.post("/v1/tasks", json=bad), 422, f"body.resources.devices{where}")
            problem(http.post("/v1/workers", json=_offer(devices)), 422, f"body.devices{where}")
            quota = {"max_devices": devices}
            answer = admin.patch("/v1/owners/bob/share", json=quota)
            problem(answer, 422, f"body.max_devices{where}")
