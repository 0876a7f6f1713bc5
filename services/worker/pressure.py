"""Memory pressure on the host: preemptible attempts are charged their measured use, so
the host's real memory can run out. The agent reads ``MemAvailable`` and, under its
threshold, preempts the preemptible attempt furthest over its charge first."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from libs.common.models import Assignment
from services.worker.executor import RunningAttempt


def available_mb(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's available memory (``MemAvailable``), in MB."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def excess(running: Iterable[tuple[int, Assignment, RunningAttempt]]) -> list[int]:
    """Preemptible attempts, the one furthest over its charge first (use from its
    cgroup; an attempt without one is not measured and goes last)."""
    ranked = []
    for attempt_id, assignment, handle in running:
        if not assignment.preemptible:
            continue
        group = handle.spec.cgroup
        used = group.memory_now_mb() if group is not None else None
        charge = (assignment.charge or assignment.resources).memory_mb
        ranked.append((-(used - charge) if used is not None else float("inf"), attempt_id))
    return [attempt_id for _, attempt_id in sorted(ranked)]
