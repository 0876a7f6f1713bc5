"""``cairn sim TRACE``: replay a trace of submissions on a simulated cluster and clock,
placing with the same functions as core (``services.core.domain.placement``), and report
utilisation, waits, preemptions and guaranteed-work delays.

How it models core: an idle worker claims a new submission at once; a worker whose
attempt ends claims from the head of the waiting line (best first, as deep as core's
claim reads: ``domain.placement.claim_depth``); a guaranteed task that fits nowhere for
``preempt_after_s`` gets room made (squeeze, then preemption). Preemption is immediate
(no grace) and a preempted run restarts from the beginning. Real memory above a worker's
capacity (overcommit gone wrong) kills its youngest preemptible attempt, counted as an
OOM kill. CPU beyond capacity slows nothing here: CPU is compressible.

Placement by label as core's claim: a submission's ``required`` selectors
(``services.core.domain.selectors``) against its worker's labels, the cluster's
``labels`` (a list of label maps, dealt to the workers in turn); a run no worker matches
never starts.

Countable devices as core counts them: a submission's ``devices`` (``{"gpu": 1}``) against
its worker's, the cluster's ``devices`` (a list of device maps, dealt to the workers in
turn as labels are); devices are held whole, never overcommitted nor squeezed, and the
report adds each device name's placed share (``placed_<name>``).

With ``fair`` (core's default) the line is ordered as core's claim orders it: priority,
then each owner's fair-share stamp (``domain.sharing.fair_stamp``); without, priority
then arrival. Owners whose name starts with ``flood`` are reported apart, so a trace
with a flood (``cairn trace --flood N``) shows what it does to everyone else's wait.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cairn.trace import FLOOD_OWNER, Submission
from services.core.domain.placement import (
    ZERO,
    Amount,
    Candidate,
    Node,
    Placed,
    best_plan,
    charge,
    choose,
    claim_depth,
    counts,
    decayed_peak,
    held_in_all,
    total,
)
from services.core.domain.selectors import Selector, matches, parse
from services.core.domain.sharing import fair_stamp

MOST = 16
HEAD = claim_depth(MOST)
PLAN_ON = 4


@dataclass(frozen=True)
class Policy:
    """``measured``: preemptible work placed on measured use (else all on requests, as
    without this feature); ``overcommit``: the pool's ratio; ``defer_above``: utilisation
    above which ``defer_ok`` work waits (1: never)."""

    measured: bool = True
    overcommit: float = 1.0
    defer_above: float = 1.0
    preempt_after_s: float = 5.0
    defer_max_s: float = 6 * 3600.0
    fair: bool = True
    quantum_s: float = 1.0


@dataclass
class Run:
    id: int
    sub: Submission
    submitted: float
    started: float | None = None
    attempt_start: float = 0.0
    worker: int | None = None
    cost: Amount = ZERO
    squeezed: bool = False
    attempt: int = 0
    deferred: bool = False
    checks: int = 0
    #: the fair-share stamp (arrival order without fair share)
    vtime: float = 0.0
    #: its required selectors, parsed
    required: tuple[Selector, ...] = ()

    @property
    def guaranteed(self) -> bool:
        return self.sub.kind == "service" or not self.sub.preemptible

    def key(self) -> tuple[int, float, int]:
        return (-self.sub.priority, self.vtime, self.id)


@dataclass
class Worker:
    id: int
    capacity: Amount
    runs: dict[int, Run] = field(default_factory=dict)
    held: Amount = ZERO
    guaranteed: Amount = ZERO
    real_memory_mb: float = 0.0
    real_cpu: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)

    def free(self) -> Amount:
        return self.capacity - self.held

    def takes(self, run: Run) -> bool:
        """Whether its labels meet the run's required selectors (the claim's filter)."""
        return not run.required or matches(run.required, self.labels)

    def node(self) -> Node:
        placed = tuple(
            Placed(
                r.id,
                r.id,
                r.sub.priority,
                not r.guaranteed,
                r.cost,
                r.attempt_start,
                squeezed=r.squeezed,
            )
            for r in self.runs.values()
        )
        return Node(self.id, self.capacity, placed)


def _held(run: Run) -> Amount:
    if run.squeezed:
        return held_in_all(0.0, run.cost.cpu, run.cost.memory_mb, run.cost.devices)
    return run.cost


@dataclass
class Stats:
    waits_guaranteed: list[float] = field(default_factory=list)
    waits_preemptible: list[float] = field(default_factory=list)
    #: waits of everyone but the flooding owner, and of the flood
    waits_others: list[float] = field(default_factory=list)
    waits_flood: list[float] = field(default_factory=list)
    #: the others at the flood's priority (0), whom only fair share can help
    waits_peers: list[float] = field(default_factory=list)
    #: tasks still waiting when the trace ends (their wait so far is counted)
    never_started: int = 0
    preemptions: int = 0
    squeezes: int = 0
    oom_kills: int = 0
    deferred: int = 0
    completed: int = 0
    area: dict[str, float] = field(default_factory=dict)


class Simulator:
    def __init__(self, cluster: dict[str, Any], policy: Policy) -> None:
        cpu, memory_mb = float(cluster["cpu"]), float(cluster["memory_mb"])
        labels = cluster.get("labels") or [{}]
        devices = cluster.get("devices") or [{}]
        self.workers = [
            Worker(
                i,
                Amount(cpu, memory_mb, counts(devices[i % len(devices)])),
                labels=dict(labels[i % len(labels)]),
            )
            for i in range(int(cluster["workers"]))
        ]
        self.capacity = total(w.capacity for w in self.workers)
        self.policy = policy
        self.now = 0.0
        self.waiting: list[tuple[int, float, int]] = []  # run keys, best first
        # Fair share: each owner's waiting stamps (ids by stamp), the line's stamps.
        self.owner_stamps: dict[str, list[tuple[float, int]]] = {}
        self.stamps: list[tuple[float, int]] = []
        self.events: list[tuple[float, int, str, int, int]] = []
        self.runs: dict[int, Run] = {}
        self.peaks: dict[tuple[str, str], Amount] = {}
        self.stats = Stats()
        self._seq = itertools.count()
        self._last = 0.0

    # --- the clock ---

    def _at(self, when: float, what: str, run: Run) -> None:
        heapq.heappush(self.events, (when, next(self._seq), what, run.id, run.attempt))

    def _advance(self, to: float) -> None:
        dt = to - self._last
        if dt > 0:
            held = Amount(
                sum(w.held.cpu for w in self.workers), sum(w.held.memory_mb for w in self.workers)
            )
            real_cpu = sum(min(w.real_cpu, w.capacity.cpu) for w in self.workers)
            real_memory = sum(w.real_memory_mb for w in self.workers)
            devices = total(w.held for w in self.workers).devices
            for name, value in (
                ("held_cpu", held.cpu),
                ("held_memory", held.memory_mb),
                ("real_cpu", real_cpu),
                ("real_memory", real_memory),
                *((f"held_device_{device}", float(n)) for device, n in devices),
            ):
                self.stats.area[name] = self.stats.area.get(name, 0.0) + value * dt
            self._last = to
        self.now = to

    def run(self, submissions: Iterator[Submission]) -> Stats:
        for number, sub in enumerate(submissions):
            while self.events and self.events[0][0] <= sub.t:
                self._event(heapq.heappop(self.events))
            self._advance(sub.t)
            self._arrive(Run(number, sub, sub.t))
        end = max((r.submitted for r in self.runs.values()), default=0.0)
        while self.events and self.events[0][0] <= end:
            self._event(heapq.heappop(self.events))
        self._advance(end)
        self.stats.area["seconds"] = end
        for run in self.runs.values():
            if run.started is None:
                # Still waiting at the end: what it waited so far is a floor on its wait.
                self.stats.never_started += 1
                self._count_wait(run, end - run.submitted)
        return self.stats

    def _event(self, event: tuple[float, int, str, int, int]) -> None:
        when, _, what, run_id, attempt = event
        self._advance(when)
        run = self.runs.get(run_id)
        if run is None or run.attempt != attempt:
            return
        if what == "end":
            self._end(run)
        elif what == "check" and run.worker is None:
            self._make_room(run)
        elif what == "wake" and run.worker is None:
            self._place_anywhere(run)

    # --- placement, through core's functions ---

    def _candidate(self, run: Run) -> Candidate:
        sub = run.sub
        preemptible = self.policy.measured and not run.guaranteed
        return Candidate(
            task_id=run.id,
            priority=sub.priority,
            preemptible=preemptible,
            request=Amount(sub.cpu, sub.memory_mb, counts(sub.devices)),
            measured=self.peaks.get((sub.owner, sub.name)) if preemptible else None,
            overcommit=self.policy.overcommit,
        )

    def _hot(self) -> bool:
        if self.policy.defer_above >= 1.0:
            return False
        held = Amount(
            sum(w.held.cpu for w in self.workers), sum(w.held.memory_mb for w in self.workers)
        )
        return held.largest_share_of(self.capacity) > self.policy.defer_above

    def _held_back(self, run: Run, hot: bool) -> bool:
        """Deferred: time-insensitive, its pool busy, its latest start not reached."""
        if not (hot and run.sub.defer_ok):
            return False
        latest = run.submitted + self.policy.defer_max_s
        if self.now >= latest:
            return False
        if not run.deferred:
            run.deferred = True
            self.stats.deferred += 1
            self._at(latest, "wake", run)
        return True

    def _stamp(self, run: Run) -> None:
        if not self.policy.fair:
            run.vtime = run.submitted
            return
        mine = self.owner_stamps.setdefault(run.sub.owner, [])
        last = mine[-1][0] if mine else None
        head = self.stamps[0][0] if self.stamps else None
        run.vtime = fair_stamp(last, head, self.now, self.policy.quantum_s)

    def _enqueue(self, run: Run) -> None:
        bisect.insort(self.waiting, run.key())
        if self.policy.fair:
            bisect.insort(self.owner_stamps.setdefault(run.sub.owner, []), (run.vtime, run.id))
            bisect.insort(self.stamps, (run.vtime, run.id))

    def _dequeue(self, run: Run) -> None:
        del self.waiting[bisect.bisect_left(self.waiting, run.key())]
        if self.policy.fair:
            entry = (run.vtime, run.id)
            mine = self.owner_stamps[run.sub.owner]
            del mine[bisect.bisect_left(mine, entry)]
            del self.stamps[bisect.bisect_left(self.stamps, entry)]

    def _arrive(self, run: Run) -> None:
        self.runs[run.id] = run
        run.required = tuple(parse(text) for text in run.sub.required)
        self._stamp(run)
        self._enqueue(run)
        self._place_anywhere(run)
        if run.worker is None and run.guaranteed and self.policy.measured:
            self._at(self.now + self.policy.preempt_after_s, "check", run)

    def _place_anywhere(self, run: Run) -> None:
        if self._held_back(run, self._hot()):
            return
        candidate = self._candidate(run)
        for worker in self.workers:
            if worker.takes(run) and choose(worker.free(), [candidate], 1):
                self._start(run, worker, charge(candidate))
                return

    def _claim(self, worker: Worker) -> None:
        """What the worker's claim would lease: the head of the line that fits."""
        hot = self._hot()
        line = (self.runs[key[2]] for key in itertools.islice(self.waiting, HEAD * 2))
        head = [r for r in line if worker.takes(r) and not self._held_back(r, hot)]
        candidates = [self._candidate(r) for r in head[:HEAD]]
        for candidate, cost in choose(worker.free(), candidates, MOST):
            self._start(self.runs[candidate.task_id], worker, cost)

    def _start(self, run: Run, worker: Worker, cost: Amount) -> None:
        self._dequeue(run)
        if run.started is None:
            run.started = self.now
            waits = self.stats.waits_guaranteed if run.guaranteed else self.stats.waits_preemptible
            waits.append(self.now - run.submitted)
            self._count_wait(run, self.now - run.submitted)
        run.worker, run.cost, run.attempt_start = worker.id, cost, self.now
        worker.runs[run.id] = run
        worker.held = worker.held + cost
        if run.guaranteed:
            worker.guaranteed = worker.guaranteed + cost
        worker.real_memory_mb += run.sub.use_memory_mb
        worker.real_cpu += run.sub.use_cpu
        self._at(self.now + run.sub.duration_s, "end", run)
        self._out_of_memory(worker)

    def _count_wait(self, run: Run, waited: float) -> None:
        if run.sub.owner.startswith(FLOOD_OWNER):
            self.stats.waits_flood.append(waited)
            return
        self.stats.waits_others.append(waited)
        if run.sub.priority == 0:
            self.stats.waits_peers.append(waited)

    def _stop(self, run: Run) -> Worker:
        worker = self.workers[run.worker or 0]
        del worker.runs[run.id]
        worker.held = worker.held - _held(run)
        if run.guaranteed:
            worker.guaranteed = worker.guaranteed - run.cost
        worker.real_memory_mb -= run.sub.use_memory_mb
        worker.real_cpu -= run.sub.use_cpu
        run.worker, run.squeezed, run.attempt = None, False, run.attempt + 1
        return worker

    def _requeue(self, run: Run) -> None:
        self._stop(run)
        self._enqueue(run)

    def _end(self, run: Run) -> None:
        worker = self._stop(run)
        self.stats.completed += 1
        kind = (run.sub.owner, run.sub.name)
        old = self.peaks.get(kind)
        self.peaks[kind] = Amount(
            decayed_peak(old.cpu if old else None, run.sub.use_cpu),
            decayed_peak(old.memory_mb if old else None, run.sub.use_memory_mb),
        )
        self._claim(worker)

    def _out_of_memory(self, worker: Worker) -> None:
        while worker.real_memory_mb > worker.capacity.memory_mb:
            victims = [r for r in worker.runs.values() if not r.guaranteed]
            if not victims:
                return
            youngest = max(victims, key=lambda r: (r.attempt_start, r.id))
            self.stats.oom_kills += 1
            self._requeue(youngest)

    def _make_room(self, run: Run) -> None:
        need = Amount(run.sub.cpu, run.sub.memory_mb, counts(run.sub.devices))
        serving = [w for w in self.workers if w.takes(run)]
        if any(need.fits_in(w.free()) for w in serving):
            self._place_anywhere(run)
            return
        # Only workers whose guaranteed work leaves room for it can make any; of those,
        # the few with the most room once preemptible work is gone are planned on (at
        # this scale, planning on every worker for every blocked task is the slow part).
        able = [w for w in serving if (w.guaranteed + need).fits_in(w.capacity)]
        able.sort(key=lambda w: w.guaranteed.largest_share_of(w.capacity))
        plan = best_plan((w.node() for w in able[:PLAN_ON]), need)
        if plan is None:
            run.checks += 1
            wait = self.policy.preempt_after_s * 2 ** min(run.checks, 4)
            self._at(self.now + wait, "check", run)
            return
        worker = self.workers[plan.worker_id]
        for victim_id in plan.squeeze:
            victim = worker.runs[victim_id]
            victim.squeezed = True
            worker.held = worker.held - victim.cost + _held(victim)
            self.stats.squeezes += 1
        for victim_id in plan.preempt:
            self.stats.preemptions += 1
            self._requeue(worker.runs[victim_id])
        self._start(run, worker, need)
        self._claim(worker)


