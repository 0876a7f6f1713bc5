"""The disk quota per attempt against a real root agent and a real core: an attempt's
home and /tmp are a tmpfs of its quota, a write past it fails with ENOSPC and the attempt
ends ``disk_exceeded`` in the database, and the outputs it wrote there reach core."""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path

import pytest

from tests.security.test_hostile_tasks import (  # noqa: F401 - fixtures
    Agent,
    agents,
    core,
    run,
    shell,
)


def test_a_task_past_its_disk_quota_ends_disk_exceeded_and_outputs_come_back(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
    db,
):
    agents.append(Agent(core, tmp_path / "w"))
    hog = shell(
        'stat -f -c "fs %T" "$HOME"; df -k /tmp | tail -1; '
        "dd if=/dev/zero of=/tmp/big bs=1M count=16",
        resources={"cpu": 1, "memory_mb": 128, "disk_mb": 2},
    )
    writer = shell(
        'echo \'{"rows": 7}\' > "$CAIRN_OUTPUTS"; df -k "$HOME" | tail -1',
        resources={"cpu": 1, "memory_mb": 128, "disk_mb": 3},
    )
    full = run(core, hog)
    wrote = run(core, writer)

    [attempt] = full["attempts_list"]
    assert full["state"] == "dead" and attempt["outcome"] == "disk_exceeded", full
    assert "2 MB" in attempt["error"] and "ENOSPC" in attempt["error"]
    assert "fs tmpfs" in full["log"] and " 2048 " in full["log"], full["log"]
    assert "No space left on device" in full["log"]
    assert db.execute(
        "SELECT outcome FROM core.attempts WHERE id = %s", (attempt["id"],)
    ).fetchone() == ("disk_exceeded",)
    [done] = wrote["attempts_list"]
    assert done["outcome"] == "succeeded" and done["outputs"] == {"rows": 7}, wrote
    assert " 3072 " in wrote["log"], wrote["log"]


def test_a_world_writable_folder_of_the_host_is_the_attempts_own_tmp(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
    db,
):
    """/run/lock is writable by every uid (1777) and here lies on the host's root file
    system: an attempt wrote there past its quota, onto the host's disk, and what it
    left stayed (for the next attempt given its uid to read). The attempt's own tmp is
    bound on it now, as on /tmp: within its quota, gone with it."""
    lock = Path("/run/lock")
    if not lock.is_dir() or not lock.stat().st_mode & stat.S_IWOTH:
        pytest.skip("no world-writable /run/lock on this host")
    name = f"cairn-quota-{uuid.uuid4().hex}"
    host_file = lock / name
    agents.append(Agent(core, tmp_path / "w"))
    hog = shell(
        f"dd if=/dev/zero of=/var/lock/{name} bs=1M count=16",
        resources={"cpu": 1, "memory_mb": 128, "disk_mb": 2},
    )
    try:
        full = run(core, hog)
        [attempt] = full["attempts_list"]
        assert not host_file.exists(), f"{host_file} was written on the host"
        assert full["state"] == "dead" and attempt["outcome"] == "disk_exceeded", full
        assert "No space left on device" in full["log"], full["log"]
    finally:
        host_file.unlink(missing_ok=True)  # this test's own file, without the fix


def test_any_world_writable_folder_of_the_host_is_the_attempts_own_tmp(
    core,  # noqa: F811
    agents,  # noqa: F811
    tmp_path,
):
    """A folder every uid may write in, anywhere on the host (here one this test makes
    under /run, 1777, as a package or an operator might): what an attempt left there
    stayed for the next attempt given its uid, outside its disk quota. The agent looks
    for such folders when it starts and binds the attempt's own tmp on each."""
    if not Path("/run").is_dir():
        pytest.skip("no /run on this host")
    drop = Path("/run") / f"cairn-drop-{uuid.uuid4().hex[:12]}"
    drop.mkdir(mode=0o700)
    try:
        drop.chmod(0o1777)
        # Its own uid locks' folder: a look of its own, not one another agent kept.
        agents.append(Agent(core, tmp_path / "w", CAIRN_WORKER_UID_LOCKS=str(tmp_path / "uids")))
        left = run(core, shell(f"echo left > {drop}/note && cat {drop}/note"))
        assert left["state"] == "succeeded" and "left" in left["log"], left
        assert list(drop.iterdir()) == [], "the attempt wrote in the host's folder"
        kept = json.loads((tmp_path / "uids" / "world-writable.json").read_text())
        assert str(drop) in kept["found"], kept
        # Gone since the agent looked: nothing to share there, and no attempt fails for it.
        drop.rmdir()
        after = run(core, shell(f"test ! -e {drop} && echo gone"))
        assert after["state"] == "succeeded" and "gone" in after["log"], after
    finally:
        if drop.exists():
            for leftover in drop.iterdir():  # this test's own files, without the fix
                leftover.unlink()
            drop.rmdir()
