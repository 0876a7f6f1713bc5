"""An agent that starts removes the cgroups a SIGKILLed agent left (``Cgroups.sweep``), as
root on cgroup v1: in every hierarchy, one it does not use itself (``devices``) too, and
never a live agent's. Each agent is a process of its own that joins the test's own cgroup
first, so Cairn's folders, and all the sweep sees, are under that cgroup only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker import cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made as root")

HIERARCHIES = ("memory", "cpu", "cpuacct", "pids", "devices")

# An agent's cgroup set-up, as ``Host.start`` does it: it joins the test's cgroup, finds
# its own folders (the devices hierarchy too if argv[2] says so), sweeps, makes a pooled
# slot's folder in each, says where, and waits (argv[3] "wait") or leaves.
AGENT = """
import json, os, sys, time
from pathlib import Path
from services.worker.cgroups import Cgroups
for procs in json.loads(sys.argv[1]):
    Path(procs).write_text(str(os.getpid()))
found, _ = Cgroups.detect(devices=sys.argv[2] == "devices")
found.sweep()
for base in found.bases.values():
    (base / "s1").mkdir(exist_ok=True)
print(json.dumps({name: str(base) for name, base in found.bases.items()}), flush=True)
if sys.argv[3] == "wait":
    time.sleep(60)
"""


@pytest.fixture
def own() -> Iterator[dict[str, Path]]:
    """A cgroup of the test's own in each v1 hierarchy mounted here (under the test
    process's); removed afterwards, with whatever is left under it."""
    mounts, paths = cgroups._mounts(devices=True), cgroups._own_paths()
    if not {"memory", "devices"} <= set(mounts) & set(paths):
        pytest.skip("no cgroup v1 memory and devices hierarchies here")
    name = f"cairn-sweep-test-{uuid.uuid4().hex[:12]}"
    folders = {
        h: mounts[h] / paths[h].lstrip("/") / name
        for h in HIERARCHIES
        if h in mounts and h in paths
    }
    for folder in folders.values():
        folder.mkdir(exist_ok=True)
    yield folders
    for folder in set(folders.values()):
        for left in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
            if left.is_dir():
                left.rmdir()
        folder.rmdir()


def _agent(own: dict[str, Path], devices: bool, wait: bool) -> tuple[subprocess.Popen, dict]:
    procs = json.dumps([str(folder / "cgroup.procs") for folder in set(own.values())])
    mode = ["devices" if devices else "-", "wait" if wait else "-"]
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, procs, *mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    with proc.stdout:
        said = json.loads(proc.stdout.readline())
    return proc, {name: Path(base) for name, base in said.items()}


def test_a_starting_agent_removes_a_killed_agents_cgroups_in_every_hierarchy_not_a_live_ones(
    own: dict[str, Path],
) -> None:
    live, live_bases = _agent(own, devices=True, wait=True)
    try:
        killed, killed_bases = _agent(own, devices=True, wait=True)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert "devices" in killed_bases and "devices" in live_bases
        assert all((base / "s1").is_dir() for base in killed_bases.values())  # left over
        starting, starting_bases = _agent(own, devices=False, wait=False)  # no devices
        assert starting.wait(timeout=30) == 0
        assert "devices" not in starting_bases
        assert not any(base.exists() for base in killed_bases.values())
        assert all((base / "s1").is_dir() for base in live_bases.values())
        assert all(base.is_relative_to(own[name]) for name, base in killed_bases.items())
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
