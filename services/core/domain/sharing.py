"""Sharing one pool, with no I/O: quotas per owner, concurrency keys, queue policy, aging.

The claim asks a ``Gate`` whether each candidate may start (its owner below its running
quotas, its concurrency key below its limit and rate); the same gate, read without
taking, gives a waiting task its pending reason.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from libs.common.models import QueuePolicy
from services.core.domain.placement import Amount, Counts


@dataclass(frozen=True)
class Quota:
    """An owner's running quotas (None: no limit)."""

    max_cpu: float | None = None
    max_memory_mb: float | None = None
    max_running: int | None = None
    #: running devices, by name (``counts``)
    max_devices: Counts = ()

    @property
    def limits_running(self) -> bool:
        limits = (self.max_cpu, self.max_memory_mb, self.max_running)
        return limits != (None, None, None) or bool(self.max_devices)


@dataclass
class Use:
    """What an owner's open attempts request."""

    running: int = 0
    cpu: float = 0.0
    memory_mb: float = 0.0
    devices: Counter[str] = field(default_factory=Counter)


def _n(value: float) -> str:
    return f"{value:.4g}"


def over_quota(quota: Quota, use: Use, need: Amount) -> str | None:
    """Which running quota starting ``need`` would break, as the reason says it
    (``cpu 40/40``); None when it fits."""
    if quota.max_running is not None and use.running + 1 > quota.max_running:
        return f"running {use.running}/{quota.max_running}"
    if quota.max_cpu is not None and use.cpu + need.cpu > quota.max_cpu + 1e-9:
        return f"cpu {_n(use.cpu)}/{_n(quota.max_cpu)}"
    if quota.max_memory_mb is not None and use.memory_mb + need.memory_mb > quota.max_memory_mb:
        return f"memory {_n(use.memory_mb)}/{_n(quota.max_memory_mb)} MB"
    for name, most in quota.max_devices:
        if use.devices[name] + need.device(name) > most:
            return f"{name} {use.devices[name]}/{most}"
    return None


@dataclass(frozen=True)
class KeyLimit:
    """A concurrency key's limits: running at once, and starts per window."""

    max_running: int | None = None
    max_starts: int | None = None
    window_s: float | None = None


@dataclass
class KeyUse:
    running: int = 0
    started: int = 0


def key_held(key: str, limit: KeyLimit, use: KeyUse) -> str | None:
    if limit.max_running is not None and use.running >= limit.max_running:
        return f"waiting for concurrency key {key} ({use.running}/{limit.max_running} running)"
    if limit.max_starts is not None and use.started >= limit.max_starts:
        return (
            f"concurrency key {key} at its rate limit "
            f"({use.started}/{limit.max_starts} starts in {_n(limit.window_s or 0)} s)"
        )
    return None


@dataclass(frozen=True)
class Gated:
    """What the gate needs of a candidate: its owner (and team), request and concurrency
    key (with the task's own limit, used when no admin set one for the key)."""

    owner: str
    request: Amount
    key: str | None = None
    key_limit: int | None = None
    team: str | None = None


@dataclass
class Gate:
    """Running quotas of owners and teams and limits of keys, with their use now.
    ``admit`` takes a candidate's room when it may start; ``held`` only says why it may
    not. A team's use sums the open attempts of every task the team owns."""

    tasks: Mapping[int, Gated]
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    use: dict[str, Use] = field(default_factory=dict)
    team_quotas: Mapping[str, Quota] = field(default_factory=dict)
    team_use: dict[str, Use] = field(default_factory=dict)
    limits: Mapping[str, KeyLimit] = field(default_factory=dict)
    keys: dict[str, KeyUse] = field(default_factory=dict)
    #: candidates held back, by what held them (quota, concurrency, rate)
    refused: Counter[str] = field(default_factory=Counter)

    def _limit(self, item: Gated) -> KeyLimit:
        assert item.key is not None
        central = self.limits.get(item.key)
        if central is not None and central.max_running is not None:
            return central
        own = KeyLimit(max_running=item.key_limit)
        if central is None:
            return own
        return KeyLimit(item.key_limit, central.max_starts, central.window_s)

    def _why(self, task_id: int) -> tuple[str, str] | None:
        item = self.tasks.get(task_id)
        if item is None:
            return None
        quota = self.quotas.get(item.owner)
        if quota is not None:
            over = over_quota(quota, self.use.get(item.owner, Use()), item.request)
            if over is not None:
                return "quota", f"owner at quota ({over})"
        team_quota = self.team_quotas.get(item.team) if item.team is not None else None
        if team_quota is not None and item.team is not None:
            over = over_quota(team_quota, self.team_use.get(item.team, Use()), item.request)
            if over is not None:
                return "quota", f"team {item.team} at quota ({over})"
        if item.key is None:
            return None
        limit = self._limit(item)
        use = self.keys.get(item.key, KeyUse())
        reason = key_held(item.key, limit, use)
        if reason is None:
            return None
        running_full = limit.max_running is not None and use.running >= limit.max_running
        return ("concurrency" if running_full else "rate"), reason

    def held(self, task_id: int) -> str | None:
        why = self._why(task_id)
        return why[1] if why else None

    def admit(self, task_id: int) -> bool:
        why = self._why(task_id)
        if why is not None:
            self.refused[why[0]] += 1
            return False
        item = self.tasks.get(task_id)
        if item is None:
            return True
        if item.owner in self.quotas:
            _take(self.use.setdefault(item.owner, Use()), item.request)
        if item.team is not None and item.team in self.team_quotas:
            _take(self.team_use.setdefault(item.team, Use()), item.request)
        if item.key is not None:
            key = self.keys.setdefault(item.key, KeyUse())
            key.running += 1
            key.started += 1
        return True


