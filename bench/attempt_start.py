"""What isolation costs per attempt start: prepare (uid, folders, verified copy of the
artifact, cgroup) + spawn + exit + clean-up of ``/bin/true``, one attempt after another,
through the agent's own code (``services.worker.host``), without core or HTTP.

Each configuration runs twice in the same run: ``before`` forks the agent for every
attempt (``preexec_fn``, a fresh cgroup each, ``/bin/sh`` to clean up a uid) and ``after``
is the fast path (the resident spawn helper, pooled cgroups on v1). Rounds alternate
between the two, so load on the shared machine hits both alike.

Each round also runs the floor (``bench/floor.c``): the same program spawned ``-n`` times
by a bare C loop (fork, mount namespace with a tmpfs /tmp, uid, pooled cgroup v1 slot,
exec, wait4), and the ratios Cairn/floor are printed for the fast path of every
configuration:

- CPU per attempt. Cairn: this process's own CPU (the agent's code: prepare, spawn
  request, wait, release; user + system, all threads) + its reaped children's (the
  attempts it forked, clean-up shells; the helpers that exited) + the live
  ``cairn-spawn`` helpers' own and the attempts they started and reaped (their exit
  records' rusage), over the configuration's attempts. Floor: the C loop's
  own + its reaped children's (the programs) rusage, over its spawns.
- The bar (``../shared/DESIGN.md``, "Bars": "the agent and its helper at most 1.5x a
  bare isolated spawn of the same program"; issue 35's table: "the agent and its helper,
  outside the task's own process"), for the fast path with every isolation (the last
  configuration, as root): the agent's and its helpers' own CPU against the floor, the
  attempts' apart. Those three parts are printed: an attempt's own process holds its
  sandbox's work, from its clone to its exec (namespaces, mounts, uid, keyrings,
  limits), as the floor's child holds its own, which is less isolated than Cairn's.
  Beside them (no bar) the attempts' own processes against the spawned processes of the
  same C loop that also gives each spawn the rest of an attempt's sandbox (``floor -s``,
  ``floor.SANDBOX``; its loop makes each tmpfs home, as Cairn's agent does).
- Wall per attempt: the p50 of prepare + spawn + exit + clean-up against the p50 of the
  floor's fork-to-reaped.

Run as root:  .venv/bin/python bench/attempt_start.py [-n 200] [--rounds 2] [--cpu 0.5]
                   [--program true|bash|both]

``--cpu`` is what each attempt asks (its cgroup's CPU quota; the floor's slot has none);
``--program`` runs ``/bin/true``, ``/bin/bash -c true`` (a start that needs a few
milliseconds of CPU, which a small quota throttles) or both (the default), each as its own
table; ``--shell`` is ``--program bash``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import PROGRAMS, Floor, Runner, describe, ratio
from procstat import helpers_cpu_s

from libs.common.models import Artifact, Assignment, Resources
from services.worker.artifacts import ArtifactCache
from services.worker.cgroups import Cgroups
from services.worker.host import Host
from services.worker.settings import WorkerSettings

TRUE = Path("/bin/true")
UIDS = range(27000, 28000)


@dataclass
class Program:
    """What every attempt runs, and the CPU it asks."""

    path: Path = TRUE
    args: tuple[str, ...] = ()
    cpu: float = 0.5


PROGRAM = Program()
DETECT = Cgroups.detect


@functools.cache
def _sha(path: Path) -> str:
    # Once per program: the digest comes with the lease, the agent never computes it (an
    # assignment made per attempt hashed /bin/bash each time, inside the timed prepare and
    # the agent's counted CPU).
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
    handle = await host.launch(prepared, cache)
    result = await handle.wait()
    assert result.outcome == "succeeded", result
    handle.log.close()  # as the agent does: its log file then goes back to the spares
    await host.stop_leftovers(prepared)
    await host.release(prepared)
    return spawned - began, time.perf_counter() - began


async def _case(
    name: str, n: int, root: Path, isolation: str, cgroups: bool, mounts: bool, fast: bool
) -> tuple[list[float], list[float], tuple[float, ...]]:
    home = root / f"{name}-{fast}-{os.urandom(4).hex()}"
    settings = WorkerSettings(
        home=home,
        worker_isolation=isolation,  # type: ignore[arg-type]
        worker_run_dir=home / "run",
        worker_uid_locks=root / "uids",
        worker_uids=f"{UIDS.start}-{UIDS.stop - 1}",
    )
    host = Host(settings, home / "logs", fast=fast)
    if not cgroups:
        Cgroups.detect = classmethod(lambda cls, devices=False: (None, "off"))  # type: ignore[method-assign,assignment]
    try:
        host.start()
    finally:
        Cgroups.detect = DETECT  # type: ignore[method-assign]
    if not mounts:
        host.private_tmp = False
    cache = ArtifactCache(home / "artifacts")
    prepare, total = [], []
    first = _cairn_cpu_s(host, start=True)
    for i in range(1, n + 1):
        p, t = await _one(host, cache, i)
        prepare.append(p * 1000)
        total.append(t * 1000)
    last = _cairn_cpu_s(host)
    await host.close()
    return prepare, total, tuple(b - a for a, b in zip(first, last, strict=True))


def _cairn_cpu_s(host: Host, start: bool = False) -> tuple[float, float, float]:
    """Cairn's CPU seconds so far, in three parts. The agent: this process (the agent's
    code, all threads) and its reaped children (attempts it forked itself, helpers that
    exited), user + system. Its helpers: the live resident spawn helpers' own (with their
    checkers'). The attempts: those the helpers reaped (the rusage of their exit records,
    to the microsecond, where ``/proc``'s counts of reaped children are whole clock
    ticks), each one's sandbox from its clone to its exec included. The helpers are found
    by a walk of ``/proc`` (4 ms of this process's CPU), done outside the window: before
    this process's own rusage at the ``start``, after it at the end."""
    helpers = [host.helper] if host.helper is not None else []
    if host.slots is not None:
        helpers += [slot.helper for slot in host.slots.slots()]
    attempts = sum(helper.reaped_cpu_s for helper in helpers if not helper.gone)
    live = helpers_cpu_s(os.getpid(), with_reaped=False) if start else 0.0
    own, reaped = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    used = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    if not start:
        live = helpers_cpu_s(os.getpid(), with_reaped=False)
    return used, live, attempts


CASES = [
    ("none (agent's uid)", "none", False, False),
    ("uid", "user", False, False),
    ("uid + mount ns", "user", False, True),
    ("uid + mount ns + cgroup", "user", True, True),
]


#: each case's prepare and whole times (ms), and per round its CPU per attempt (ms) of the
#: agent, its helpers and the attempts (``_cairn_cpu_s``)
Samples = dict[
    tuple[str, str, bool], tuple[list[float], list[float], list[tuple[float, float, float]]]
]


async def main(n: int, rounds: int, programs: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="cairn-bench-", dir="/var/tmp"))
    root.chmod(0o711)
    # As on a host whose agent ran before: every uid's lock file exists (an agent makes
    # each once, then only opens and locks it), so no case pays the first-time creation.
    locks = root / "uids"
    locks.mkdir(mode=0o700)
    for uid in UIDS:
        (locks / str(uid)).touch(mode=0o600)
    print(
        f"load average {os.getloadavg()[0]:.2f} at start; n={n} per case and round; "
        f"programs {', '.join(' '.join(PROGRAMS[p]) for p in programs)} asking {PROGRAM.cpu} CPU"
    )
    cases = CASES if os.geteuid() == 0 else CASES[:1]
    samples: Samples = {}
    floors = {program: (Floor(), Floor()) for program in programs}
    try:
        with Runner() as floor:
            for _ in range(rounds):
                for program in programs:
                    await _round(program, n, root, cases, samples, floor, *floors[program])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for program in programs:
        _report(program, cases, samples, *floors[program])


