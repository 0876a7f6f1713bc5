"""Placement in the database: the rows ``domain.placement`` decides on, the placement pass
(pool utilisation, deferral, making room for guaranteed work), pending reasons, measured
use and right-sizing. Decisions are the domain's; this module reads and writes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import TextClause, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common import locks
from libs.common.models import QueueSettings, Task, UsageRow
from libs.common.states import TaskState, Workers, sql_in
from services.core.db import sharing
from services.core.db.tables import queues, workers
from services.core.domain import pending, selectors
from services.core.domain.placement import (
    DECAY,
    ZERO,
    Amount,
    Candidate,
    Node,
    Placed,
    Plan,
    best_plan,
    charge,
    counts,
    held_in_all,
    summed,
    total,
    utilisation,
)
from services.core.domain.sharing import Gate, Gated
from services.core.domain.transitions import NOTE_STATES, Note, Op, sources
from services.core.settings import CoreSettings

S = TaskState


@dataclass(frozen=True)
class Defaults:
    """The operator's defaults for pools without settings of their own."""

    overcommit: float = 1.0
    defer_above: float = 0.8
    defer_max_s: float = 6 * 3600.0
    defer_margin_s: float = 600.0
    preempt_after_s: float = 5.0
    preempt_grace_s: float = 10.0
    aging_s: float = 60.0
    aging_max: int = 200

    @classmethod
    def of(cls, settings: CoreSettings) -> Defaults:
        return cls(
            overcommit=settings.overcommit_ratio,
            defer_above=settings.defer_above,
            defer_max_s=settings.defer_max_s,
            defer_margin_s=settings.defer_margin_s,
            preempt_after_s=settings.preempt_after_s,
            preempt_grace_s=settings.preempt_grace_s,
            aging_s=settings.aging_s,
            aging_max=settings.aging_max,
        )


# The moment a time-insensitive task must start anyway: before its deadline by its
# timeout (or the margin), else a bounded time after it was submitted.
LATEST_START = """COALESCE(
    t.deadline - make_interval(secs => COALESCE(t.timeout_s, :defer_margin_s)),
    t.created_at + make_interval(secs => :defer_max_s))"""
DEFERRABLE = "(t.defer_ok OR t.deadline IS NOT NULL)"
HOT_QUEUES = (
    "(SELECT h.name FROM core.queues h WHERE h.utilisation > COALESCE(h.defer_above, :defer_above))"
)

#: What placement reads of an open attempt ``a`` of task ``t`` beside its ids: a charge
#: is fixed at placement; an attempt without one is charged its task's request. (A turn's
#: ``attempts._REPORTED`` reads it of the reported attempts: ``Placement``.)
PLACEMENT = """t.priority, t.preemptible,
       COALESCE(a.charge_cpu, t.cpu) AS charge_cpu,
       COALESCE(a.charge_memory_mb, t.memory_mb) AS charge_memory_mb,
       COALESCE(a.charge_devices, t.devices) AS charge_devices,
       EXTRACT(EPOCH FROM a.started_at)::float8 AS started,
       a.squeezed_at IS NOT NULL AS squeezed, a.preempted_by IS NOT NULL AS preempted"""

#: the open attempts on some workers (``:workers``), as ``nodes_from`` takes them
PLACED = text(f"""
SELECT a.id, a.task_id, a.worker_id, {PLACEMENT}
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.outcome IS NULL AND a.worker_id = ANY(CAST(:workers AS bigint[]))
""")


class Placement(NamedTuple):
    """A row of ``PLACED``, made of another statement's row that read ``PLACEMENT``."""

    id: int
    task_id: int
    worker_id: int
    priority: int
    preemptible: bool
    charge_cpu: float
    charge_memory_mb: float
    charge_devices: Any
    started: float
    squeezed: bool
    preempted: bool


# What the open attempts on some workers hold, summed per worker, leaving out ``:listed``
# (attempts read one by one beside it, ``PLACED``): a decision that needs only a worker's
# room reads one row, not one per attempt it holds (a worker holding many leases taken
# ahead holds thousands). A charge is fixed at placement; an attempt without one is
# charged its task's request (looked up only then). The one reading of what a worker
# holds: placement, ``/v1/workers`` and ``/metrics`` (``held_in_all`` of its row).
def _use(which: str) -> str:
    """``USE`` over the open attempts ``which`` selects (a condition on ``a``)."""
    return f"""
SELECT u.worker_id, count(*) AS running,
       COALESCE(sum(u.cpu) FILTER (WHERE NOT u.squeezed), 0)::float8 AS cpu,
       COALESCE(sum(u.cpu) FILTER (WHERE u.squeezed), 0)::float8 AS squeezed_cpu,
       COALESCE(sum(u.memory_mb), 0)::float8 AS memory_mb,
       -- the devices held (rare): each attempt's, summed by ``rest_from``
       jsonb_agg(u.devices) FILTER (WHERE u.devices IS NOT NULL) AS devices
FROM (
    SELECT a.worker_id, a.squeezed_at IS NOT NULL AS squeezed,
           COALESCE(a.charge_cpu, (SELECT t.cpu FROM core.tasks t WHERE t.id = a.task_id))
               AS cpu,
           COALESCE(a.charge_memory_mb,
                    (SELECT t.memory_mb FROM core.tasks t WHERE t.id = a.task_id)) AS memory_mb,
           a.charge_devices AS devices
    FROM core.attempts a
    WHERE a.outcome IS NULL AND {which}
) u
GROUP BY u.worker_id
"""


