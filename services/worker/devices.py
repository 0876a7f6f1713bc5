"""Countable devices (docs/placement.md, "Devices"): the agent hands each attempt whole
devices by index from the ones it offers (``CAIRN_WORKER_DEVICES``, ``gpu=2``) and tells
the attempt which (``CUDA_VISIBLE_DEVICES`` for ``gpu``, ``CAIRN_DEVICES_<NAME>`` for
every name).

Each index is held by a lock file (``<name>.<index>`` in ``CAIRN_WORKER_DEVICE_LOCKS``)
while an attempt has it, as the attempts' uids are (``isolation.UidPool``): agents on one
host that share the folder never hand out one device twice. The lock goes with the agent
that took it, but the attempt may outlive its agent (a crash, until the sidecar kills
it): so the file also names the attempt's process group once it is started, and an index
whose last process group still has a process is not handed out again, by this agent or
the next one started on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import procs

#: the variable CUDA reads, for the devices named ``gpu``
CUDA_VARIABLE = "CUDA_VISIBLE_DEVICES"


class DevicesBusy(Exception):
    """Fewer free devices than the attempt holds: another attempt (perhaps one a dead
    agent left, not yet killed) has them."""


@dataclass
class Held:
    """The device indexes one attempt holds, by name, and their lock files."""

    indexes: dict[str, list[int]] = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)

    def env(self, offered: Mapping[str, int]) -> dict[str, str]:
        """What the attempt's environment says of them. On a worker with GPUs an attempt
        that holds none gets an empty ``CUDA_VISIBLE_DEVICES``: it sees none."""
        out = {
            f"CAIRN_DEVICES_{name.upper()}": ",".join(map(str, picked))
            for name, picked in self.indexes.items()
        }
        if "gpu" in offered:
            out[CUDA_VARIABLE] = ",".join(map(str, self.indexes.get("gpu", [])))
        return out


class DevicePool:
    """The devices this agent offers, each index handed to one attempt at a time."""

    def __init__(self, offered: Mapping[str, int], lock_dir: Path) -> None:
        self.offered = dict(offered)
        self.lock_dir = lock_dir
        self._held: dict[tuple[str, int], int] = {}
        if self.offered:
            lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def take(self, want: Mapping[str, int]) -> Held:
        """Indexes for ``want`` (``{"gpu": 1}``), the lowest free first; raises
        ``DevicesBusy`` (holding none) when there are fewer free."""
        held = Held()
        try:
            for name, n in sorted(want.items()):
                picked = held.indexes.setdefault(name, [])
                for _ in range(n):
                    picked.append(self._take_one(name, held))
        except DevicesBusy:
            self.give_back(held)
            raise
        return held

    def _take_one(self, name: str, held: Held) -> int:
        for index in range(self.offered.get(name, 0)):
            if (name, index) in self._held:
                continue
            fd = self._lock(name, index)
            if fd is None:
                continue
            self._held[(name, index)] = fd
            held.fds.append(fd)
            return index
        raise DevicesBusy(f"no {name} free on this worker")

    def _lock(self, name: str, index: int) -> int | None:
        path = self.lock_dir / f"{name}.{index}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _group_alive(os.pread(fd, 32, 0)):
            os.close(fd)  # an attempt of an agent gone is still running with it
            return None
        os.ftruncate(fd, 0)
        return fd

    def started(self, held: Held, process_group: int) -> None:
        """Name the attempt's process group in its devices' lock files."""
        for fd in held.fds:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(process_group).encode(), 0)

    def give_back(self, held: Held) -> None:
        """The attempt has ended (its processes are gone): its devices are free."""
        for name, picked in held.indexes.items():
            for index in picked:
                self._held.pop((name, index), None)
        for fd in held.fds:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
        held.fds.clear()
        held.indexes.clear()


def _group_alive(recorded: bytes) -> bool:
    """Whether the process group a lock file names still has a live process (a zombie
    left unreaped, where no init reaps, holds no device)."""
    text = recorded.decode(errors="replace").strip()
    if not text.isdigit() or int(text) <= 1:
        return False
    group = int(text)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return bool(procs.group_members({group}))


def node_rule(path: str) -> str:
    """The device cgroup rule of a device node (``c 195:0 rwm``); raises ``ValueError``
    if ``path`` is not one."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        raise ValueError(f"{path} is not a device node")
    return f"{kind} {os.major(info.st_rdev)}:{os.minor(info.st_rdev)} rwm"


def denied(nodes: Mapping[tuple[str, int], str], held: Mapping[str, list[int]]) -> list[str]:
    """The rules of the device nodes (``(name, index) -> node``) an attempt holding
    ``held`` may not open: every other index's."""
    return sorted(
        node_rule(path) for (name, index), path in nodes.items() if index not in held.get(name, ())
    )
