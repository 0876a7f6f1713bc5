"""Placement by fit, with no I/O: the claim path, the placement pass and the simulator all
decide with these functions.

Each attempt placed on a worker holds a *charge* against the worker's capacity, fixed when
it is placed. Guaranteed work (services, non-preemptible tasks) is charged its declared
request. Preemptible work is charged what its kind (owner, task name) measurably used
before, a decaying peak (the request until there is history), divided by its pool's
overcommit ratio. Guaranteed work is never placed on overcommitted room: when it fits
nowhere, preemptible attempts are squeezed (CPU is compressible), then preempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from libs.common.placement import SQUEEZED_CPU_SHARE

#: each new measurement replaces the peak, or the old peak shrinks by this factor
DECAY = 0.9
#: a preemptible attempt is never charged less than this share of its request
MIN_CHARGE_SHARE = 0.1
_EPS = 1e-9


#: countable devices by name, as sorted (name, count) pairs (``counts``): a request, a
#: charge, a worker's capacity or what is left of it (a count may go below zero there)
Counts = tuple[tuple[str, int], ...]


def counts(mapping: Mapping[str, int] | None) -> Counts:
    """Device counts as ``Amount`` keeps them: sorted, zeros left out."""
    if not mapping:
        return ()
    return tuple(sorted((name, int(n)) for name, n in mapping.items() if n))


def summed(maps: Iterable[Mapping[str, int]] | None) -> Counter[str]:
    """Device counts added up by name (the ``jsonb_agg`` of requests or charges)."""
    out: Counter[str] = Counter()
    for devices in maps or ():
        out.update(devices)
    return out


def _merged(mine: Counts, theirs: Counts, sign: int) -> Counts:
    if not theirs:
        return mine
    out = dict(mine)
    for name, n in theirs:
        out[name] = out.get(name, 0) + sign * n
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Amount:
    """CPU (cores), memory (MB) and whole devices by name (``devices``, ``counts``).
    Devices are never overcommitted nor squeezed: ``scaled`` leaves them."""

    cpu: float
    memory_mb: float
    devices: Counts = ()

    def __add__(self, other: Amount) -> Amount:
        return Amount(
            self.cpu + other.cpu,
            self.memory_mb + other.memory_mb,
            _merged(self.devices, other.devices, 1),
        )

    def __sub__(self, other: Amount) -> Amount:
        return Amount(
            self.cpu - other.cpu,
            self.memory_mb - other.memory_mb,
            _merged(self.devices, other.devices, -1),
        )

    def scaled(self, factor: float) -> Amount:
        return Amount(self.cpu * factor, self.memory_mb * factor, self.devices)

    def device(self, name: str) -> int:
        return dict(self.devices).get(name, 0)

    def short_of(self, room: Amount) -> list[str]:
        """What of this does not fit ``room``: ``cpu``, ``memory``, device names."""
        short = [name for name, n in self.devices if n > room.device(name)]
        if self.memory_mb > room.memory_mb + _EPS:
            short.insert(0, "memory")
        if self.cpu > room.cpu + _EPS:
            short.insert(0, "cpu")
        return short

    def fits_in(self, room: Amount) -> bool:
        if self.cpu > room.cpu + _EPS or self.memory_mb > room.memory_mb + _EPS:
            return False
        return not self.devices or all(n <= room.device(name) for name, n in self.devices)

    def largest_share_of(self, whole: Amount) -> float:
        """The fullest of the resources, as a share of ``whole``."""
        shares = [
            self.cpu / whole.cpu if whole.cpu > 0 else 0.0,
            self.memory_mb / whole.memory_mb if whole.memory_mb > 0 else 0.0,
        ]
        shares += [n / whole.device(name) for name, n in self.devices if whole.device(name) > 0]
        return max(shares)


ZERO = Amount(0.0, 0.0)


def total(amounts: Iterable[Amount]) -> Amount:
    out = ZERO
    for amount in amounts:
        out = out + amount
    return out


@dataclass(frozen=True)
class Placed:
    """An attempt running on a worker. ``started`` is any clock's seconds (larger:
    younger); ``preempted`` means it has been told to stop and will free its room."""

    attempt_id: int
    task_id: int
    priority: int
    preemptible: bool
    charge: Amount
    started: float
    squeezed: bool = False
    preempted: bool = False

    @property
    def held(self) -> Amount:
        """What it counts for now: a squeezed attempt keeps its memory, little CPU."""
        if self.squeezed:
            return held_in_all(0.0, self.charge.cpu, self.charge.memory_mb, self.charge.devices)
        return self.charge


# Candidates a claim locks beyond what it may lease, for those that placement or a quota
# refuses: up to three per lease for a small claim, at most this many for a large one
# (each candidate is a row lock, and rows one claim locks the others skip).
CANDIDATE_SLACK = 32


def claim_depth(most: int) -> int:
    """How many of the best waiting rows a claim for ``most`` leases reads and locks."""
    return most + min(3 * most, CANDIDATE_SLACK)


def held_in_all(cpu: float, squeezed_cpu: float, memory_mb: float, devices: Counts = ()) -> Amount:
    """What attempts hold together, from their charges summed: ``cpu`` of those running
    as charged, ``squeezed_cpu`` of the squeezed (who keep little of it), all their
    memory and devices."""
    return Amount(cpu + squeezed_cpu * SQUEEZED_CPU_SHARE, memory_mb, devices)


@dataclass(frozen=True)
class Node:
    """A live worker: its capacity and what is placed on it: the attempts ``placed``,
    one by one, and what the others hold in all (``rest``, summed by the database, for
    a decision that needs only the worker's room). A plan that picks attempts to squeeze
    or preempt is made on a node that lists every one (``rest`` zero)."""

    worker_id: int
    capacity: Amount
    placed: tuple[Placed, ...] = ()
    queues: frozenset[str] = frozenset()
    rest: Amount = ZERO
    #: its labels, as (key, value) pairs (``label_map``), for placement by label
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def used(self) -> Amount:
        return self.rest + total(p.held for p in self.placed)

    def free(self) -> Amount:
        return self.capacity - self.used()

    def guaranteed(self) -> Amount:
        return total(p.charge for p in self.placed if not p.preemptible)

    def with_placed(self, *more: Placed) -> Node:
        return replace(self, placed=self.placed + more)


@dataclass(frozen=True)
class Candidate:
    """A waiting task as placement sees it; ``measured`` is its kind's decayed peak."""

    task_id: int
    priority: int
    preemptible: bool
    request: Amount
    measured: Amount | None = None
    overcommit: float = 1.0


def charge(candidate: Candidate) -> Amount:
    """What the candidate will hold against a worker's capacity once placed."""
    if not candidate.preemptible:
        return candidate.request
    seen = candidate.measured or candidate.request
    floor = candidate.request.scaled(MIN_CHARGE_SHARE)
    base = Amount(
        max(seen.cpu, floor.cpu), max(seen.memory_mb, floor.memory_mb), candidate.request.devices
    )
    return base.scaled(1.0 / max(1.0, candidate.overcommit))


def decayed_peak(old: float | None, sample: float) -> float:
    """The new peak of a kind of task after one more measured attempt."""
    return sample if old is None else max(sample, old * DECAY)


class Admission(Protocol):
    """Whether a candidate that fits may start (quotas, concurrency keys); admitting it
    takes its share of those limits."""

    def admit(self, task_id: int) -> bool: ...


def choose(
    room: Amount, candidates: Iterable[Candidate], most: int, gate: Admission | None = None
) -> list[tuple[Candidate, Amount]]:
    """Candidates (in the order given: reserved, then priority and fair share) whose
    charges fit the room left and that ``gate`` admits, each with its charge; at most
    ``most``."""
    chosen: list[tuple[Candidate, Amount]] = []
    for candidate in candidates:
        if len(chosen) == most:
            break
        cost = charge(candidate)
        if cost.fits_in(room) and (gate is None or gate.admit(candidate.task_id)):
            chosen.append((candidate, cost))
            room = room - cost
    return chosen


@dataclass(frozen=True)
class Plan:
    """How to make room for guaranteed work on one worker: attempts to squeeze (lower
    CPU share) and attempts to preempt (stop and requeue)."""

    worker_id: int
    squeeze: tuple[int, ...]
    preempt: tuple[int, ...]


def _victims(node: Node) -> list[Placed]:
    """Preemptible attempts, lowest priority first, youngest first among equals."""
    live = [p for p in node.placed if p.preemptible and not p.preempted]
    return sorted(live, key=lambda p: (p.priority, -p.started, -p.attempt_id))


def make_room(node: Node, need: Amount) -> Plan | None:
    """Squeeze for a CPU shortfall, preempt for memory (or CPU still short), until ``need``
    fits; None when even with every preemptible attempt gone it would not. A node where
    it fits already needs an empty plan."""
    if node.rest != ZERO:
        raise ValueError("a plan needs every attempt on the node listed")
    standing = [p for p in node.placed if not p.preempted]
    guaranteed = total(p.charge for p in standing if not p.preemptible)
    if not (guaranteed + need).fits_in(node.capacity):
        return None
    free = node.capacity - total(p.held for p in standing)
    victims = _victims(node)
    squeezed: list[Placed] = []
    for victim in victims:
        if free.cpu + _EPS >= need.cpu:
            break
        if not victim.squeezed:
            freed = victim.charge.cpu * (1 - SQUEEZED_CPU_SHARE)
            free = free + Amount(freed, 0.0)
            squeezed.append(victim)
    preempted: list[Placed] = []
    for victim in victims:
        if need.fits_in(free):
            break
        if not _helps(victim.charge, need.short_of(free)):
            continue  # it holds none of what is short (a GPU, when only GPUs are)
        charged = victim.charge
        now_held = (
            held_in_all(0.0, charged.cpu, charged.memory_mb, charged.devices)
            if victim.squeezed or victim in squeezed
            else charged
        )
        free = free + now_held
        preempted.append(victim)
    if not need.fits_in(free):
        return None
    return Plan(
        worker_id=node.worker_id,
        squeeze=tuple(v.attempt_id for v in squeezed if v not in preempted),
        preempt=tuple(v.attempt_id for v in preempted),
    )


def _helps(held: Amount, short: list[str]) -> bool:
    """Whether freeing ``held`` gives back any of the ``short`` resources."""
    return any(
        (name == "cpu" and held.cpu > 0)
        or (name == "memory" and held.memory_mb > 0)
        or held.device(name) > 0
        for name in short
    )


def best_plan(nodes: Iterable[Node], need: Amount) -> Plan | None:
    """The cheapest way to fit ``need`` on one of ``nodes``: fewest preemptions, then
    fewest squeezes, then the most room left."""
    plans: list[tuple[int, int, float, Plan]] = []
    for node in nodes:
        plan = make_room(node, need)
        if plan is not None:
            slack = -node.free().largest_share_of(node.capacity)
            plans.append((len(plan.preempt), len(plan.squeeze), slack, plan))
    if not plans:
        return None
    return min(plans, key=lambda entry: entry[:3])[3]


def utilisation(nodes: Iterable[Node]) -> float:
    """How full a pool is: held over capacity, of the fuller of CPU and memory, from 0
    to 1 (or above, when overcommitted)."""
    pool = list(nodes)
    capacity = total(n.capacity for n in pool)
    if capacity.cpu <= 0 or capacity.memory_mb <= 0:
        return 0.0
    used = total(n.used() for n in pool)
    # Devices left out: a pool whose GPUs are all taken is not full for CPU-only work.
    return Amount(used.cpu, used.memory_mb).largest_share_of(capacity)


def largest_free(nodes: Iterable[Node], need: Amount) -> Amount | None:
    """The free room, among ``nodes``, that comes closest to holding ``need``."""

    def closeness(free: Amount) -> float:
        ratios = [free.cpu / max(need.cpu, _EPS), free.memory_mb / max(need.memory_mb, _EPS)]
        ratios += [free.device(name) / n for name, n in need.devices]
        return min(ratios)

    rooms = [n.free() for n in nodes]
    return max(rooms, key=closeness) if rooms else None