USE = text(
    _use("a.worker_id = ANY(CAST(:workers AS bigint[])) AND a.id <> ALL(CAST(:listed AS bigint[]))")
)

# Each served queue's pool summed by the database: the capacity of its live workers and
# what their open attempts hold (``USE`` per worker, summed again), one row a queue however
# many workers serve it: the placement pass reads this every second, and a fleet of
# thousands of workers would otherwise be read row by row each time.
_POOLS = text(f"""
SELECT q.queue, sum(w.cpu)::float8 AS capacity_cpu,
       sum(w.memory_mb)::float8 AS capacity_memory_mb,
       COALESCE(sum(u.cpu), 0)::float8 AS cpu,
       COALESCE(sum(u.squeezed_cpu), 0)::float8 AS squeezed_cpu,
       COALESCE(sum(u.memory_mb), 0)::float8 AS memory_mb
FROM core.workers w
CROSS JOIN LATERAL unnest(w.queues) AS q(queue)
LEFT JOIN ({_use("TRUE")}) u ON u.worker_id = w.id
WHERE w.state = '{Workers.LIVE}'
GROUP BY q.queue
""")


def _held(row: Any) -> Amount:
    """What one row of ``USE`` says a worker's attempts hold in all."""
    devices = counts(summed(row.devices))
    return held_in_all(row.cpu, row.squeezed_cpu, row.memory_mb, devices)


def rest_from(use_rows: Iterable[Any]) -> dict[int, Amount]:
    """Per worker, what its attempts hold in all, from the rows of ``USE``."""
    return {r.worker_id: _held(r) for r in use_rows}


async def use_of(conn: AsyncConnection, worker_ids: Sequence[int]) -> dict[int, tuple[Amount, int]]:
    """Per worker among ``worker_ids`` holding any, what its open attempts hold in all
    and how many they are."""
    rows = await conn.execute(USE, {"workers": list(worker_ids), "listed": []})
    return {r.worker_id: (_held(r), r.running) for r in rows}


def held_by(rows: Iterable[Any]) -> Amount:
    """What these rows of ``PLACED`` hold together (a squeezed attempt little CPU)."""
    return total(_placed(row).held for row in rows)


def _placed(row: Any) -> Placed:
    return Placed(
        attempt_id=row.id,
        task_id=row.task_id,
        priority=row.priority,
        preemptible=row.preemptible,
        charge=Amount(row.charge_cpu, row.charge_memory_mb, counts(row.charge_devices)),
        started=row.started,
        squeezed=row.squeezed,
        preempted=row.preempted,
    )


async def nodes_of(conn: AsyncConnection, rows: Sequence[Any]) -> list[Node]:
    """Nodes for these worker rows, with what is placed on each."""
    placed = await conn.execute(PLACED, {"workers": [row.id for row in rows]})
    return nodes_from(rows, placed)


def nodes_from(
    rows: Sequence[Any], placed_rows: Iterable[Any], rest: Mapping[int, Amount] | None = None
) -> list[Node]:
    """Nodes for these worker rows, from the rows of ``PLACED`` (and what the attempts
    not among them hold in all, per worker: ``rest_from``)."""
    placed: dict[int, list[Placed]] = defaultdict(list)
    for row in placed_rows:
        placed[row.worker_id].append(_placed(row))
    rest = rest or {}
    return [
        Node(
            worker_id=row.id,
            capacity=Amount(row.cpu, row.memory_mb, counts(row.devices)),
            placed=tuple(placed[row.id]),
            queues=frozenset(row.queues),
            rest=rest.get(row.id, ZERO),
            labels=tuple(sorted(row.labels.items())),
        )
        for row in rows
    ]


async def live_nodes(conn: AsyncConnection) -> list[Node]:
    """The live workers, each with every attempt placed on it listed."""
    return await nodes_of(conn, await _live_workers(conn))


