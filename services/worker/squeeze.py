"""Lowering a running attempt's CPU share, so guaranteed work beside it gets the CPU.

An attempt in a cgroup of its own (``cgroups``) gets the lowest share there (v1
``cpu.shares`` 2, v2 ``cpu.weight`` 1) and every process in it nice 19. Otherwise, with a
delegated cgroup v2 hierarchy (``cpu`` among the controllers of the agent's own
cgroup, and its folder writable), the attempt's processes move to a child cgroup with
``cpu.weight`` 1 (against the default 100). Otherwise each process of the attempt's
group gets nice 19, the lowest priority a process can take without privilege; children
it starts later inherit it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from services.worker.cgroups import AttemptCgroup

CGROUP_ROOT = Path("/sys/fs/cgroup")
WEIGHT = 1
NICE = 19


def _own_cgroup() -> Path | None:
    """The agent's cgroup v2 folder, if the host gives it the ``cpu`` controller."""
    try:
        line = next(
            x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::")
        )
    except (OSError, StopIteration):
        return None
    folder = CGROUP_ROOT / line[3:].lstrip("/")
    try:
        controllers = (folder / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    if "cpu" not in controllers or not os.access(folder, os.W_OK):
        return None
    return folder


def _members(pgid: int) -> list[int]:
    """The pids of the process group (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def _by_cgroup(folder: Path, pgid: int, attempt_id: int) -> bool:
    child = folder / f"cairn-attempt-{attempt_id}"
    try:
        child.mkdir(exist_ok=True)
        (child / "cpu.weight").write_text(f"{WEIGHT}\n")
        for pid in _members(pgid):
            (child / "cgroup.procs").write_text(f"{pid}\n")
    except OSError:
        # No cpu controller in the child (the parent's subtree_control lacks it), or
        # moving refused: leave nothing behind and fall back to nice.
        with contextlib.suppress(OSError):
            child.rmdir()
        return False
    return True


def _by_nice(pgid: int) -> bool:
    done = False
    for pid in _members(pgid) or [pgid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, pid, NICE)
            done = True
    return done


def squeeze(pgid: int, attempt_id: int, group: AttemptCgroup | None = None) -> str | None:
    """Lower the attempt's CPU share; say how (None: its processes are gone)."""
    if group is not None and group.lower_cpu_share():
        for pid in group.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PROCESS, pid, NICE)
        return f"its cgroup's lowest CPU share, and nice {NICE}"
    folder = _own_cgroup()
    if folder is not None and _by_cgroup(folder, pgid, attempt_id):
        return f"cgroup cpu.weight {WEIGHT}"
    return f"nice {NICE}" if _by_nice(pgid) else None
