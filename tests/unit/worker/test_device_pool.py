"""The agent's pool of devices (``services.worker.devices``) with real lock files and real
processes: each index goes to one attempt at a time, across agents sharing the lock
folder; an agent that dies frees its locks, but not an index whose attempt still runs,
until that attempt's processes are gone; the attempt's environment names its devices."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from libs.common.settings import parse_devices
from services.worker.devices import DevicePool, DevicesBusy, Held, denied
from services.worker.settings import WorkerSettings
from tests.support import wait_for


def test_each_index_is_held_by_one_attempt_and_comes_back(tmp_path: Path) -> None:
    pool = DevicePool({"gpu": 2, "fpga": 1}, tmp_path)
    first = pool.take({"gpu": 1})
    both = pool.take({"gpu": 1, "fpga": 1})
    assert first.indexes == {"gpu": [0]} and both.indexes == {"fpga": [0], "gpu": [1]}
    with pytest.raises(DevicesBusy):
        pool.take({"gpu": 1})
    pool.give_back(first)
    assert pool.take({"gpu": 1}).indexes == {"gpu": [0]}


def test_a_request_that_cannot_be_met_holds_nothing(tmp_path: Path) -> None:
    pool = DevicePool({"gpu": 2}, tmp_path)
    with pytest.raises(DevicesBusy):
        pool.take({"gpu": 3})
    assert pool.take({"gpu": 2}).indexes == {"gpu": [0, 1]}


def test_two_agents_sharing_the_lock_folder_never_hand_out_one_index_twice(
    tmp_path: Path,
) -> None:
    one, other = DevicePool({"gpu": 2}, tmp_path), DevicePool({"gpu": 2}, tmp_path)
    assert one.take({"gpu": 1}).indexes == {"gpu": [0]}
    assert other.take({"gpu": 1}).indexes == {"gpu": [1]}
    with pytest.raises(DevicesBusy):
        other.take({"gpu": 1})


def _agent_takes_and_dies(locks: Path, marker: Path) -> subprocess.Popen[bytes]:
    """A process that, as an agent does, takes gpu 0 for an attempt (a child in a process
    group of its own) and dies, leaving the attempt running."""
    script = f"""
import os, subprocess, sys
from pathlib import Path
from services.worker.devices import DevicePool
pool = DevicePool({{"gpu": 2}}, Path({str(locks)!r}))
held = pool.take({{"gpu": 1}})
attempt = subprocess.Popen(["sleep", "60"], start_new_session=True)
pool.started(held, attempt.pid)
Path({str(marker)!r}).write_text(str(attempt.pid))
os._exit(0)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    return subprocess.Popen([sys.executable, "-c", script], env=env)


def test_an_index_whose_attempt_outlived_its_agent_stays_taken_until_it_ends(
    tmp_path: Path,
) -> None:
    locks, marker = tmp_path / "locks", tmp_path / "attempt.pid"
    agent = _agent_takes_and_dies(locks, marker)
    assert agent.wait(timeout=30) == 0
    attempt = int(marker.read_text())
    try:
        restarted = DevicePool({"gpu": 2}, locks)  # the next agent on the host
        assert restarted.take({"gpu": 1}).indexes == {"gpu": [1]}  # not 0: still in use
        with pytest.raises(DevicesBusy):
            restarted.take({"gpu": 1})
    finally:
        os.killpg(attempt, 9)
    # Once it is gone (a zombie, where nothing reaps it, holds nothing), it is free again.
    freed = wait_for(lambda: _taken(restarted), timeout=10)
    assert freed.indexes == {"gpu": [0]}


def _taken(pool: DevicePool) -> Held | None:
    try:
        return pool.take({"gpu": 1})
    except DevicesBusy:
        return None


def test_the_environment_names_the_devices_and_hides_gpus_from_others(tmp_path: Path) -> None:
    pool = DevicePool({"gpu": 4, "fpga": 1}, tmp_path)
    held = pool.take({"gpu": 2, "fpga": 1})
    assert held.env(pool.offered) == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "CAIRN_DEVICES_GPU": "0,1",
        "CAIRN_DEVICES_FPGA": "0",
    }
    assert pool.take({}).env(pool.offered) == {"CUDA_VISIBLE_DEVICES": ""}
    assert pool.take({}).env({"fpga": 1}) == {}


def test_the_worker_setting_is_parsed_and_bad_values_refused() -> None:
    assert parse_devices("gpu=2, fpga=1,tpu=0") == {"gpu": 2, "fpga": 1}
    assert WorkerSettings(worker_devices="gpu=2").devices == {"gpu": 2}
    for bad in ("gpu=two", "GPU=1", "gpu=100000", "gpu-x=1"):
        with pytest.raises(ValueError, match=r"(?i)worker_devices"):
            WorkerSettings(worker_devices=bad)


def test_device_nodes_must_be_device_nodes_of_offered_devices(tmp_path: Path) -> None:
    node = tmp_path / "gpu0"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    ok = WorkerSettings(worker_devices="gpu=2", worker_device_nodes=f"gpu:0={node}")
    assert ok.device_nodes == {("gpu", 0): str(node)}
    assert denied(ok.device_nodes, {"gpu": [1]}) == ["c 1:7 rwm"]
    assert denied(ok.device_nodes, {"gpu": [0]}) == []
    plain = tmp_path / "plain"
    plain.write_text("")
    for devices, nodes, why in (
        ("gpu=1", f"gpu:1={node}", "does not offer"),
        ("gpu=1", f"fpga:0={node}", "does not offer"),
        ("gpu=1", f"gpu:0={plain}", "not a device node"),
        ("gpu=1", "gpu:0=relative", "NAME:INDEX=/dev/PATH"),
    ):
        with pytest.raises(ValueError, match=why):
            WorkerSettings(worker_devices=devices, worker_device_nodes=nodes)