async def live_rooms(conn: AsyncConnection) -> list[Node]:
    """The live workers with what their attempts hold in all, none listed: enough for
    how full a pool is, one row a worker."""
    rows = await _live_workers(conn)
    use = await conn.execute(USE, {"workers": [r.id for r in rows], "listed": []})
    return nodes_from(rows, (), rest_from(use))


async def _live_workers(conn: AsyncConnection) -> list[Any]:
    return list(await conn.execute(select(workers).where(workers.c.state == Workers.LIVE)))


# --- placement by label --------------------------------------------------------------------

# Where the running tasks of some groups (owner, name) run, those placed by label (a
# spread's replicas carry their placement): the domains of a spread.
_GROUPS_RUNNING = text(f"""
SELECT t.owner, t.name, w.hostname, w.labels
FROM core.tasks t
JOIN core.attempts a ON a.id = t.current_attempt_id AND a.outcome IS NULL
JOIN core.workers w ON w.id = a.worker_id
WHERE t.state = '{S.RUNNING}' AND t.placement IS NOT NULL
  AND (t.owner, t.name) IN (SELECT * FROM unnest(CAST(:owners AS text[]), CAST(:names AS text[])))
""")
_LIVE_LABELS = text(
    f"SELECT hostname, labels, queues FROM core.workers WHERE state = '{Workers.LIVE}'"
)


async def by_labels(conn: AsyncConnection, worker: Any, rows: Sequence[Any]) -> list[Any]:
    """A claim's picked rows (sorted best first) as placement by label orders and admits
    them for ``worker``: at one effective priority, the rows whose preferred selectors it
    meets with more weight first; rows whose spread (or anti-affinity) one more on this
    worker would break left out, decided one group at a time (``locks.SPREAD_GROUP``)."""
    rules = {r.id: selectors.rules_of(r.placement) for r in rows if r.placement}
    labels = dict(worker.labels)

    def key(r: Any) -> tuple[Any, ...]:
        rule = rules.get(r.id)
        score = selectors.score(rule.preferred, labels) if rule else 0
        return (not r.reserved, r.ahead, -(r.priority + r.boost), -score, r.vtime, r.id)

    ordered = sorted(rows, key=key)
    spread = [r for r in ordered if r.id in rules and rules[r.id].spread is not None]
    if not spread:
        return ordered
    groups = sorted({(r.owner, r.name) for r in spread})
    await sharing.lock_names(conn, locks.SPREAD_GROUP, (f"{o}/{n}" for o, n in groups))
    counts = await _spread_counts(conn, spread, rules)
    refused = set()
    for r in spread:
        rule = rules[r.id]
        by, _ = rule.spread  # type: ignore[misc]
        mine = selectors.domain_of(by, worker.hostname, labels)
        group = counts[(r.owner, r.name, by, r.queue)]
        if not selectors.spread_allows_one(rule, mine, group):
            refused.add(r.id)
        elif mine is not None:
            group[mine] = group.get(mine, 0) + 1  # a later row of the group sees it
    return [r for r in ordered if r.id not in refused]


async def _spread_counts(
    conn: AsyncConnection, rows: Sequence[Any], rules: Mapping[int, selectors.Rules]
) -> dict[tuple[str, str, str, str], dict[str, int]]:
    """Per (owner, name, spread label, queue): its running tasks in each domain of the
    live workers that serve the queue and meet the task's required selectors (zeros
    included, as Kubernetes counts the eligible nodes' domains)."""
    live = list(await conn.execute(_LIVE_LABELS))
    owners = [r.owner for r in rows]
    running = list(
        await conn.execute(_GROUPS_RUNNING, {"owners": owners, "names": [r.name for r in rows]})
    )
    out: dict[tuple[str, str, str, str], dict[str, int]] = {}
    for r in rows:
        rule = rules[r.id]
        by, _ = rule.spread  # type: ignore[misc]
        key = (r.owner, r.name, by, r.queue)
        if key in out:
            continue
        domains: dict[str, int] = {}
        for w in live:
            if r.queue in w.queues and selectors.matches(rule.required, w.labels):
                mine = selectors.domain_of(by, w.hostname, w.labels)
                if mine is not None:
                    domains.setdefault(mine, 0)
        for g in running:
            if (g.owner, g.name) == (r.owner, r.name):
                mine = selectors.domain_of(by, g.hostname, g.labels)
                if mine is not None:
                    domains[mine] = domains.get(mine, 0) + 1
        out[key] = domains
    return out


