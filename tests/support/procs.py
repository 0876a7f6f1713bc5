"""The processes ``/proc`` shows, for tests that look for what a process started or left
behind: a parent's children (and their states), a uid's processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    #: ``R``, ``S``, ``D``, ``Z``...
    state: str
    #: the real uid
    uid: int
    #: the arguments, each ended by a NUL (empty for a zombie)
    cmdline: bytes


def processes() -> list[Proc]:
    """Every process listed, but those that ended while being read."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = _fields(stat)[:2]
        uid = next(line for line in status.splitlines() if line.startswith("Uid:"))
        found.append(Proc(int(entry.name), int(ppid), state, int(uid.split()[1]), cmdline))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie. A process that ends while
    it is read is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return _fields(stat)[0] != "Z"


def _fields(stat: str) -> list[str]:
    """The fields of a ``/proc/PID/stat`` after the name (state, ppid, ...): the name, in
    parentheses, may hold ") " itself."""
    return stat.rpartition(")")[2].split()


def children(pid: int) -> list[Proc]:
    """The processes whose parent is ``pid``."""
    return [proc for proc in processes() if proc.ppid == pid]


def child_states(pid: int) -> list[str]:
    """The states of ``pid``'s children."""
    return [proc.state for proc in children(pid)]


def of_uid(uid: int) -> list[int]:
    """The processes running as ``uid``."""
    return [proc.pid for proc in processes() if proc.uid == uid]
