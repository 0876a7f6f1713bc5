"""A workload trace built from the design documents' figures, for ``cairn sim``.

10,000 people submit about 100 tasks each a day; arrivals follow the working day and
spike to hundreds a second on the hour (cron); memory is over-declared about 3x; a share
of what runs is long-running services. Each line of the trace is one submission (JSON),
after a first line that describes the trace and a cluster that fits it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

DAY_S = 86400.0
#: the owner of a trace's flood (and the prefix ``cairn sim`` reports apart)
FLOOD_OWNER = "flood"
MEMORY_CHOICES = (512, 1024, 2048, 4096, 8192)
CPU_CHOICES = (0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Submission:
    """One task as submitted (declared) and as it will behave (real use, duration)."""

    t: float
    owner: str
    name: str
    kind: str
    preemptible: bool
    defer_ok: bool
    priority: int
    cpu: float
    memory_mb: int
    use_cpu: float
    use_memory_mb: float
    duration_s: float
    #: required selectors of the workers' labels (``disk=ssd``: docs/placement.md)
    required: tuple[str, ...] = ()
    #: countable devices it asks for (``{"gpu": 1}``: docs/placement.md, "Devices")
    devices: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Shape:
    """The documents' figures, as the generator's knobs."""

    users: int = 10_000
    tasks_per_user: float = 100.0
    hours: float = 24.0
    #: the bursts' rate; None: 500 a second per 10,000 users
    peak_qps: float | None = None
    over_declared: float = 3.0
    service_share: float = 0.05
    preemptible_share: float = 0.4
    kinds_per_user: int = 5
    seed: int = 7
    #: one owner's backfill: this many tasks submitted at once, ``flood_at_s`` in
    flood_tasks: int = 0
    flood_at_s: float = 600.0


@dataclass(frozen=True)
class Kind:
    owner: str
    name: str
    preemptible: bool
    defer_ok: bool
    priority: int
    cpu: float
    memory_mb: int
    use_cpu: float
    use_memory_mb: float
    median_s: float


def _kind(rng: random.Random, owner: str, index: int, shape: Shape) -> Kind:
    memory = rng.choice(MEMORY_CHOICES)
    cpu = rng.choice(CPU_CHOICES)
    preemptible = rng.random() < shape.preemptible_share
    # Memory over-declared about ``over_declared`` times (log-normal around it).
    ratio = max(1.0, rng.lognormvariate(math.log(shape.over_declared), 0.35))
    return Kind(
        owner=owner,
        name=f"{'batch' if preemptible else 'job'}-{index}",
        preemptible=preemptible,
        defer_ok=preemptible and rng.random() < 0.5,
        priority=rng.choice((-10, 0, 0, 0, 10)),
        cpu=cpu,
        memory_mb=memory,
        use_cpu=cpu * rng.uniform(0.1, 0.6),
        use_memory_mb=memory / ratio,
        median_s=rng.lognormvariate(math.log(60), 1.0),
    )


BURST_S = 10.0


def _rate(t: float, shape: Shape) -> float:
    """Submissions a second at ``t``: a working-day curve (busiest mid-afternoon, quiet
    at night) plus ``BURST_S``-second bursts at ``peak_qps`` on every hour, together
    averaging ``users * tasks_per_user`` a day."""
    daily = shape.users * shape.tasks_per_user
    peak = _peak(shape)
    base = max(0.0, daily - peak * BURST_S * 24) / DAY_S
    hour = (t % DAY_S) / 3600.0
    day = 1.0 + 0.8 * math.sin((hour - 9.0) / 24.0 * 2 * math.pi)
    burst = peak if t % 3600.0 < BURST_S else 0.0
    return base * day + burst


def _peak(shape: Shape) -> float:
    return shape.peak_qps if shape.peak_qps is not None else 500.0 * shape.users / 10_000


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _services(rng: random.Random, shape: Shape, kinds: list[Kind]) -> Iterator[Submission]:
    """Long-running services: started at the beginning, running for the whole trace."""
    count = round(shape.users * shape.service_share)
    for i in range(count):
        memory = rng.choice(MEMORY_CHOICES[1:])
        cpu = rng.choice(CPU_CHOICES[:3])
        ratio = max(1.0, rng.lognormvariate(math.log(shape.over_declared), 0.35))
        yield Submission(
            t=rng.uniform(0, 60),
            owner=kinds[rng.randrange(len(kinds))].owner,
            name=f"service-{i}",
            kind="service",
            preemptible=False,
            defer_ok=False,
            priority=10,
            cpu=cpu,
            memory_mb=memory,
            use_cpu=cpu * rng.uniform(0.1, 0.5),
            use_memory_mb=memory / ratio,
            duration_s=shape.hours * 3600.0,
        )


def _run_of(rng: random.Random, kind: Kind, t: float) -> Submission:
    noise = rng.lognormvariate(0, 0.15)
    return Submission(
        t=round(t, 3),
        owner=kind.owner,
        name=kind.name,
        kind="task",
        preemptible=kind.preemptible,
        defer_ok=kind.defer_ok,
        priority=kind.priority,
        cpu=kind.cpu,
        memory_mb=kind.memory_mb,
        use_cpu=round(kind.use_cpu * noise, 3),
        use_memory_mb=round(min(kind.memory_mb, kind.use_memory_mb * noise), 1),
        duration_s=round(min(4 * 3600.0, rng.lognormvariate(math.log(kind.median_s), 0.5)), 1),
    )


def _flood(rng: random.Random, shape: Shape, second: int) -> Iterator[Submission]:
    """The flood, if it falls in this second: one owner's tasks, all at once (a batch
    submit takes 30,000 a second), guaranteed, at priority 0, each as large as the largest
    others ask for (so that the room one frees fits anyone's task: what a comparison
    shows is the order of the line, not fragmentation)."""
    if not shape.flood_tasks or int(shape.flood_at_s) != second:
        return
    base = _kind(rng, FLOOD_OWNER, 0, shape)
    kind = replace(
        base,
        preemptible=False,
        defer_ok=False,
        priority=0,
        cpu=max(CPU_CHOICES),
        memory_mb=max(MEMORY_CHOICES),
        use_cpu=max(CPU_CHOICES) * 0.4,
        use_memory_mb=max(MEMORY_CHOICES) / shape.over_declared,
    )
    for i in range(shape.flood_tasks):
        yield _run_of(rng, kind, second + i / 30_000)


def generate(shape: Shape) -> Iterator[Submission]:
    """Submissions in time order: services first, then runs second by second (with the
    flood, if any, in its second)."""
    rng = random.Random(shape.seed)  # noqa: S311 - a workload, not a secret
    kinds = [
        _kind(rng, f"user{u:05d}", k, shape)
        for u in range(shape.users)
        for k in range(shape.kinds_per_user)
    ]
    yield from sorted(_services(rng, shape, kinds), key=lambda s: s.t)
    for second in range(60, int(shape.hours * 3600)):
        arrivals = sorted(rng.random() for _ in range(_poisson(rng, _rate(second, shape))))
        flood = list(_flood(rng, shape, second))
        runs = [_run_of(rng, kinds[rng.randrange(len(kinds))], second + o) for o in arrivals]
        yield from sorted([*flood, *runs], key=lambda s: s.t)


def cluster_for(shape: Shape) -> dict[str, Any]:
    """Workers of 64 CPU and 256 GB, as many as 1.5 times the day's mean declared memory
    fills: the busy afternoon (1.8 times the mean) looks over-full on paper, while real
    use stays near a third of what is declared."""
    mean_rate = shape.users * shape.tasks_per_user / DAY_S
    mean_memory = sum(MEMORY_CHOICES) / len(MEMORY_CHOICES)
    mean_duration_s = 60 * math.exp(0.5 + 0.125)  # the two log-normal draws of _kind, _run_of
    services = shape.users * shape.service_share * sum(MEMORY_CHOICES[1:]) / 4
    declared_mb = mean_rate * mean_duration_s * mean_memory + services
    workers = max(2, math.ceil(1.5 * declared_mb / (256 * 1024)))
    return {"workers": workers, "cpu": 64.0, "memory_mb": 256 * 1024}


def write(path: Path, shape: Shape) -> int:
    """Write the trace; return how many submissions it holds."""
    count = 0
    with path.open("w") as out:
        meta = {"trace": asdict(shape), "cluster": cluster_for(shape)}
        out.write(json.dumps(meta) + "\n")
        for submission in generate(shape):
            out.write(json.dumps(asdict(submission)) + "\n")
            count += 1
    return count


def read(path: Path) -> tuple[dict[str, Any], Iterator[Submission]]:
    """The trace's description and its submissions, streamed."""
    handle = path.open()
    meta: dict[str, Any] = json.loads(handle.readline())

    def rows() -> Iterator[Submission]:
        with handle:
            for line in handle:
                yield Submission(**json.loads(line))

    return meta, rows()