def candidate(row: Any, defaults: Defaults) -> Candidate:
    """A task row (with ``peak_cpu``, ``peak_memory_mb`` of its kind and its pool's
    ``overcommit``) as placement sees it."""
    measured = None
    if row.peak_cpu is not None and row.peak_memory_mb is not None:
        measured = Amount(row.peak_cpu, row.peak_memory_mb)
    return Candidate(
        task_id=row.id,
        priority=row.priority,
        preemptible=row.preemptible,
        request=Amount(row.cpu, row.memory_mb, counts(row.devices)),
        measured=measured,
        overcommit=row.overcommit or defaults.overcommit,
    )


# --- measured use -------------------------------------------------------------------------

_RECORD_USE = text("""
INSERT INTO core.usage AS u (owner, name, peak_cpu, peak_memory_mb, samples)
VALUES (:owner, :name, :cpu, :memory_mb, 1)
ON CONFLICT (owner, name) DO UPDATE SET
    peak_cpu = GREATEST(EXCLUDED.peak_cpu, u.peak_cpu * :decay),
    peak_memory_mb = GREATEST(EXCLUDED.peak_memory_mb, u.peak_memory_mb * :decay),
    samples = u.samples + 1,
    updated_at = now()
""")

_ATTEMPT_SECONDS = text(
    "SELECT EXTRACT(EPOCH FROM now() - started_at)::float8 FROM core.attempts WHERE id = :id"
)


async def record_use(
    conn: AsyncConnection, task: Any, attempt_id: int, peak_memory_mb: float, cpu_seconds: float
) -> None:
    """Fold one attempt's measurement into its kind's decaying peak (``decayed_peak``)."""
    seconds = (await conn.execute(_ATTEMPT_SECONDS, {"id": attempt_id})).scalar_one()
    cores = cpu_seconds / max(float(seconds), 1.0)
    params = {
        "owner": task.owner,
        "name": task.name,
        "cpu": cores,
        "memory_mb": peak_memory_mb,
        "decay": DECAY,
    }
    await conn.execute(_RECORD_USE, params)


# --- pools --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolRow:
    paused: bool
    overcommit: float
    defer_above: float
    utilisation: float | None


async def pools(conn: AsyncConnection, defaults: Defaults) -> dict[str, PoolRow]:
    return {
        row.name: PoolRow(
            paused=row.paused,
            overcommit=row.overcommit or defaults.overcommit,
            defer_above=row.defer_above or defaults.defer_above,
            utilisation=row.utilisation,
        )
        for row in await conn.execute(select(queues))
    }


async def set_pool(conn: AsyncConnection, name: str, change: QueueSettings) -> None:
    values = change.model_dump(exclude_unset=True)
    if change.egress is not None and change.egress.mode == "host":
        values["egress"] = None  # the default is stored as none set
    stmt = pg_insert(queues).values(name=name, **values)
    if values:
        stmt = stmt.on_conflict_do_update(index_elements=[queues.c.name], set_=values)
    else:
        stmt = stmt.on_conflict_do_nothing()
    await conn.execute(stmt)


# --- pending reasons ----------------------------------------------------------------------

_KIND_USE = text("""
SELECT owner, name, peak_cpu, peak_memory_mb FROM core.usage
WHERE (owner, name) IN (SELECT * FROM unnest(CAST(:owners AS text[]), CAST(:names AS text[])))
""")
_LAST_ATTEMPTS = text("""
SELECT DISTINCT ON (task_id) task_id, outcome, preempted_by FROM core.attempts
WHERE task_id = ANY(CAST(:ids AS bigint[])) ORDER BY task_id, id DESC
""")
_DEFERRED = text("SELECT id FROM core.tasks WHERE id = ANY(CAST(:ids AS bigint[])) AND deferred")