def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def report(stats: Stats, capacity: Amount) -> dict[str, float]:
    seconds = stats.area.get("seconds", 0.0) or 1.0
    waits = stats.waits_guaranteed + stats.waits_preemptible
    return {
        "placed_cpu": stats.area.get("held_cpu", 0.0) / seconds / capacity.cpu,
        "placed_memory": stats.area.get("held_memory", 0.0) / seconds / capacity.memory_mb,
        "used_cpu": stats.area.get("real_cpu", 0.0) / seconds / capacity.cpu,
        "used_memory": stats.area.get("real_memory", 0.0) / seconds / capacity.memory_mb,
        "wait_p50_s": percentile(waits, 0.5),
        "wait_p99_s": percentile(waits, 0.99),
        "guaranteed_wait_p50_s": percentile(stats.waits_guaranteed, 0.5),
        "guaranteed_wait_p99_s": percentile(stats.waits_guaranteed, 0.99),
        "guaranteed_wait_max_s": max(stats.waits_guaranteed, default=0.0),
        "preemptible_wait_p50_s": percentile(stats.waits_preemptible, 0.5),
        "preemptible_wait_p99_s": percentile(stats.waits_preemptible, 0.99),
        "others_wait_p50_s": percentile(stats.waits_others, 0.5),
        "others_wait_p99_s": percentile(stats.waits_others, 0.99),
        "peers_wait_p50_s": percentile(stats.waits_peers, 0.5),
        "peers_wait_p99_s": percentile(stats.waits_peers, 0.99),
        "never_started": float(stats.never_started),
        "flood_wait_p50_s": percentile(stats.waits_flood, 0.5),
        "flood_tasks": float(len(stats.waits_flood)),
        "started": float(len(waits)),
        "completed": float(stats.completed),
        "preemptions": float(stats.preemptions),
        "squeezes": float(stats.squeezes),
        "oom_kills": float(stats.oom_kills),
        "deferred": float(stats.deferred),
        **{
            f"placed_{name}": stats.area.get(f"held_device_{name}", 0.0) / seconds / n
            for name, n in capacity.devices
        },
    }


