"""The disk quota per attempt against a real root agent and a real core: an attempt's
home and /tmp are a tmpfs of its quota, a write past it fails with ENOSPC and the attempt
ends ``disk_exceeded`` in the database, and the outputs it wrote there reach core."""

from __future__ import annotations

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