async def with_pending_reasons(
    conn: AsyncConnection, tasks: Sequence[Task], defaults: Defaults
) -> list[Task]:
    """The tasks, each not running with the reason why."""
    idle = [t for t in tasks if t.state in (S.READY, S.WAITING, S.FAILED)]
    if not idle:
        return list(tasks)
    ids = [t.id for t in idle]
    kinds = {(t.owner, t.name) for t in idle}
    use = {
        (r.owner, r.name): Amount(r.peak_cpu, r.peak_memory_mb)
        for r in await conn.execute(
            _KIND_USE, {"owners": [k[0] for k in kinds], "names": [k[1] for k in kinds]}
        )
    }
    preempted = {
        r.task_id: r.preempted_by
        for r in await conn.execute(_LAST_ATTEMPTS, {"ids": ids})
        if r.outcome == "preempted"
    }
    deferred = {r.id for r in await conn.execute(_DEFERRED, {"ids": ids})}
    gate = await _gate(conn, [t for t in idle if t.state is S.WAITING])
    settings = await pools(conn, defaults)
    nodes = await live_nodes(conn)
    now = datetime.now(UTC)
    out = []
    for task in tasks:
        if task.state not in (S.READY, S.WAITING, S.FAILED):
            out.append(task)
            continue
        row = settings.get(task.queue) or PoolRow(
            False, defaults.overcommit, defaults.defer_above, None
        )
        serving = tuple(n for n in nodes if task.queue in n.queues)
        required = (
            selectors.rules_of(task.placement.model_dump()).required if task.placement else ()
        )
        unmatched = None
        if required and serving:
            unmatched = selectors.unmatched(required, [n.label_map for n in serving])
            serving = tuple(n for n in serving if selectors.matches(required, n.label_map))
        pool = pending.Pool(
            name=task.queue,
            paused=row.paused,
            nodes=serving,
            utilisation=utilisation(serving),
            defer_above=row.defer_above,
        )
        need = charge(
            Candidate(
                task_id=task.id,
                priority=task.priority,
                preemptible=task.preemptible,
                request=request_of(task),
                measured=use.get((task.owner, task.name)),
                overcommit=row.overcommit,
            )
        )
        standing = pending.Standing(
            state=task.state,
            run_at=task.run_at,
            need=need,
            deferred=task.id in deferred,
            preempted_by=preempted.get(task.id),
            held=gate.held(task.id) if gate is not None else None,
            unmatched=unmatched,
        )
        reason = pending.pending_reason(standing, pool, now)
        out.append(task.model_copy(update={"pending_reason": reason}))
    return out


def request_of(task: Task) -> Amount:
    """What a task asks for, as placement counts it."""
    resources = task.resources
    return Amount(resources.cpu, resources.memory_mb, counts(resources.devices))


async def _gate(conn: AsyncConnection, waiting: Sequence[Task]) -> Gate | None:
    """What quotas and concurrency keys say of these waiting tasks, read without locks."""
    tasks = {
        t.id: Gated(
            owner=t.owner,
            request=request_of(t),
            key=t.concurrency.key if t.concurrency else None,
            key_limit=t.concurrency.limit if t.concurrency else None,
            team=t.team,
        )
        for t in waiting
    }
    if not tasks:
        return None
    quotas = await sharing.quotas_of(conn, {t.owner for t in waiting})
    teams = {t.team for t in waiting if t.team is not None}
    team_quotas = await sharing.team_quotas_of(conn, teams) if teams else {}
    return await sharing.gate(conn, tasks, quotas, lock=False, team_quotas=team_quotas)


# --- the placement pass -------------------------------------------------------------------

_SET_UTILISATION = text("""
INSERT INTO core.queues AS q (name, utilisation)
SELECT * FROM unnest(CAST(:names AS text[]), CAST(:shares AS float8[]))
ON CONFLICT (name) DO UPDATE SET utilisation = EXCLUDED.utilisation
WHERE q.utilisation IS DISTINCT FROM EXCLUDED.utilisation
""")
_CLEAR_UTILISATION = text("""
UPDATE core.queues SET utilisation = NULL
WHERE utilisation IS NOT NULL AND NOT (name = ANY(CAST(:names AS text[])))
""")

# The deferrable waiting work of the hot pools, found by its own index
# (``ix_tasks_deferrable``: a pool is hot during every backlog, and a scan of the waiting
# read every waiting task of its queues at each pass).
_DEFER = text(f"""
WITH hot AS (
    SELECT q.name, q.utilisation, COALESCE(q.defer_above, :defer_above) AS above
    FROM core.queues q
    WHERE q.utilisation > COALESCE(q.defer_above, :defer_above) AND NOT q.paused
), picked AS (
    SELECT t.id, t.state, hot.utilisation, hot.above, {LATEST_START} AS latest
    FROM core.tasks t JOIN hot ON hot.name = t.queue
    WHERE {sql_in("t.state", sources(Op.DEFER, S.READY))} AND {DEFERRABLE}
      AND {LATEST_START} > now()
    ORDER BY t.id
    LIMIT :limit
    FOR UPDATE OF t SKIP LOCKED
), moved AS (
    UPDATE core.tasks t SET state = :target, deferred = true, run_at = picked.latest,
        version = t.version + 1, updated_at = now()
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.owner, t.version, picked.state AS from_state, picked.utilisation,
        picked.above
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason)
    SELECT id, version, owner, :op, from_state, :target,
           'deferred: pool at ' || round(utilisation * 100) || '% (defers above '
           || round(above * 100) || '%)'
    FROM moved
)
SELECT count(*) FROM moved
""")

