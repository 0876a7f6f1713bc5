"""Limits for an attempt's whole process tree, by cgroup: memory, a CPU quota and a cap
on processes, with peak memory, CPU time and OOM kills read back from the same cgroup.

cgroup v2 is used where the agent's own cgroup offers the ``memory``, ``cpu`` and ``pids``
controllers and lets it enable them for children; otherwise cgroup v1, one hierarchy per
controller (``memory``, ``cpu``, ``cpuacct``, ``pids``). Attempt cgroups live under the
agent's own cgroup in each hierarchy, in ``cairn/agent-PID/aATTEMPT``; an agent that starts
removes what dead agents left there (``Cgroups.sweep``), in every hierarchy, those it does
not use itself too. ``Cgroups.detect`` says what it cannot enforce.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger("cairn.worker.cgroups")

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
#: the least CPU time a period holds, and the longest period the kernel allows
MIN_QUOTA_US = 10_000
MAX_PERIOD_US = 1_000_000
_V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
_V2_CONTROLLERS = ("memory", "cpu", "pids")
_KILL_ROUNDS = 200


def _read(path: Path) -> str | None:
    """The file's text, from a fresh open (what ``cgroup.procs`` needs: on v1 a file kept
    open goes on serving the pid list it first read, for up to a second)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
    except OSError:
        return False
    return True


