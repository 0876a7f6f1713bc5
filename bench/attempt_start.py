"""What isolation costs per attempt start: prepare (uid, folders, verified copy of the
artifact, cgroup) + spawn + exit + clean-up of ``/bin/true``, one attempt after another,
through the agent's own code (``services.worker.host``), without core or HTTP.

Each configuration runs twice in the same run: ``before`` forks the agent for every
attempt (``preexec_fn``, a fresh cgroup each, ``/bin/sh`` to clean up a uid) and ``after``
is the fast path (the resident spawn helper, pooled cgroups on v1). Rounds alternate
between the two, so load on the shared machine hits both alike.

Run as root:  .venv/bin/python bench/attempt_start.py [-n 200] [--rounds 2] [--cpu 0.5]
                   [--shell]

``--cpu`` is what each attempt asks (its cgroup's CPU quota); ``--shell`` runs
``/bin/bash -c true`` instead of ``/bin/true``: a start that needs a few milliseconds of
CPU, which a small quota throttles.
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
from dataclasses import dataclass
from pathlib import Path

from libs.common.models import Artifact, Assignment, Resources
from services.worker.artifacts import ArtifactCache
from services.worker.cgroups import Cgroups
from services.worker.executor import start_attempt
from services.worker.host import Host
from services.worker.settings import WorkerSettings

TRUE = Path("/bin/true")
BASH = Path("/bin/bash")


@dataclass
class Program:
    """What every attempt runs, and the CPU it asks."""

    path: Path = TRUE
    args: tuple[str, ...] = ()
    cpu: float = 0.5


PROGRAM = Program()
DETECT = Cgroups.detect


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assignment(attempt_id: int) -> Assignment:
    path = PROGRAM.path
    return Assignment(
        attempt_id=attempt_id,
        attempt_number=1,
        task_id=attempt_id,
        kind="task",
        artifact=Artifact(uri=f"file://{path}", sha256=_sha(path)),
        args=list(PROGRAM.args),
        env={},
        input_path=None,
        output_path=None,
        resources=Resources(cpu=PROGRAM.cpu, memory_mb=64),
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


async def _case(
    name: str, n: int, root: Path, isolation: str, cgroups: bool, mounts: bool, fast: bool
) -> tuple[list[float], list[float]]:
    home = root / f"{name}-{fast}-{os.urandom(4).hex()}"
    settings = WorkerSettings(
        home=home,
        worker_isolation=isolation,  # type: ignore[arg-type]
        worker_run_dir=home / "run",
        worker_uid_locks=root / "uids",
        worker_uids="27000-27999",
    )
    host = Host(settings, home / "logs", fast=fast)
    if not cgroups:
        Cgroups.detect = classmethod(lambda cls: (None, "off"))  # type: ignore[method-assign,assignment]
    try:
        host.start()
    finally:
        Cgroups.detect = DETECT  # type: ignore[method-assign]
    if not mounts:
        host.private_tmp = False
    cache = ArtifactCache(home / "artifacts")
    prepare, total = [], []
    for i in range(1, n + 1):
        p, t = await _one(host, cache, i)
        prepare.append(p * 1000)
        total.append(t * 1000)
    await host.close()
    return prepare, total


CASES = [
    ("none (agent's uid)", "none", False, False),
    ("uid", "user", False, False),
    ("uid + mount ns", "user", False, True),
    ("uid + mount ns + cgroup", "user", True, True),
]


async def main(n: int, rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir="/var/tmp"))
    root.chmod(0o711)
    print(
        f"load average {os.getloadavg()[0]:.2f} at start; n={n} per case and round; "
        f"{PROGRAM.path} {' '.join(PROGRAM.args)} asking {PROGRAM.cpu} CPU"
    )
    cases = CASES if os.geteuid() == 0 else CASES[:1]
    samples: dict[tuple[str, bool], tuple[list[float], list[float]]] = {}
    try:
        for _ in range(rounds):
            for name, isolation, cgroups, mounts in cases:
                for fast in (False, True):
                    got = await _case(name, n, root, isolation, cgroups, mounts, fast)
                    prepare, total = samples.setdefault((name, fast), ([], []))
                    prepare += got[0]
                    total += got[1]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'configuration':<26} {'path':<7} {'prepare p50':>11} {'whole p50':>10} {'p99':>8}")
    for name, *_ in cases:
        for fast in (False, True):
            prepare, total = samples[(name, fast)]
            q = statistics.quantiles(total, n=100)
            print(
                f"{name:<26} {'after' if fast else 'before':<7} "
                f"{statistics.median(prepare):8.2f} ms {statistics.median(total):7.2f} ms "
                f"{q[98]:5.1f} ms"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu", type=float, default=0.5)
    parser.add_argument("--shell", action="store_true")
    args = parser.parse_args()
    PROGRAM.cpu = args.cpu
    if args.shell:
        PROGRAM.path, PROGRAM.args = BASH, ("-c", "true")
    asyncio.run(main(args.n, args.rounds))