# Only what a deferral parked (a failed task waits out its own backoff), found by the
# index of the deferred.
_UNDEFER = text(f"""
WITH picked AS (
    SELECT t.id, t.state, q.utilisation FROM core.tasks t LEFT JOIN core.queues q ON q.name = t.queue
    WHERE t.state = '{S.READY}' AND t.deferred
      AND NOT COALESCE(q.paused, false)
      AND COALESCE(q.utilisation, 0) <= COALESCE(q.defer_above, :defer_above)
    ORDER BY t.id
    LIMIT :limit
    FOR UPDATE OF t SKIP LOCKED
), moved AS (
    UPDATE core.tasks t SET state = :target, deferred = false, run_at = now(),
        version = t.version + 1, updated_at = now()
    FROM picked WHERE t.id = picked.id
    RETURNING t.id, t.owner, t.version, picked.state AS from_state, picked.utilisation
), events AS (
    INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason)
    SELECT id, version, owner, :op, from_state, :target,
           'pool at ' || round(COALESCE(utilisation, 0) * 100) || '%: no longer deferred'
    FROM moved
)
SELECT count(*) FROM moved
""")

# Guaranteed work waiting too long, less the tasks room is already being made for (as one
# hashed set: an OR inside NOT EXISTS was a nested loop of the whole backlog by every open
# attempt, 570 ms a pass at 20,000 waiting, docs/benchmarks.md), among the first
# ``:line`` in line of each queue a live worker serves, in the claim's order
# (``ix_tasks_waiting``): a pass reads at most that many rows a queue, however long the
# backlog (it read and sorted every waiting task, 13 % of PostgreSQL's time beside batch
# submits at 500,000 waiting). Work deeper in line waits for the line, not for room.
_BLOCKED = text(f"""
SELECT b.id, b.queue, b.cpu, b.memory_mb, b.devices, b.priority, b.placement
FROM (SELECT DISTINCT s.name FROM core.workers w, unnest(w.queues) AS s(name)
      WHERE w.state = '{Workers.LIVE}') AS q
CROSS JOIN LATERAL (
    SELECT t.id, t.queue, t.cpu, t.memory_mb, t.devices, t.priority, t.vtime, t.placement,
           t.preemptible, t.updated_at
    FROM core.tasks t
    WHERE t.state = '{S.WAITING}' AND t.queue = q.name
    ORDER BY t.priority DESC, t.vtime, t.id
    LIMIT :line
) b
WHERE NOT b.preemptible
  AND b.updated_at < now() - make_interval(secs => :after_s)
  AND b.id NOT IN (
      SELECT a.preempted_by FROM core.attempts a
      WHERE a.outcome IS NULL AND a.preempted_by IS NOT NULL
      UNION ALL
      SELECT a.squeezed_for FROM core.attempts a
      WHERE a.outcome IS NULL AND a.squeezed_for IS NOT NULL
        AND a.squeezed_at > now() - make_interval(secs => :after_s)
  )
ORDER BY b.priority DESC, b.vtime, b.id
LIMIT :limit
""")

# How far into each queue's line the pass looks for blocked guaranteed work.
BLOCKED_LINE = 1000

_SQUEEZE = text("""
UPDATE core.attempts SET squeezed_at = now(), squeezed_for = :task
WHERE id = ANY(CAST(:ids AS bigint[])) AND outcome IS NULL AND squeezed_at IS NULL
RETURNING id, task_id
""")
_PREEMPT = text("""
UPDATE core.attempts SET preempted_by = :task
WHERE id = ANY(CAST(:ids AS bigint[])) AND outcome IS NULL AND preempted_by IS NULL
RETURNING id, task_id
""")

PASS_BATCH = 500


async def measure_pools(conn: AsyncConnection) -> dict[str, float]:
    """Each served queue's utilisation, stored for the claim path and the deferral: of
    its pool summed by the database (``_POOLS``) as one node, which is the same share
    as of its workers one by one (what they hold and their capacities add up)."""
    shares = {
        row.queue: utilisation(
            [
                Node(
                    worker_id=0,
                    capacity=Amount(row.capacity_cpu, row.capacity_memory_mb),
                    rest=held_in_all(row.cpu, row.squeezed_cpu, row.memory_mb),
                )
            ]
        )
        for row in await conn.execute(_POOLS)
    }
    names = sorted(shares)
    await conn.execute(
        _SET_UTILISATION, {"names": names, "shares": [round(shares[n], 4) for n in names]}
    )
    await conn.execute(_CLEAR_UTILISATION, {"names": names})
    return shares


def deferral(defaults: Defaults) -> tuple[tuple[TextClause, dict[str, Any]], ...]:
    """The placement pass's deferral, as it runs: the deferrable work of the hot pools
    deferred, then what a deferral parked released where its pool has cooled."""
    common = {"defer_above": defaults.defer_above, "limit": PASS_BATCH}
    defer = {
        **common,
        "defer_margin_s": defaults.defer_margin_s,
        "defer_max_s": defaults.defer_max_s,
        "target": S.READY.value,
        "op": Op.DEFER.value,
    }
    release = {**common, "target": S.WAITING.value, "op": Op.PROMOTE.value}
    return (_DEFER, defer), (_UNDEFER, release)


