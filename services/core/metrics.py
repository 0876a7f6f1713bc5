"""Core's metrics: what happens to tasks and attempts (counted where it happens), and the
queues and workers as the database holds them (read at scrape time)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prometheus_client.core import Metric
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.metrics import Metrics, gauge_family
from libs.common.states import FINAL, TaskState
from services.core.db.attempts import Tally

_QUEUES = text("""
SELECT queue, state, count(*) AS n,
       EXTRACT(EPOCH FROM now() - min(updated_at) FILTER (WHERE state = 'waiting')) AS oldest
FROM core.tasks
WHERE state IN ('failed', 'ready', 'running', 'waiting')
GROUP BY queue, state
""")

# A worker's pool is the set of queues it serves: bounded by configuration, not by hosts.
_WORKERS = text("""
WITH used AS (
    SELECT a.worker_id, sum(t.cpu) AS cpu, sum(t.memory_mb) AS memory_mb, count(*) AS running
    FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
    WHERE a.outcome IS NULL AND a.worker_id IS NOT NULL
    GROUP BY a.worker_id
)
SELECT array_to_string(w.queues, ',') AS pool, count(*) AS alive,
       sum(w.cpu) AS cpu, sum(w.memory_mb) AS memory_mb,
       coalesce(sum(u.cpu), 0) AS used_cpu, coalesce(sum(u.memory_mb), 0) AS used_memory_mb,
       coalesce(sum(u.running), 0) AS running,
       EXTRACT(EPOCH FROM now() - min(w.last_heartbeat_at)) AS heartbeat_age
