"""Why a task is not running: one sentence, computed when the task is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from libs.common.states import TaskState
from services.core.domain.placement import Amount, Node, largest_free

S = TaskState


@dataclass(frozen=True)
class Pool:
    """A queue as the reasons see it: paused, its live workers, how full it is."""

    name: str
    paused: bool
    nodes: tuple[Node, ...]
    utilisation: float
    defer_above: float


@dataclass(frozen=True)
class Standing:
    """What a reason needs of one task. ``need`` is what it would be charged;
    ``preempted_by`` is set when its last move was a preemption."""

    state: TaskState
    run_at: datetime
    need: Amount
    deferred: bool = False
    preempted_by: int | None = None
    #: what holds it back besides room: its owner's quota, its concurrency key
    held: str | None = None
    #: no live worker of its queue meets its required selectors: which ones
    #: (``domain.selectors.unmatched``)
    unmatched: str | None = None


def size(amount: Amount) -> str:
    memory = (
        f"{amount.memory_mb / 1024:.3g} GB"
        if amount.memory_mb >= 1024
        else f"{amount.memory_mb:.0f} MB"
    )
    devices = "".join(f" / {n} {name}" for name, n in amount.devices)
    return f"{amount.cpu:.3g} CPU / {memory}{devices}"


def when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def pending_reason(task: Standing, pool: Pool, now: datetime) -> str | None:
    """The reason a ready, waiting or failed task is not running; None otherwise."""
    if task.state is S.READY:
        return _ready(task, pool, now)
    if task.state is S.FAILED:
        return "queue paused" if pool.paused else f"retry after backoff, at {when(task.run_at)}"
    if task.state is S.WAITING:
        return _waiting(task, pool)
    return None


def _ready(task: Standing, pool: Pool, now: datetime) -> str:
    if pool.paused:
        return "queue paused"
    if task.deferred and task.run_at > now:
        return (
            f"deferred: pool at {_percent(pool.utilisation)} (defers above "
            f"{_percent(pool.defer_above)}); runs by {when(task.run_at)} at the latest"
        )
    if task.run_at > now:
        return f"scheduled for {when(task.run_at)}"
    if task.deferred:
        return "due; moving to waiting"
    return _waiting(task, pool)  # due: a claim takes it as it takes waiting work


def _waiting(task: Standing, pool: Pool) -> str:
    parts: list[str] = []
    if task.preempted_by is not None:
        parts.append(f"preempted by task {task.preempted_by}, requeued")
    if task.unmatched is not None:
        parts.append(f"{task.unmatched} (queue {pool.name})")
    elif task.held is not None:
        parts.append(task.held)
    else:
        parts.append(_room(task.need, pool.name, pool.nodes))
    return "; ".join(parts)


def _room(need: Amount, queue: str, nodes: Sequence[Node]) -> str:
    if not nodes:
        return f"no live worker serves queue {queue}"
    if not any(need.fits_in(n.capacity) for n in nodes):
        missing = _devices_nowhere(need, nodes)
        if missing:
            return f"needs {missing}: no live worker of queue {queue} has that many"
        biggest = max((n.capacity for n in nodes), key=lambda c: (c.cpu, c.memory_mb))
        return f"needs {size(need)}, larger than any worker (largest {size(biggest)})"
    free = largest_free(nodes, need)
    if free is not None and not need.fits_in(free):
        reason = f"needs {size(need)}, largest free slot {size(_floor(free, need))}"
        if not need.devices:
            return reason
        # With devices, which resource is short is not plain from the sizes: say it.
        return f"{reason} (short of {', '.join(need.short_of(free))})"
    return "fits a worker; waiting for its next claim"


def _devices_nowhere(need: Amount, nodes: Sequence[Node]) -> str:
    """The devices ``need`` asks for more of than any node has (``2 gpu``)."""
    return ", ".join(
        f"{n} {name}" for name, n in need.devices if all(x.capacity.device(name) < n for x in nodes)
    )


def _floor(amount: Amount, need: Amount) -> Amount:
    """What is free, none below zero, with every device ``need`` names (0 when none)."""
    devices = tuple((name, max(0, amount.device(name))) for name, _ in need.devices)
    return Amount(max(0.0, amount.cpu), max(0.0, amount.memory_mb), devices)