def simulate(
    meta: dict[str, Any], submissions: Iterator[Submission], policy: Policy
) -> dict[str, float]:
    simulator = Simulator(meta["cluster"], policy)
    return report(simulator.run(submissions), simulator.capacity)


def render(meta: dict[str, Any], policy: Policy, figures: dict[str, float]) -> str:
    """The report as text."""
    cluster = meta["cluster"]
    devices = {name for offered in cluster.get("devices") or [] for name in offered}
    mode = (
        f"measured use, overcommit {policy.overcommit:g}"
        if policy.measured
        else "declared requests (no overcommit)"
    )
    if policy.defer_above < 1:
        mode += f", defer above {policy.defer_above:.0%}"
    mode += "; fair share " + ("on" if policy.fair else "off")
    f = figures
    flood = (
        [
            f"others (all but the flood) wait p50/p99: {f['others_wait_p50_s']:.1f}/"
            f"{f['others_wait_p99_s']:.1f} s; at the flood's priority "
            f"{f['peers_wait_p50_s']:.1f}/{f['peers_wait_p99_s']:.1f} s; the flood's p50 "
            f"{f['flood_wait_p50_s']:.0f} s ({f['flood_tasks']:.0f} tasks); "
            f"{f['never_started']:.0f} never started"
        ]
        if f["flood_tasks"]
        else []
    )
    return "\n".join(
        [
            f"cluster: {cluster['workers']} workers x {cluster['cpu']:g} CPU / "
            f"{cluster['memory_mb'] // 1024} GB; placement: {mode}",
            f"placed (held/capacity): CPU {f['placed_cpu']:.0%}, memory {f['placed_memory']:.0%}"
            + "".join(f", {k[7:]} {v:.0%}" for k, v in f.items() if k[7:] in devices),
            f"used (real/capacity):   CPU {f['used_cpu']:.0%}, memory {f['used_memory']:.0%}",
            f"wait p50/p99: all {f['wait_p50_s']:.1f}/{f['wait_p99_s']:.0f} s; guaranteed "
            f"{f['guaranteed_wait_p50_s']:.1f}/{f['guaranteed_wait_p99_s']:.0f} s "
            f"(max {f['guaranteed_wait_max_s']:.0f}); preemptible "
            f"{f['preemptible_wait_p50_s']:.1f}/{f['preemptible_wait_p99_s']:.0f} s",
            f"started {f['started']:.0f}, completed {f['completed']:.0f}; preemptions "
            f"{f['preemptions']:.0f}, squeezes {f['squeezes']:.0f}, OOM kills "
            f"{f['oom_kills']:.0f}, deferred {f['deferred']:.0f}",
            *flood,
        ]
    )