class ControlFiles:
    """A cgroup's control files (limits, counters), each opened once and then read or
    written with one ``pread`` or ``pwrite``: a pooled slot's values per attempt cost a
    system call each, no open and no file object. Never ``cgroup.procs`` (``_read``).
    Where no descriptor is left (``EMFILE``) a value is read or written by a fresh open."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int | None:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # a read-only counter
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    return None
                raise
            self._fds[path] = fd
        return fd

    def read(self, path: Path) -> str | None:
        try:
            fd = self._fd(path)
            if fd is None:
                return _read(path)
            return os.pread(fd, 4096, 0).decode()
        except OSError:
            self._drop(path)
            return None

    def write(self, path: Path, value: str) -> None:
        """Raises ``OSError`` as the kernel refuses the value."""
        try:
            fd = self._fd(path)
            if fd is None:
                path.write_text(value)
                return
            os.pwrite(fd, value.encode(), 0)
        except OSError:
            self._drop(path)
            raise

    def _drop(self, path: Path) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def cpu_bandwidth(cpu: float) -> tuple[int, int]:
    """The CFS quota and period (microseconds) that hold ``cpu`` cores on average.

    100 ms periods, except for small requests: those get longer periods (up to the
    kernel's 1 s) so that each still holds ``MIN_QUOTA_US`` of CPU time. With 1 ms per
    100 ms (0.01 CPU), the few milliseconds a process needs to start (an exec, a shell's
    start-up) were cut into 100 ms throttles, 100 to 300 ms before its first line ran;
    10 ms per second is the same share, and lets a start through in one piece."""
    period = max(CPU_PERIOD_US, min(MAX_PERIOD_US, math.ceil(MIN_QUOTA_US / cpu)))
    return max(1000, int(cpu * period)), period


#: the host's CPUs, counted once (``os.cpu_count`` reads a file of ``/sys`` each time)
_CPUS = os.cpu_count() or 1


def start_budget_us(period_us: int) -> int:
    """The CPU quota a pooled slot holds while its helper starts an attempt: a period's
    worth of every CPU, which nothing throttles (``cgpool``: the attempt's own is written
    once it has exec'd)."""
    return period_us * _CPUS


def _keyed(text: str | None, key: str) -> int | None:
    """The number after ``key`` in a flat-keyed cgroup file (``oom_kill 3``)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for the v2 hierarchy."""
    paths: dict[str, str] = {}
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _mounts(devices: bool = False) -> dict[str, Path]:
    """Mount points per v1 controller (``devices`` too, if asked), and ``""`` for the
    cgroup2 mount."""
    wanted = (*_V1_CONTROLLERS, "devices") if devices else _V1_CONTROLLERS
    found: dict[str, Path] = {}
    for line in (_read(Path("/proc/self/mountinfo")) or "").splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = [*right.split(" "), "", "", ""][:3]
        point = Path(left.split(" ")[4])
        if fstype == "cgroup2":
            found.setdefault("", point)
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in wanted:
                    found.setdefault(option, point)
    return found


def _pids_in(folder: Path) -> list[int]:
    text = _read(folder / "cgroup.procs") or ""
    return [int(x) for x in text.split() if x.isdigit()]


@dataclass
class AttemptCgroup:
    """One attempt's cgroup (a folder per v1 hierarchy, or one v2 folder)."""

    version: Literal["v1", "v2"]
    folders: dict[str, Path]
    memory_mb: int | None = None
    removed: bool = False
    #: the pooled cgroup's resident spawn helper: never signalled, never counted
    resident: int | None = None
    #: OOM kills and CPU time the cgroup had counted before this attempt (pooled, v2)
    oom_base: int = 0
    cpu_base: float = 0.0
    #: kept open for a pooled cgroup's values (``ControlFiles``); None: opened per read
    files: ControlFiles | None = None
    #: seen empty after its attempt's leader was reaped (``settle``): nothing of the attempt
    #: can come back (a process is born where its parent is, only root moves one, and
    #: the resident helper forks only when asked), so later kills need no read
    settled: bool = False
    #: its CPU share was lowered (``lower_cpu_share``): a pooled slot's is put back
    squeezed: bool = False
    #: the CPU quota the spawn helper writes once the attempt has exec'd (a pooled v1
    #: slot's, ``cgpool.CgroupPool.take``; a v2 cgroup's ``cpu.max``, ``Cgroups.create``
    #: with ``defer_cpu``); None: the quota written before the start holds
    quota_at_exec: str | None = None

    def value(self, path: Path) -> str | None:
        """A control file's text (None if it cannot be read)."""
        return self.files.read(path) if self.files is not None else _read(path)

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a new process writes its pid into, once each."""
        return sorted({str(folder / "cgroup.procs") for folder in self.folders.values()})

    def _folder(self, controller: str) -> Path | None:
        return self.folders.get(controller) or self.folders.get("")

    def pids(self) -> list[int]:
        folder = self._folder("pids") or self._folder("memory")
        return [p for p in _pids_in(folder) if p != self.resident] if folder else []

    def empty(self) -> bool:
        """No process of an attempt in its cgroup (the resident helper aside). On v1 one
        hierarchy answers for all: a process belongs to one cgroup of every hierarchy at
        once (one css_set), is born where its parent is, and only root may move it, which
        the agent never does; so the attempt's processes are in all of its folders or in
        none."""
        return not self.pids()

    def settle(self) -> bool:
        """``kill_all`` once the attempt's leader is reaped; an empty cgroup is then
        ``settled`` until its next attempt (``CgroupPool.take``)."""
        self.settled = self.kill_all()
        return self.settled

    def kill_all(self) -> bool:
        """SIGKILL every process of the attempt, those it forks meanwhile included;
        whether the cgroup was then seen empty (``empty``)."""
        if self.settled:
            return True
        folder = self.folders.get("")
        if folder is not None and self.resident is None and _write(folder / "cgroup.kill", "1"):
            return self.empty()
        for _ in range(_KILL_ROUNDS):
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)
        return False

    def peak_memory_mb(self) -> float | None:
        if self.version == "v1":
            name, folder = "memory.max_usage_in_bytes", self._folder("memory")
        else:
            name, folder = "memory.peak", self._folder("memory")
        text = self.value(folder / name) if folder else None
        return round(int(text) / 2**20, 3) if text and text.strip().isdigit() else None

    def memory_now_mb(self) -> float | None:
        name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        folder = self._folder("memory")
        text = self.value(folder / name) if folder else None
        return round(int(text) / 2**20, 3) if text and text.strip().isdigit() else None

    def cpu_seconds(self) -> float | None:
        if self.version == "v1":
            folder = self._folder("cpuacct")
            text = self.value(folder / "cpuacct.usage") if folder else None
            if not text or not text.strip().isdigit():
                return None
            return round(max(0.0, int(text) / 1e9 - self.cpu_base), 3)
        folder = self._folder("cpu")
        usage = _keyed(self.value(folder / "cpu.stat") if folder else None, "usage_usec")
        return round(max(0.0, usage / 1e6 - self.cpu_base), 3) if usage is not None else None

    def lower_cpu_share(self) -> bool:
        """The lowest CPU share against its siblings (squeezed for guaranteed work)."""
        folder = self._folder("cpu")
        if folder is None:
            return False
        self.squeezed = True  # before the write: a slot is never reused unsqueezed
        if self.version == "v1":
            return _write(folder / "cpu.shares", "2")
        return _write(folder / "cpu.weight", "1")

    def confine_devices(self, denied: list[str]) -> bool:
        """Allow every device but those ``denied`` (``c 195:1 rwm`` rules) to the
        attempt's processes (cgroup v1's ``devices`` controller: a pooled slot's rules
        are rewritten for each attempt, before its start); False without that folder."""
        folder = self.folders.get("devices")
        if folder is None:
            return False
        (folder / "devices.allow").write_text("a")
        for rule in denied:
            (folder / "devices.deny").write_text(rule)
        return True

    def oom_kills(self) -> int:
        folder = self._folder("memory")
        if folder is None:
            return 0
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        return max(0, (_keyed(self.value(folder / name), "oom_kill") or 0) - self.oom_base)

    def remove(self) -> bool:
        """Remove the cgroup once its processes are gone; False while some remain."""
        if self.removed:
            return True
        self.kill_all()
        if self.files is not None:
            self.files.close()  # no descriptor keeps a folder from going
        done = True
        for folder in set(self.folders.values()):
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        self.removed = done
        return done


@dataclass
class Cgroups:
    """How this agent makes attempt cgroups; ``None`` from ``detect`` when it cannot."""

    version: Literal["v1", "v2"]
    bases: dict[str, Path]
    enforced: frozenset[str] = field(default_factory=frozenset)
    #: Cairn's folder (``cairn``, the parent of the agents' own) in every hierarchy where
    #: this agent's cgroup has one, used by it or not (``sweep``); empty: its bases'
    roots: frozenset[Path] = field(default_factory=frozenset)

    @classmethod
    def detect(cls, devices: bool = False) -> tuple[Cgroups | None, str]:
        """The driver for this host, and a sentence on what is enforced and what not.
        ``devices``: on v1, also a folder per attempt in the ``devices`` hierarchy (for
        ``AttemptCgroup.confine_devices``), where it is mounted."""
        own, mounts = _own_paths(), _mounts(devices=True)
        driver = _v2(own, mounts) or _v1(own, mounts, devices)
        if driver is None:
            return None, (
                "no writable cgroup hierarchy: an attempt's memory is an RLIMIT_DATA per "
                "process, its processes an RLIMIT_NPROC for its uid, and CPU is not limited"
            )
        missing = sorted({"memory", "cpu", "pids"} - driver.enforced)
        note = f"cgroup {driver.version} enforces {', '.join(sorted(driver.enforced))}"
        if missing:
            note += f"; not enforced by cgroup: {', '.join(missing)}"
        return driver, note

    def create(
        self,
        attempt_id: int,
        memory_mb: int | None,
        cpu: float | None,
        pids_max: int,
        defer_cpu: bool = False,
    ) -> AttemptCgroup:
        """A fresh cgroup for the attempt with its limits set; raises ``OSError``. With
        ``defer_cpu`` (v2, started by the spawn helper into it), its CPU quota is a
        period's worth of every CPU until the helper writes the attempt's own after its
        exec (``AttemptCgroup.quota_at_exec``): the start's work is not the attempt's."""
        folders = {name: base / f"a{attempt_id}" for name, base in self.bases.items()}
        group = AttemptCgroup(self.version, folders, memory_mb)
        for folder in set(folders.values()):
            if folder.exists():  # left by an earlier try of the same attempt
                AttemptCgroup(self.version, {"": folder}).remove()
            folder.mkdir()
        try:
            self._limit(group, memory_mb, cpu, pids_max, defer_cpu and self.version == "v2")
        except OSError:
            group.remove()
            raise
        return group

    def _limit(
        self,
        group: AttemptCgroup,
        memory_mb: int | None,
        cpu: float | None,
        pids_max: int,
        defer_cpu: bool = False,
    ) -> None:
        memory, cpu_folder, pids = (
            group._folder("memory"),
            group._folder("cpu"),
            group._folder("pids"),
        )
        v1 = self.version == "v1"
        if memory is not None and memory_mb is not None:
            limit = str(memory_mb * 2**20)
            (memory / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(limit)
            # No swap beyond the limit, where the kernel accounts swap at all.
            if v1:
                _write(memory / "memory.memsw.limit_in_bytes", limit)
            else:
                _write(memory / "memory.swap.max", "0")
        if cpu_folder is not None and cpu is not None:
            quota, period = cpu_bandwidth(cpu)
            if v1:
                (cpu_folder / "cpu.cfs_period_us").write_text(str(period))
                (cpu_folder / "cpu.cfs_quota_us").write_text(str(quota))
            elif defer_cpu:
                (cpu_folder / "cpu.max").write_text(f"{start_budget_us(period)} {period}")
                group.quota_at_exec = f"{quota} {period}"
            else:
                (cpu_folder / "cpu.max").write_text(f"{quota} {period}")
        if pids is not None:
            (pids / "pids.max").write_text(str(pids_max))

    def sweep(self) -> None:
        """Remove the cgroups that agents no longer alive left behind (an agent killed
        with SIGKILL leaves its pooled slots' folders, and its attempts' processes if
        any, which are killed first), in each of Cairn's folders (``roots``): also in a
        hierarchy this agent does not use (``devices``, where no device is offered), which
        no later agent would sweep otherwise. An agent's folder is named by its pid: one
        whose pid runs is left alone (this agent's own among them)."""
        for root in self.roots or {base.parent for base in self.bases.values()}:
            for stale in root.glob("agent-*"):
                pid = stale.name.removeprefix("agent-")
                if pid.isdigit() and Path(f"/proc/{pid}").exists():
                    continue
                try:
                    folders = [f for f in stale.iterdir() if f.is_dir()]
                except OSError:  # another agent starting at once swept it meanwhile
                    continue
                for folder in folders:
                    AttemptCgroup(self.version, {"": folder}).remove()
                with contextlib.suppress(OSError):
                    stale.rmdir()

    def close(self) -> None:
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                base.rmdir()


def _prepare(base: Path) -> bool:
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(base, os.W_OK)


def _v1(own: dict[str, str], mounts: dict[str, Path], devices: bool = False) -> Cgroups | None:
    bases: dict[str, Path] = {}
    tag = f"cairn/agent-{os.getpid()}"
    for name in (*_V1_CONTROLLERS, "devices") if devices else _V1_CONTROLLERS:
        if name not in mounts or name not in own:
            continue
        base = mounts[name] / own[name].lstrip("/") / tag
        if _prepare(base):
            bases[name] = base
    enforced = {"memory", "cpu", "pids"} & set(bases)
    if not enforced:
        return None
    roots = {mounts[n] / own[n].lstrip("/") / "cairn" for n in mounts if n and n in own}
    return Cgroups("v1", bases, frozenset(enforced), frozenset(roots))


def _v2(own: dict[str, str], mounts: dict[str, Path]) -> Cgroups | None:
    if "" not in mounts or "" not in own:
        return None
    folder = mounts[""] / own[""].lstrip("/")
    offered = (_read(folder / "cgroup.controllers") or "").split()
    if not set(_V2_CONTROLLERS) <= set(offered) or not os.access(folder, os.W_OK):
        return None
    # "No internal processes": the agent moves into a leaf of its own first, so that its
    # cgroup may hand the controllers to the attempts' cgroups.
    if _pids_in(folder) and folder != mounts[""]:
        leaf = folder / "cairn-agent"
        with contextlib.suppress(FileExistsError):
            leaf.mkdir()
        if not _write(leaf / "cgroup.procs", str(os.getpid())):
            return None
    enable = " ".join(f"+{name}" for name in _V2_CONTROLLERS)
    base = folder / "cairn" / f"agent-{os.getpid()}"
    if not _write(folder / "cgroup.subtree_control", enable) or not _prepare(base):
        return None
    if not (
        _write(base.parent / "cgroup.subtree_control", enable)
        and _write(base / "cgroup.subtree_control", enable)
    ):
        return None
    return Cgroups("v2", {"": base}, frozenset(_V2_CONTROLLERS))
