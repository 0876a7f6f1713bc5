"""Process facts and controls that Linux offers through ``prctl`` and ``/proc``."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import time
from collections.abc import Callable, Collection

_PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that has the child sent ``signum`` when the process that starts it
    dies, even by SIGKILL; a parent already gone by then ends the child at once."""
    parent = os.getpid()

    def apply() -> None:
        _prctl(_PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return apply


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot), to tell it from a later process
    given the same pid; None if there is no such process."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def group_members(groups: Collection[int]) -> list[int]:
    """The live processes (zombies aside) of these process groups: one walk of ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command: state, ppid, pgrp
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) in groups:
            found.append(int(entry))
    return found


def effective_uid(pid: int) -> int | None:
    """The process's effective uid (``/proc/PID/status``: its folder's owner is root for
    a process that is not dumpable); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except OSError:
        return None
    return None


def stop_pid(pid: int, started: int, grace_s: float = 20.0) -> bool:
    """SIGTERM the process ``pid`` if it is still the one that started at ``started``, then
    SIGKILL it after ``grace_s``; whether there was such a process."""
    if start_time(pid) != started:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.1)
    if start_time(pid) == started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def settle_collector() -> None:
    """Once start-up is done: what it built kept out of every later collection, and the
    young generation collected far less often (a service's requests, an agent's attempts
    allocate many short-lived objects; at the default 700 allocations the collector was
    4 % of the worker agent's CPU at 200 tasks a second, perf)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