async def defer_and_release(conn: AsyncConnection, defaults: Defaults) -> int:
    moved = 0
    for statement, params in deferral(defaults):
        moved += int((await conn.execute(statement, params)).scalar_one())
    return moved


async def make_room(conn: AsyncConnection, defaults: Defaults) -> int:
    """For guaranteed tasks that have waited ``preempt_after_s`` and fit nowhere, among
    the first ``BLOCKED_LINE`` in line of each queue a live worker serves: squeeze, then
    preempt, preemptible attempts on the worker where that costs least. The live
    workers' attempts are read one by one only when such a task waits."""
    params = {"after_s": defaults.preempt_after_s, "line": BLOCKED_LINE, "limit": 50}
    blocked = list(await conn.execute(_BLOCKED, params))
    if not blocked:
        return 0
    changed = 0
    by_id = {n.worker_id: n for n in await live_nodes(conn)}
    for task in blocked:
        need = Amount(task.cpu, task.memory_mb, counts(task.devices))
        required = selectors.rules_of(task.placement).required
        serving = [
            n
            for n in by_id.values()
            if task.queue in n.queues and selectors.matches(required, n.label_map)
        ]
        if any(need.fits_in(n.free()) for n in serving):
            continue  # a claim takes it
        plan = best_plan(serving, need)
        if plan is None:
            changed += await _reserve(conn, task.id, serving, need)
            continue
        if not (plan.squeeze or plan.preempt):
            continue
        changed += await _squeeze(conn, task.id, plan.squeeze)
        changed += await _preempt(conn, task.id, plan.preempt)
        by_id[plan.worker_id] = _after(by_id[plan.worker_id], plan, task.id, need)
    return changed


# A worker row another transaction holds (its turn: worker, then the tasks it reports) is
# skipped until the next pass: this pass holds task rows already, and waiting here would
# take the two locks in the opposite order.
_RESERVE = text("""
UPDATE core.workers SET reserved_for = :task
WHERE id = (SELECT id FROM core.workers WHERE id = :worker FOR UPDATE SKIP LOCKED)
  AND reserved_for IS NULL
  AND NOT EXISTS (SELECT 1 FROM core.workers w WHERE w.reserved_for = :task)
""")
_RELEASE = text(f"""
UPDATE core.workers w SET reserved_for = NULL
WHERE w.reserved_for IS NOT NULL AND (w.state <> '{Workers.LIVE}' OR NOT EXISTS (
    SELECT 1 FROM core.tasks t WHERE t.id = w.reserved_for AND t.state = '{S.WAITING}'))
""")


async def _reserve(
    conn: AsyncConnection, task_id: int, serving: Sequence[Node], need: Amount
) -> int:
    """A guaranteed task that fits nowhere, with no preemptible work to make room:
    reserve a worker large enough for it, the one with the least guaranteed work placed
    (its room frees soonest), so that small tasks stop passing it there
    (``dispatch.claim``)."""
    able = [n for n in serving if need.fits_in(n.capacity)]
    if not able:
        return 0
    best = min(able, key=lambda n: (n.guaranteed().largest_share_of(n.capacity), n.worker_id))
    return (await conn.execute(_RESERVE, {"task": task_id, "worker": best.worker_id})).rowcount


async def release_reservations(conn: AsyncConnection) -> int:
    """Reservations whose task is no longer waiting (or whose worker is gone) end."""
    return (await conn.execute(_RELEASE)).rowcount


def _after(node: Node, plan: Plan, task_id: int, need: Amount) -> Node:
    """The node as the next blocked task must see it: victims marked, the room reserved."""
    placed = tuple(
        replace(
            p,
            squeezed=p.squeezed or p.attempt_id in plan.squeeze,
            preempted=p.preempted or p.attempt_id in plan.preempt,
        )
        for p in node.placed
    )
    reserved = Placed(-task_id, task_id, 0, False, need, math.inf)
    return replace(node, placed=(*placed, reserved))


async def _squeeze(conn: AsyncConnection, for_task: int, ids: Sequence[int]) -> int:
    if not ids:
        return 0
    rows = list(await conn.execute(_SQUEEZE, {"task": for_task, "ids": list(ids)}))
    reason = f"squeezed: CPU share lowered to make room for guaranteed task {for_task}"
    for row in rows:
        await note(conn, row.task_id, Note.SQUEEZE, reason)
    return len(rows)