FROM core.workers w LEFT JOIN used u ON u.worker_id = w.id
WHERE w.state IN ('live', 'draining')
GROUP BY 1
""")

# Per queue, the live workers that serve it (draining ones take no new work).
_QUEUE_WORKERS = text("""
SELECT q.queue, count(*) AS live
FROM core.workers w CROSS JOIN LATERAL unnest(w.queues) AS q(queue)
WHERE w.state = 'live'
GROUP BY q.queue
""")

# Every attempt outcome, so that rates over them exist before the first of each.
ATTEMPT_OUTCOMES = ("succeeded", "failed", "timeout", "crashed", "handed_back", "preempted", "lost")


class CoreMetrics:
    """The counters and histograms core bumps, and its scrape-time readers."""

    def __init__(self) -> None:
        m = self.metrics = Metrics("core")
        self.submitted = m.counter(
            "cairn_tasks_submitted_total", "Tasks accepted (new, not idempotent repeats)", ["queue"]
        )
        self.started = m.counter("cairn_attempts_started_total", "Attempts leased to workers")
        self.attempts_finished = m.counter(
            "cairn_attempts_finished_total",
            "Attempts ended, by outcome (succeeded, failed, timeout, crashed, lost, handed_back)",
            ["outcome"],
        )
        self.finished = m.counter(
            "cairn_tasks_finished_total",
            "Tasks that reached a final state, by state (succeeded, dead, cancelled)",
            ["state"],
        )
        self.dispatch_latency = m.histogram(
            "cairn_dispatch_latency_seconds",
            "From a task becoming eligible (submit, or its run_at) to its attempt's lease",
        )
        self.lost = m.counter(
            "cairn_attempts_lost_total", "Attempts lost to a dead worker or a vanished process"
        )
        self.poison = m.counter(
            "cairn_tasks_poison_pills_total", "Tasks buried after too many crashed attempts"
        )
        self.quota_refusals = m.counter(
            "cairn_quota_refusals_total",
            "Submissions refused with 429, by quota (waiting, submits_per_min)",
            ["quota"],
        )
        self.claims_held = m.counter(
            "cairn_claim_held_total",
            "Candidates a claim held back, by what held them (quota, concurrency, rate)",
            ["reason"],
        )
        for quota in ("waiting", "submits_per_min"):
            self.quota_refusals.labels(quota)
        for reason in ("quota", "concurrency", "rate"):
            self.claims_held.labels(reason)
        for state in (TaskState.SUCCEEDED, TaskState.DEAD, TaskState.CANCELLED):
            self.finished.labels(state.value)
        for outcome in ATTEMPT_OUTCOMES:
            self.attempts_finished.labels(outcome)
        m.read_at_scrape(read_queues)
        m.read_at_scrape(read_workers)
        m.read_at_scrape(read_queue_workers)
        m.read_at_scrape(read_quotas)

    def submitted_to(self, queues: Iterable[str]) -> None:
        for queue, n in Counter(queues).items():
            self.submitted.labels(queue).inc(n)

    def count(self, tally: Tally) -> None:
        """What a dispatch call reported on the way."""
        if tally.waits:
            self.started.inc(len(tally.waits))
            for waited in tally.waits:
                self.dispatch_latency.observe(waited)
        if tally.lost:
            self.lost.inc(tally.lost)
            self.attempts_finished.labels("lost").inc(tally.lost)
        if tally.poisoned:
            self.poison.inc(tally.poisoned)
        if tally.buried:
            self.finished.labels(TaskState.DEAD.value).inc(tally.buried)
        for reason, n in tally.held.items():
            self.claims_held.labels(reason).inc(n)

    def ended(self, state: TaskState, count: int = 1) -> None:
        if state in FINAL and count:
            self.finished.labels(state.value).inc(count)


async def read_queues(conn: AsyncConnection) -> list[Metric]:
    rows = list(await conn.execute(_QUEUES))
    depth = [((r.queue, r.state), float(r.n)) for r in rows]
    oldest = [((r.queue,), float(r.oldest)) for r in rows if r.oldest is not None]
    return [
        gauge_family(
            "cairn_queue_depth", "Unfinished tasks per queue and state", ["queue", "state"], depth
        ),
        gauge_family(
            "cairn_queue_oldest_waiting_seconds",
            "Age of the oldest waiting task per queue",
            ["queue"],
            oldest,
        ),
    ]


async def read_workers(conn: AsyncConnection) -> list[Metric]:
    rows = list(await conn.execute(_WORKERS))
    pool = ["pool"]

    def family(name: str, doc: str, column: str) -> Metric:
        return gauge_family(name, doc, pool, [((r.pool,), float(getattr(r, column))) for r in rows])

    return [
        family("cairn_workers_alive", "Live or draining workers per pool", "alive"),
        family("cairn_workers_cpu", "CPU the pool's live workers offer", "cpu"),
        family("cairn_workers_memory_mb", "Memory (MB) the pool's live workers offer", "memory_mb"),
        family("cairn_workers_used_cpu", "CPU requested by the attempts placed", "used_cpu"),
        family(
            "cairn_workers_used_memory_mb", "Memory (MB) requested by the attempts placed",
            "used_memory_mb",
        ),
        family("cairn_workers_running_attempts", "Attempts open on the pool", "running"),
        family(
            "cairn_workers_heartbeat_age_seconds",
            "Seconds since the pool's stalest live worker last beat",
            "heartbeat_age",
        ),
    ]  # fmt: skip


async def read_queue_workers(conn: AsyncConnection) -> list[Metric]:
    rows = [((r.queue,), float(r.live)) for r in await conn.execute(_QUEUE_WORKERS)]
    return [
        gauge_family("cairn_queue_workers_live", "Live workers serving each queue", ["queue"], rows)
    ]


# Owners at each running or waiting quota: the label is the quota's name, never the owner.
_AT_QUOTA = text("""
WITH running AS (
    SELECT t.owner, count(*) AS n, sum(t.cpu) AS cpu, sum(t.memory_mb) AS memory_mb
    FROM core.attempts a JOIN core.tasks t ON t.id = a.task_id
    WHERE a.outcome IS NULL
      AND t.owner IN (SELECT name FROM core.shares
                      WHERE max_cpu IS NOT NULL OR max_memory_mb IS NOT NULL
                         OR max_running IS NOT NULL)
    GROUP BY t.owner
), waiting AS (
    SELECT t.owner, count(*) AS n FROM core.tasks t
    WHERE t.state IN ('ready', 'waiting')
      AND t.owner IN (SELECT name FROM core.shares WHERE max_waiting IS NOT NULL)
    GROUP BY t.owner
)
SELECT
    count(*) FILTER (WHERE r.cpu >= s.max_cpu) AS cpu,
    count(*) FILTER (WHERE r.memory_mb >= s.max_memory_mb) AS memory,
    count(*) FILTER (WHERE r.n >= s.max_running) AS running,
    count(*) FILTER (WHERE w.n >= s.max_waiting) AS waiting
FROM core.shares s
LEFT JOIN running r ON r.owner = s.name
LEFT JOIN waiting w ON w.owner = s.name
""")


async def read_quotas(conn: AsyncConnection) -> list[Metric]:
    row = (await conn.execute(_AT_QUOTA)).one()
    values = [
        ((name,), float(getattr(row, name))) for name in ("cpu", "memory", "running", "waiting")
    ]
    return [
        gauge_family("cairn_owners_at_quota", "Owners at a quota now, by quota", ["quota"], values)
    ]