async def _round(
    program: str,
    n: int,
    root: Path,
    cases: list[tuple[str, str, bool, bool]],
    samples: Samples,
    runner: Runner,
    floor: Floor,
    sandboxed: Floor,
) -> None:
    """Every configuration once for ``program``, its floors before and after them."""
    PROGRAM.path, PROGRAM.args = Path(PROGRAMS[program][0]), PROGRAMS[program][1:]
    runner.run_both(PROGRAMS[program], n, floor, sandboxed)
    for name, isolation, cgroups, mounts in cases:
        for fast in (False, True):
            got = await _case(name, n, root, isolation, cgroups, mounts, fast)
            prepare, total, cpu = samples.setdefault((program, name, fast), ([], [], []))
            prepare += got[0]
            total += got[1]
            agent, helpers, attempts = (part * 1000 / n for part in got[2])
            cpu.append((agent, helpers, attempts))
    runner.run_both(PROGRAMS[program], n, floor, sandboxed, sandboxed_first=True)


def _report(
    program: str,
    cases: list[tuple[str, str, bool, bool]],
    samples: Samples,
    floor: Floor,
    sandboxed: Floor,
) -> None:
    print(f"\n{' '.join(PROGRAMS[program])}")
    print(f"{'configuration':<26} {'path':<7} {'prepare p50':>11} {'whole p50':>10} {'p99':>8}")
    for name, *_ in cases:
        for fast in (False, True):
            prepare, total, _ = samples[(program, name, fast)]
            q = statistics.quantiles(total, n=100)
            print(
                f"{name:<26} {'after' if fast else 'before':<7} "
                f"{statistics.median(prepare):8.2f} ms {statistics.median(total):7.2f} ms "
                f"{q[98]:5.1f} ms"
            )
    if not floor.spawns:
        print("floor: not measured (no C compiler)")
        return
    q = statistics.quantiles(floor.walls_us, n=100)
    print(
        f"{'floor (bare C spawn)':<26} {'':<7} {'':>11} {floor.wall_p50_ms:7.2f} ms {q[98] / 1000:5.1f} ms"
    )
    print(f"    floor: {describe(floor)}")
    print(
        f"    floor CPU per spawn {floor.cpu_ms:.3f} ms (its loop + the program); "
        "Cairn's per attempt: the agent's code + helpers + the program"
    )
    for name, *_ in cases:
        for fast in (False, True):
            _, total, cpu = samples[(program, name, fast)]
            cairn_cpu, wall = statistics.mean(map(sum, cpu)), statistics.median(total)
            print(
                f"    Cairn/floor {name}, {'after' if fast else 'before'}: CPU per attempt "
                f"{cairn_cpu:.2f} ms, {ratio(cairn_cpu, floor.cpu_ms)}; wall p50 "
                f"{ratio(wall, floor.wall_p50_ms or 0)}"
            )
    if cases[-1][0] != CASES[-1][0]:
        return  # not root: no configuration isolates as the bar's does
    _, _, cpu = samples[(program, cases[-1][0], True)]
    agent, helpers, attempts = (statistics.mean(part) for part in zip(*cpu, strict=True))
    print(
        f"    {cases[-1][0]}, after, in parts: the agent {agent:.3f} ms, its helpers "
        f"{helpers:.3f} ms, the attempts' own processes (each one's sandbox from its clone "
        f"to its exec, and the program) {attempts:.3f} ms"
    )
    print(
        f"    agent + helpers / floor (the bar: the agent and its helper against a bare "
        f"isolated spawn): CPU {ratio(agent + helpers, floor.cpu_ms)} (bar 1.5x); "
        f"the attempts' own processes / floor {ratio(attempts, floor.cpu_ms)}"
    )
    if not sandboxed.spawns:
        return
    print(
        f"    the floor with the rest of an attempt's sandbox ({describe(sandboxed, True)}): "
        f"CPU per spawn {sandboxed.cpu_ms:.3f} ms, its spawned processes' "
        f"{sandboxed.child_cpu_ms:.3f} ms; the attempts' own processes / those "
        f"{ratio(attempts, sandboxed.child_cpu_ms)} (no bar)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu", type=float, default=0.5)
    parser.add_argument("--program", choices=[*PROGRAMS, "both"], default="both")
    parser.add_argument("--shell", action="store_true", help="the same as --program bash")
    args = parser.parse_args()
    PROGRAM.cpu = args.cpu
    program = "bash" if args.shell else args.program
    asyncio.run(main(args.n, args.rounds, list(PROGRAMS) if program == "both" else [program]))