_NOTE = text("""
WITH noted AS (
    UPDATE core.tasks SET version = version + 1, updated_at = now()
    WHERE id = :id AND state = :state
    RETURNING id, owner, version, state, current_attempt_id
)
INSERT INTO core.task_events (task_id, seq, owner, op, from_state, to_state, reason, attempt_id)
SELECT id, version, owner, :note, state, state, :reason, current_attempt_id FROM noted
""")


async def note(conn: AsyncConnection, task_id: int, what: Note, reason: str) -> bool:
    """Append a note to the task's history if it is still in the note's state."""
    params = {"id": task_id, "state": NOTE_STATES[what].value, "note": what.value, "reason": reason}
    return bool((await conn.execute(_NOTE, params)).rowcount)


async def _preempt(conn: AsyncConnection, for_task: int, ids: Sequence[int]) -> int:
    if not ids:
        return 0
    return len(list(await conn.execute(_PREEMPT, {"task": for_task, "ids": list(ids)})))


# --- right-sizing -------------------------------------------------------------------------

_RIGHTSIZING = text("""
SELECT t.owner, t.name, count(*) AS attempts,
       avg(t.cpu) AS requested_cpu, avg(t.memory_mb) AS requested_memory_mb,
       jsonb_agg(t.devices) FILTER (WHERE t.devices IS NOT NULL) AS devices,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY a.peak_memory_mb) AS p95_memory_mb,
       percentile_cont(0.95) WITHIN GROUP (
           ORDER BY a.cpu_seconds / GREATEST(EXTRACT(EPOCH FROM a.ended_at - a.started_at), 1.0)
       ) AS p95_cpu
FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
WHERE a.peak_memory_mb IS NOT NULL AND a.cpu_seconds IS NOT NULL AND a.ended_at IS NOT NULL
  AND (CAST(:owner AS text) IS NULL OR t.owner = :owner)
  AND (CAST(:team AS text) IS NULL OR t.team = :team)
  AND (CAST(:name AS text) IS NULL OR t.name = :name)
GROUP BY t.owner, t.name
ORDER BY t.owner, t.name
LIMIT :limit
""")

#: headroom a suggested request keeps over the measured p95
HEADROOM = 1.2


def suggest(p95_cpu: float, p95_memory_mb: float) -> tuple[float, int]:
    """A request that holds the measured p95 with headroom: CPU in tenths of a core,
    memory in whole 64 MB steps."""
    cpu = max(0.1, math.ceil(p95_cpu * HEADROOM * 10) / 10)
    memory = max(64, math.ceil(p95_memory_mb * HEADROOM / 64) * 64)
    return cpu, memory


async def rightsizing(
    conn: AsyncConnection, owner: str | None, name: str | None, limit: int, team: str | None = None
) -> list[UsageRow]:
    """Per (owner, name), of ``owner``'s tasks and (or) the tasks ``team`` owns."""
    params = {"owner": owner, "name": name, "limit": limit, "team": team}
    rows = await conn.execute(_RIGHTSIZING, params)
    out = []
    for r in rows:
        p95_cpu, p95_memory = float(r.p95_cpu), float(r.p95_memory_mb)
        cpu, memory = suggest(p95_cpu, p95_memory)
        requested = Amount(float(r.requested_cpu), float(r.requested_memory_mb))
        out.append(
            UsageRow(
                owner=r.owner,
                name=r.name,
                attempts=r.attempts,
                requested_cpu=round(requested.cpu, 3),
                requested_memory_mb=round(requested.memory_mb, 1),
                p95_cpu=round(p95_cpu, 3),
                p95_memory_mb=round(p95_memory, 1),
                suggested_cpu=cpu,
                suggested_memory_mb=memory,
                used_share=round(Amount(p95_cpu, p95_memory).largest_share_of(requested), 3),
                requested_devices=_average(r.devices, r.attempts),
            )
        )
    return out


def _average(requests: list[dict[str, int]] | None, attempts: int) -> dict[str, float]:
    """The devices asked for per attempt, by name, from the requests of those asking."""
    asked = summed(requests)
    return {name: round(n / attempts, 3) for name, n in sorted(asked.items())}


_PASS_LOCK = text(f"SELECT pg_try_advisory_xact_lock{locks.PLACEMENT_PASS}")


async def place_once(conn: AsyncConnection, defaults: Defaults) -> int:
    """One placement pass (one replica at a time): measure pools, defer or release
    time-insensitive work, make room for blocked guaranteed work."""
    if not (await conn.execute(_PASS_LOCK)).scalar_one():
        return 0
    await measure_pools(conn)
    await release_reservations(conn)
    moved = await defer_and_release(conn, defaults)
    return moved + await make_room(conn, defaults)