def _take(use: Use, request: Amount) -> None:
    use.running += 1
    use.cpu += request.cpu
    use.memory_mb += request.memory_mb
    use.devices.update(dict(request.devices))


def fair_stamp(
    last: float | None, head: float | None, now: float, step: float, pushed: float = 0.0
) -> float:
    """A new task's fair-share stamp (core's submit computes the same in SQL): one
    ``step`` (the quantum over the owner's weight) after the owner's last waiting stamp;
    an owner with nothing waiting starts at the queue's head stamp, or now if that is
    earlier, so it interleaves with any backlog instead of queueing behind it. In a
    queue that weighs usage, a flow ``pushed`` back (``usage_push_back``) is stamped no
    earlier than that long after now (where work with no usage starts)."""
    if pushed > 0:
        return max(last + step, now + pushed) if last is not None else now + pushed
    if last is not None:
        return last + step
    return min(now, head) if head is not None else now


#: fair share's default half-life (``CAIRN_FAIR_SHARE_HALF_LIFE_S``): a week, Slurm's
HALF_LIFE_S = 7 * 86400.0


@dataclass(frozen=True)
class FairShare:
    """How submissions are stamped across flows (docs/sharing.md): by task counts alone
    (``tasks``, the default), or also pushed back by each flow's decayed reserved
    core-seconds (``usage``); a queue's policy may say otherwise."""

    by: str = "tasks"
    half_life_s: float = HALF_LIFE_S
    unit_cpu_s: float = 60.0


def decayed(cpu_s: float, age_s: float, half_life_s: float) -> float:
    """Core-seconds counted ``age_s`` ago, as they weigh now: halved every
    ``half_life_s`` (Slurm's PriorityDecayHalfLife; the roll-up and the submit compute
    the same in SQL, floored at 2^-1000)."""
    return cpu_s * math.pow(2.0, -min(1000.0, max(0.0, age_s) / half_life_s))


def usage_push_back(used_cpu_s: float, weight: float, step: float, unit_cpu_s: float) -> float:
    """How far behind the queue's head a flow's new work is stamped in a queue that
    weighs usage: one ``step`` (the quantum) per ``unit_cpu_s`` of its decayed usage,
    over its weight (core's submit computes the same in SQL)."""
    return step * used_cpu_s / (unit_cpu_s * weight)


def aging_boost(waited_past_turn_s: float, aging_s: float, most: int) -> int:
    """Priority levels a task gains for waiting past its fair turn: one per ``aging_s``,
    at most ``most``."""
    if waited_past_turn_s <= 0:
        return 0
    return min(most, int(waited_past_turn_s // aging_s))


# --- policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    field: str
    detail: str


class Asked(Protocol):
    """What a queue's policy reads of a submission or of a stored task (at retry)."""

    @property
    def queue(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def preemptible(self) -> bool: ...


def refusal(policy: QueuePolicy, role: str, owner: str, spec: Asked, where: str) -> Refusal | None:
    """Why ``spec``, submitted by ``role`` for ``owner``, is outside the queue's policy;
    None when it is inside. ``where`` is the spec's place in the body (``body``)."""
    queue = spec.queue
    if policy.owners is not None and owner not in policy.owners:
        return Refusal(f"{where}.queue", f"queue {queue} does not admit owner {owner}")
    span = policy.priority.get(role)  # type: ignore[call-overload]
    if span is not None and not span.min <= spec.priority <= span.max:
        return Refusal(
            f"{where}.priority",
            f"queue {queue} lets the {role} role use priorities {span.min}..{span.max}, "
            f"not {spec.priority}",
        )
    if role != "user":
        return None
    if spec.kind == "service" and not policy.services:
        return Refusal(f"{where}.kind", f"queue {queue} does not let users submit services")
    if not spec.preemptible and not policy.guaranteed:
        return Refusal(
            f"{where}.preemptible",
            f"queue {queue} takes only preemptible work from users (set preemptible: true)",
        )
    return None


def weights_share(weight: float, active: Iterable[float]) -> float:
    """An owner's share of the pool: its weight over the weights of the active owners
    (itself counted once even if idle)."""
    total = sum(active)
    return weight / total if total > 0 else 1.0
