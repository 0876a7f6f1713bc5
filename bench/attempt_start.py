"""What isolation costs per attempt start: prepare (uid, folders, verified copy of the
artifact, cgroup) + spawn + exit + clean-up of ``/bin/true``, one attempt after another,
through the agent's own code (``services.worker.host``), without core or HTTP.

Run as root:  .venv/bin/python bench/attempt_start.py [-n 200]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from libs.common.models import Artifact, Assignment, Resources
from services.worker.artifacts import ArtifactCache
from services.worker.executor import start_attempt
from services.worker.host import Host
from services.worker.settings import WorkerSettings

TRUE = Path("/bin/true")
SHA = hashlib.sha256(TRUE.read_bytes()).hexdigest()


def _assignment(attempt_id: int) -> Assignment:
    return Assignment(
        attempt_id=attempt_id,
        attempt_number=1,
        task_id=attempt_id,
        kind="task",
        artifact=Artifact(uri=f"file://{TRUE}", sha256=SHA),
        args=[],
        env={},
        input_path=None,
        output_path=None,
        resources=Resources(cpu=0.5, memory_mb=64),
        timeout_s=None,
    )


async def _one(host: Host, cache: ArtifactCache, attempt_id: int) -> tuple[float, float]:
    began = time.perf_counter()
    prepared = await host.prepare(_assignment(attempt_id), cache)
    spawned = time.perf_counter()
    handle = await start_attempt(prepared.spec)
    result = await handle.wait()
    assert result.outcome == "succeeded", result
    await host.stop_leftovers(prepared)
    await host.release(prepared)
    return spawned - began, time.perf_counter() - began


async def _case(name: str, n: int, root: Path, isolation: str, cgroups: bool, mounts: bool) -> None:
    home = root / name
    settings = WorkerSettings(
        home=home,
        worker_isolation=isolation,  # type: ignore[arg-type]
        worker_run_dir=root / f"{name}-run",
        worker_uid_locks=root / f"{name}-uids",
        worker_uids="27000-27999",
    )
    host = Host(settings, home / "logs")
    host.start()
    if not cgroups:
        host.cgroups = None
    if not mounts:
        host.private_tmp = False
    cache = ArtifactCache(home / "artifacts")
    prepare, total = [], []
    for i in range(1, n + 1):
        p, t = await _one(host, cache, i)
        prepare.append(p * 1000)
        total.append(t * 1000)
    await host.close()
    q = statistics.quantiles(total, n=100)
    print(
        f"{name:<28} prepare p50 {statistics.median(prepare):6.2f} ms   "
        f"start..exit..clean p50 {statistics.median(total):6.2f} ms  p99 {q[98]:6.2f} ms"
    )


async def main(n: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir="/var/tmp"))
    root.chmod(0o711)
    try:
        await _case("none (agent's uid)", n, root, "none", cgroups=False, mounts=False)
        if os.geteuid() == 0:
            await _case("uid", n, root, "user", cgroups=False, mounts=False)
            await _case("uid + mount ns", n, root, "user", cgroups=False, mounts=True)
            await _case("uid + mount ns + cgroup", n, root, "user", cgroups=True, mounts=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=200)
    asyncio.run(main(parser.parse_args().n))
