"""What ``/metrics`` reads at scrape time: queues, pools of workers, owners at quota.
The depth of the queues and what a worker holds are the queries the API answers with
(``tasks.QUEUE_DEPTHS``, ``placement.USE``), so the two never disagree."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.states import TaskState, Workers, sql_in
from services.core.db import placement
from services.core.db import tasks as tasks_db

S = TaskState


@dataclass(frozen=True)
class Depth:
    queue: str
    state: TaskState
    count: int


@dataclass(frozen=True)
class Queues:
    """Tasks per queue and state (``dead`` among them, every unfinished state), and the
    age of each queue's oldest waiting task."""

    depth: list[Depth]
    oldest_waiting_s: dict[str, float]


async def queues(conn: AsyncConnection) -> Queues:
    depth, oldest = [], {}
    for row in await conn.execute(tasks_db.QUEUE_DEPTHS):
        depth.append(Depth(row.queue, TaskState(row.state), int(row.n)))
        if row.oldest is not None:
            oldest[row.queue] = float(row.oldest)
    return Queues(depth, oldest)


# A worker's pool is the set of queues it serves: bounded by configuration, not by hosts.
_POOL_WORKERS = text(f"""
SELECT id, array_to_string(queues, ',') AS pool, cpu, memory_mb,
       CAST(EXTRACT(EPOCH FROM now() - last_heartbeat_at) AS double precision) AS heartbeat_age,
       hung_source_threads, hung_source_checkers
FROM core.workers
WHERE {sql_in("state", Workers.PRESENT)}
""")


@dataclass
class Pool:
    """The live and draining workers of one pool: what they offer, what their open
    attempts hold (as placement counts it), and the stalest beat among them."""

    alive: int = 0
    cpu: float = 0.0
    memory_mb: float = 0.0
    used_cpu: float = 0.0
    used_memory_mb: float = 0.0
    running: int = 0
    heartbeat_age: float = 0.0
    #: what of their agents hangs on sources that did not answer, at their last beats
    hung_source_threads: int = 0
    hung_source_checkers: int = 0


async def pools(conn: AsyncConnection) -> dict[str, Pool]:
    rows = list(await conn.execute(_POOL_WORKERS))
    use = await placement.use_of(conn, [r.id for r in rows])
    found: dict[str, Pool] = defaultdict(Pool)
    for row in rows:
        pool = found[row.pool]
        pool.alive += 1
        pool.cpu += row.cpu
        pool.memory_mb += row.memory_mb
        pool.heartbeat_age = max(pool.heartbeat_age, row.heartbeat_age or 0.0)
        pool.hung_source_threads += row.hung_source_threads
        pool.hung_source_checkers += row.hung_source_checkers
        if row.id in use:
            held, running = use[row.id]
            pool.used_cpu += held.cpu
            pool.used_memory_mb += held.memory_mb
            pool.running += running
    return dict(found)


# Per queue, the live workers that serve it (draining ones take no new work).
_QUEUE_WORKERS = text(f"""
SELECT q.queue, count(*) AS live
FROM core.workers w CROSS JOIN LATERAL unnest(w.queues) AS q(queue)
WHERE w.state = '{Workers.LIVE}'
GROUP BY q.queue
""")


async def live_workers_per_queue(conn: AsyncConnection) -> dict[str, int]:
    return {r.queue: int(r.live) for r in await conn.execute(_QUEUE_WORKERS)}


# Owners at each running or waiting quota: the label is the quota's name, never the owner.
_AT_QUOTA = text(f"""
WITH running AS (
    SELECT t.owner, count(*) AS n, sum(t.cpu) AS cpu, sum(t.memory_mb) AS memory_mb,
           jsonb_agg(t.devices) FILTER (WHERE t.devices IS NOT NULL) AS devices
    FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
    WHERE a.outcome IS NULL
      AND t.owner IN (SELECT name FROM core.shares
                      WHERE max_cpu IS NOT NULL OR max_memory_mb IS NOT NULL
                         OR max_running IS NOT NULL OR max_devices IS NOT NULL)
    GROUP BY t.owner
), waiting AS (
    SELECT t.owner, count(*) AS n FROM core.tasks t
    WHERE t.state IN ('{S.READY}', '{S.WAITING}')
      AND t.owner IN (SELECT name FROM core.shares WHERE max_waiting IS NOT NULL)
    GROUP BY t.owner
)
SELECT
    count(*) FILTER (WHERE r.cpu >= s.max_cpu) AS cpu,
    count(*) FILTER (WHERE r.memory_mb >= s.max_memory_mb) AS memory,
    count(*) FILTER (WHERE r.n >= s.max_running) AS running,
    count(*) FILTER (WHERE w.n >= s.max_waiting) AS waiting,
    -- at the quota of any device name: its running devices summed from the requests
    count(*) FILTER (WHERE EXISTS (
        SELECT FROM jsonb_each_text(s.max_devices) m
        WHERE (SELECT COALESCE(sum((d->>m.key)::int), 0)
               FROM jsonb_array_elements(COALESCE(r.devices, '[]'::jsonb)) d)
              >= m.value::int)) AS devices
FROM core.shares s
LEFT JOIN running r ON r.owner = s.name
LEFT JOIN waiting w ON w.owner = s.name
""")

QUOTAS = ("cpu", "memory", "running", "waiting", "devices")


async def owners_at_quota(conn: AsyncConnection) -> dict[str, int]:
    row = (await conn.execute(_AT_QUOTA)).one()
    return {name: int(getattr(row, name)) for name in QUOTAS}
