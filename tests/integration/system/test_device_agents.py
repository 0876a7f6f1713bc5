"""Countable devices with a real worker agent (docs/placement.md, "Devices"): an agent
offering two GPUs (``CAIRN_WORKER_DEVICES=gpu=2``) runs two one-GPU tasks at once, each
seeing its own device (``CUDA_VISIBLE_DEVICES``, ``CAIRN_DEVICES_GPU``); a third waits,
its pending reason naming gpu, and takes the index freed; work without devices sees
none; with device nodes configured (``CAIRN_WORKER_DEVICE_NODES``), cgroup v1's devices
controller lets each attempt open only its own; the month's usage holds the
device-seconds the attempts' rows add up to."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from tests.integration.system.test_metrics import scrape, value
from tests.support import Core, Workers, shared_dir, shell_spec, start_core, wait_for


@pytest.fixture
def core(db_url: str, tmp_path: Path) -> Iterator[Core]:
    server = start_core(db_url, tmp_path / "core", heartbeat_interval_s=0.2, usage_interval_s=0.1)
    yield server
    server.stop()


def _seen(marks: Path, task: int) -> str | None:
    path = marks / str(task)
    text = path.read_text() if path.exists() else ""
    return text.strip() if text.endswith("\n") else None


def test_two_gpu_tasks_run_at_once_each_on_its_own_device_and_a_third_waits_naming_gpu(
    core: Core, workers: Workers, tmp_path: Path, db: psycopg.Connection[tuple[object, ...]]
) -> None:
    marks = shared_dir()
    # Stand-in device nodes in the test's own folder (the host has no GPU): copies of
    # /dev/zero and /dev/full as gpu 0 and gpu 1 (the devices cgroup decides by number;
    # neither is one that the shell or the spawn helper opens).
    for index, minor in ((0, 5), (1, 7)):
        node = marks / f"gpu{index}"
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        node.chmod(0o666)
    nodes = f"gpu:0={marks}/gpu0,gpu:1={marks}/gpu1"
    workers.start(
        core, tmp_path / "gpu", "gpu", CAIRN_WORKER_DEVICES="gpu=2", CAIRN_WORKER_DEVICE_NODES=nodes
    )
    # Each attempt says which GPU its environment names and which nodes it can open.
    script = (
        f'o=""; for i in 0 1; do if (: < {marks}/gpu$i) 2>/dev/null; then o="$o $i"; fi; done; '
        f'echo "[$CUDA_VISIBLE_DEVICES] [$CAIRN_DEVICES_GPU] [opens$o]" > {marks}/$CAIRN_TASK_ID; '
        f"while [ ! -e {marks}/go ]; do sleep 0.05; done"
    )
    small = {"cpu": 0.5, "memory_mb": 64}
    gpu = shell_spec(script, resources={**small, "devices": {"gpu": 1}})
    with core.client("root", "admin") as admin, core.client() as alice:
        [worker] = wait_for(lambda: admin.get("/v1/workers").json()["items"])
        assert worker["devices"] == {"gpu": 2}
        first, second = (alice.post("/v1/tasks", json=gpu).json()["id"] for _ in range(2))
        wait_for(lambda: _seen(marks, first) and _seen(marks, second), timeout=30)
        third = alice.post("/v1/tasks", json=gpu).json()["id"]
        plain = alice.post("/v1/tasks", json=shell_spec(script, resources=small)).json()["id"]
        wait_for(lambda: _seen(marks, plain), timeout=30)

        seen = {_seen(marks, first), _seen(marks, second)}
        # each its own device, as CUDA and Cairn say, and only its own node opens
        assert seen == {"[0] [0] [opens 0]", "[1] [1] [opens 1]"}
        assert _seen(marks, plain) == "[] [] [opens]"  # no device: CUDA sees none
        waiting = alice.get(f"/v1/tasks/{third}").json()
        assert waiting["state"] == "waiting"
        assert waiting["pending_reason"] == (
            "needs 0.5 CPU / 64 MB / 1 gpu, largest free slot 2.5 CPU / 7.81 GB / 0 gpu "
            "(short of gpu)"
        )
        busy = admin.get("/v1/workers").json()["items"][0]
        assert busy["used_devices"] == {"gpu": 2}
        assert _seen(marks, third) is None

        (marks / "go").touch()
        ids = (first, second, third, plain)
        wait_for(
            lambda: all(alice.get(f"/v1/tasks/{t}").json()["state"] == "succeeded" for t in ids),
            timeout=10,
        )
        assert _seen(marks, third) in {"[0] [0] [opens 0]", "[1] [1] [opens 1]"}
        [attempt] = alice.get(f"/v1/tasks/{third}/attempts").json()["items"]
        assert attempt["charge_devices"] == {"gpu": 1}

        [(held,)] = db.execute(
            "SELECT sum(EXTRACT(EPOCH FROM a.ended_at - a.started_at)"
            " * (a.charge_devices->>'gpu')::float8)"
            " FROM core.attempts a WHERE a.charge_devices IS NOT NULL"
        ).fetchall()
        month = datetime.now(UTC).strftime("%Y-%m")

        def accounted() -> dict[str, float] | None:
            answer = alice.get("/v1/usage/accounts", params={"month": month, "by": "queue"})
            [row] = answer.json()["items"] or [None]
            return row["device_s"] if row and row["attempts"] == 4 else None

        assert wait_for(accounted, timeout=20) == {"gpu": round(float(held), 3)}  # type: ignore[arg-type]
        samples = scrape(core.url)
        gauge = value(samples, "cairn_usage_device_seconds", queue="default", device="gpu")
        assert round(gauge, 3) == round(float(held), 3)  # type: ignore[arg-type]
