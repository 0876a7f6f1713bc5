"""A pool of cgroup v1 slots reused across attempts, each with a resident spawn helper.

Joining a cgroup v1 hierarchy (a ``cgroup.procs`` write) takes the kernel's global
cgroup thread-group lock for writing, which waits for an RCU grace period: four
hierarchies (memory, cpu, cpuacct, pids) cost an attempt 5 to 20 ms. A process forked
inside a cgroup is born there for free. So each slot (``cairn/agent-PID/sN`` in every
hierarchy) holds a ``cairn-spawn`` helper that joined it once, and every attempt of the
slot is forked by it: no migration, no mkdir or rmdir per attempt.

Per attempt, only limits that differ from the slot's last ones are written (but the CPU
quota always: the write refills the period's budget and forgives what the last attempt
overran), each a ``pwrite`` to a file the slot keeps open (``ControlFiles``). Where the
helper can (``Helper.sets_quota``), the quota written before the start is a period's worth
of every CPU (``start_budget_us``) and the helper writes the attempt's own once it has
exec'd (``Launch.cpu_quota``): the start's work (the helper's clone, the child's
namespaces, keyrings and identity) is Cairn's, not the attempt's. Charged to a small quota
(10 ms a second at 0.01 CPU), a start held up there, a spin lock's holder preempted on
this VM's host, overran it and kept the attempt throttled for 0.2 to 3 s before its first
instruction, 4 starts in 1,000. The counters are reset (``memory.max_usage_in_bytes``,
``cpuacct.usage``; the OOM-kill count is read as a baseline): by the helper itself right
before the start where it keeps them (``Helper.counts``), which also reads them at the
exit (``spawner.Counters``), else here. The helper is the slot's ``resident``: it is never signalled nor
counted, and ``pids.max`` leaves room for it. When an attempt ends the slot is emptied
(every process but the helper killed), checked empty (in one hierarchy, which answers
for all: ``AttemptCgroup.empty``), its page cache
reclaimed (``memory.force_empty``, when it holds more than 2 MB), and only then handed
out again; a slot that will not
empty, or whose helper died, is retired and removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.cgroups import (
    AttemptCgroup,
    Cgroups,
    ControlFiles,
    cpu_bandwidth,
    start_budget_us,
)
from services.worker.spawner import Helper

log = logging.getLogger("cairn.worker.cgpool")

UNLIMITED = "-1"
#: what a slot may keep charged between attempts without a reclaim (its helper's own
#: pages and kernel objects are about 0.2 MB; a trivial attempt leaves 0.5 MB)
RECLAIM_ABOVE = 2 * 2**20


@dataclass
class Slot:
    """One pooled cgroup, its resident helper, and the limits last written to it."""

    name: str
    group: AttemptCgroup
    helper: Helper
    limits: dict[str, str] = field(default_factory=dict)
    #: the files written or read at every attempt, joined once (None: no such hierarchy)
    quota_file: Path | None = field(init=False, default=None)
    usage_file: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        cpu, memory = self.group.folders.get("cpu"), self.group.folders.get("memory")
        self.quota_file = cpu / "cpu.cfs_quota_us" if cpu is not None else None
        self.usage_file = memory / "memory.usage_in_bytes" if memory is not None else None


class CgroupPool:
    """Slots of ``cgroups`` (a v1 driver), each served by a helper built at ``binary``."""

    def __init__(self, cgroups: Cgroups, binary: Path, size: int) -> None:
        if cgroups.version != "v1":
            raise ValueError("the pool is for cgroup v1; v2 starts attempts into their cgroup")
        self.cgroups = cgroups
        self.binary = binary
        self.size = size
        self._free: list[Slot] = []
        self._busy: dict[int, Slot] = {}
        self._stuck: list[Slot] = []
        self._leftover: list[AttemptCgroup] = []
        self._names = itertools.count(1)
        #: whether slots may hold ``start_budget_us`` while their helper starts (v1 refuses
        #: a quota above a parent's: under an agent whose own cgroup has a lower one,
        #: the attempt's quota is written before the start, as without the helper's)
        self.start_budget = True

    async def take(self, memory_mb: int | None, cpu: float | None, pids_max: int) -> Slot:
        """A slot with these limits, its counters reset; raises ``OSError``."""
        slot = None
        while self._free:
            candidate = self._free.pop()
            if candidate.helper.alive():
                slot = candidate
                break
            self._retire(candidate)
        if slot is None:
            slot = await self._make()
        try:
            self._limit(slot, memory_mb, cpu, pids_max)
            if not slot.helper.counts:  # else its helper resets them before the start
                self._reset(slot)
        except OSError:
            self._retire(slot)
            raise
        slot.group.memory_mb = memory_mb
        slot.group.removed = False
        slot.group.settled = False
        self._busy[id(slot.group)] = slot
        return slot

    def slot_of(self, group: AttemptCgroup) -> Slot | None:
        return self._busy.get(id(group))

    def slots(self) -> list[Slot]:
        """Every slot it holds: free, busy, and those still emptying."""
        return [*self._free, *self._busy.values(), *self._stuck]

    async def give_back(self, slot: Slot) -> bool:
        """Empty the slot and return it to the pool; whether no process of the attempt
        is left (then its folders may be reused). A slot some process of which is still
        exiting is kept aside (retried by ``tidy``). A slot left with more than
        ``RECLAIM_ABOVE`` charged (page cache of files the attempt read or wrote) is
        reclaimed first, in a thread, so the next attempt is not measured with it."""
        emptied = self._settle(slot)
        if emptied and not slot.helper.gone:
            if _charged(slot) > RECLAIM_ABOVE:
                await asyncio.to_thread(self._reclaim, slot)
            self._shelve(slot)
        return emptied

    def _settle(self, slot: Slot) -> bool:
        """Kill what is left; whether the cgroup was then empty (the helper aside). A
        slot whose helper died is retired, one not yet empty kept aside."""
        self._busy.pop(id(slot.group), None)
        emptied = slot.group.kill_all()
        if not slot.helper.alive():
            self._retire(slot)
        elif not emptied:
            self._stuck.append(slot)
        return emptied

    def _shelve(self, slot: Slot) -> None:
        if len(self._free) >= self.size:
            self._retire(slot)
        else:
            self._free.append(slot)

    def tidy(self) -> None:
        """Retry the slots whose last processes were still exiting."""
        stuck, self._stuck = self._stuck, []
        for slot in stuck:
            if self._settle(slot) and not slot.helper.gone:
                if _charged(slot) > RECLAIM_ABOVE:
                    self._reclaim(slot)
                self._shelve(slot)
        self._leftover = [group for group in self._leftover if not group.remove()]

    def close(self) -> None:
        for slot in [*self._free, *self._stuck, *self._busy.values()]:
            self._retire(slot)
        self._free, self._stuck, self._busy = [], [], {}

    async def _make(self) -> Slot:
        name = f"s{next(self._names)}"
        folders = {c: base / name for c, base in self.cgroups.bases.items()}
        group = AttemptCgroup("v1", folders, files=ControlFiles())
        for folder in set(folders.values()):
            if folder.exists():
                AttemptCgroup("v1", {"": folder}).remove()
            folder.mkdir()
        helper = Helper(self.binary, group.procs_files)
        slot = Slot(name, group, helper)
        try:
            await helper.ready()
        except Exception:
            self._retire(slot)
            raise OSError(f"the spawn helper could not join cgroup {name}") from None
        group.resident = helper.pid
        return slot

    def _limit(self, slot: Slot, memory_mb: int | None, cpu: float | None, pids_max: int) -> None:
        folders, files = slot.group.folders, _files(slot)
        memory = folders.get("memory")
        if memory is not None:
            value = str(memory_mb * 2**20) if memory_mb is not None else UNLIMITED
            if slot.limits.get("memory") != value:
                _set_memory(files, memory, value)
                slot.limits["memory"] = value
        cpu_folder = folders.get("cpu")
        if cpu_folder is not None:
            self._limit_cpu(slot, cpu_folder, files, cpu)
        pids = folders.get("pids")
        if pids is not None:
            value = str(pids_max + 1)  # and the resident helper
            if slot.limits.get("pids") != value:
                files.write(pids / "pids.max", value)
                slot.limits["pids"] = value
        if cpu_folder is not None and slot.group.squeezed:  # an earlier attempt's
            files.write(cpu_folder / "cpu.shares", "1024")
            slot.group.squeezed = False

    def _limit_cpu(self, slot: Slot, folder: Path, files: ControlFiles, cpu: float | None) -> None:
        """The slot's CPU period, and its quota: written every time (a write refills the
        period's budget, so an attempt never starts throttled for the CPU its slot's last
        attempt spent); the start's budget until its helper writes the attempt's own."""
        quota, period = cpu_bandwidth(cpu) if cpu is not None else (UNLIMITED, None)
        if period is not None and slot.limits.get("cpu_period") != str(period):
            files.write(folder / "cpu.cfs_period_us", str(period))
            slot.limits["cpu_period"] = str(period)
        quota_file = slot.quota_file or folder / "cpu.cfs_quota_us"
        deferred = False
        if period is not None and self.start_budget and slot.helper.sets_quota:
            try:
                files.write(quota_file, str(start_budget_us(period)))
                deferred = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("slots' quota before a start: the attempt's (%s)", exc)
                self.start_budget = False
        if not deferred:
            files.write(quota_file, str(quota))
        slot.group.quota_at_exec = str(quota) if deferred else None

    def _reset(self, slot: Slot) -> None:
        group, files = slot.group, _files(slot)
        memory, cpuacct = group.folders.get("memory"), group.folders.get("cpuacct")
        if memory is not None:
            files.write(memory / "memory.max_usage_in_bytes", "0")
            group.oom_base = 0
            group.oom_base = group.oom_kills()
        if cpuacct is not None:
            files.write(cpuacct / "cpuacct.usage", "0")
            group.cpu_base = 0.0

    def _reclaim(self, slot: Slot) -> None:
        memory = slot.group.folders.get("memory")
        if memory is not None:
            with contextlib.suppress(OSError):
                (memory / "memory.force_empty").write_text("0")

    def _retire(self, slot: Slot) -> None:
        slot.helper.close()
        slot.group.resident = None
        slot.group.settled = False  # its helper, counted now, may still be exiting
        if not slot.group.remove():
            self._leftover.append(slot.group)  # its last processes are still exiting


def _charged(slot: Slot) -> int:
    usage = slot.usage_file
    text = slot.group.value(usage) if usage is not None else None
    return int(text) if text and text.strip().isdigit() else 0


def _files(slot: Slot) -> ControlFiles:
    if slot.group.files is None:
        slot.group.files = ControlFiles()
    return slot.group.files


def _set_memory(files: ControlFiles, folder: Path, value: str) -> None:
    """The memory limit, and the same for memory+swap where the kernel has it (which
    must never be below it, so the order depends on the direction)."""
    limit, memsw = folder / "memory.limit_in_bytes", folder / "memory.memsw.limit_in_bytes"
    try:
        files.write(limit, value)
    except OSError:
        # Above the current memory+swap limit: raise that first.
        files.write(memsw, value)
        files.write(limit, value)
        return
    with contextlib.suppress(OSError):
        files.write(memsw, value)
