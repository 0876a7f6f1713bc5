"""The benchmarks' CPU accounting, from ``/proc``: one process's fields, its children, the
machine's busy and total jiffies. Shared by bench/submit.py, bench/e2e.py (through
bench/stack.py), bench/attempt_start.py and bench/submit_growth.py."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command's name (field 3 onward), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def comm(pid: int | str) -> str | None:
    """The process's command name, None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().partition("(")[2].rpartition(")")[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def own_ticks(fields: list[str] | None) -> int:
    """utime + stime: the process's own CPU, its reaped children apart."""
    return int(fields[11]) + int(fields[12]) if fields else 0


def cpu_s(pid: int) -> float:
    """The process's own CPU seconds, 0 if it is gone."""
    return own_ticks(stat_fields(pid)) / TICK


def reaped_cpu_s(pid: int) -> float:
    """CPU seconds of the process's children that it has waited for (cutime + cstime):
    for a spawn helper, the attempts it started; for the worker agent, those it forked
    itself (no C compiler) and the helpers that exited (with their attempts)."""
    fields = stat_fields(pid)
    return (int(fields[13]) + int(fields[14])) / TICK if fields else 0.0


def processes() -> dict[int, tuple[int, str]]:
    """One walk of ``/proc``: each live process's (parent, command name) by pid."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                text = Path(f"/proc/{entry.name}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            head, _, rest = text.rpartition(")")
            found[int(entry.name)] = (int(rest.split()[1]), head.partition("(")[2])
    return found


def children(ppid: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The live children of ``ppid`` (in ``table``, one walk of ``/proc``: by default a
    new one)."""
    table = processes() if table is None else table
    return [pid for pid, (parent, _) in table.items() if parent == ppid]


def children_cpu_s(ppid: int) -> float:
    """The own CPU seconds of the live children of ``ppid`` (a postmaster's backends and
    background processes); those that ended between two reads are not in it."""
    return sum(cpu_s(pid) for pid in children(ppid))


def run_time_s(pid: int) -> float:
    """The process's own CPU seconds to the nanosecond (``/proc/PID/schedstat``), where
    ``cpu_s`` would round each of many small processes down to whole clock ticks."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        return 0.0 if stat_fields(pid) is None else cpu_s(pid)


def helpers_cpu_s(agent_pid: int, with_reaped: bool = True) -> float:
    """CPU seconds of a worker agent's live resident spawn helpers (``cairn-spawn``): their
    own, their resident source checkers' (their live children of the same name; read
    between attempts, when no attempt is one) and, ``with_reaped``, the attempts they
    started and reaped (the helper is their parent), in whole clock ticks. One walk of
    ``/proc`` (a walk per helper, 64 of them, cost the caller 0.29 s of CPU)."""
    own, attempts = helpers_split_s(agent_pid)
    return own + attempts if with_reaped else own


def helpers_split_s(agent_pid: int) -> tuple[float, float]:
    """``helpers_cpu_s`` in its two parts, from one walk of ``/proc``: the helpers' own
    (with their resident checkers'), and the children they reaped: the attempts, and the
    one-shot source checkers a helper makes while its resident one is busy or hung (rare:
    their CPU then counts as the attempts'). An attempt's work between its clone and its
    exec (its sandbox: namespaces, mounts, uid, keyrings, limits) is its own process's,
    so in the second."""
    table = processes()
    kids: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        kids.setdefault(parent, []).append(pid)

    def spawners(parent: int) -> list[int]:
        return [pid for pid in kids.get(parent, []) if table[pid][1].startswith("cairn-spawn")]

    helpers = spawners(agent_pid)
    own = sum(run_time_s(pid) + sum(run_time_s(c) for c in spawners(pid)) for pid in helpers)
    return own, sum(reaped_cpu_s(pid) for pid in helpers)


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat; idle and iowait are not busy."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(values)  # user nice system idle iowait irq softirq steal
    return total - values[3] - values[4], total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy."""
    return machine_ticks()[0] / TICK
