"""Core's metrics: what happens to tasks and attempts (counted where it happens), and the
queues and workers as the database holds them (read at scrape time)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, date, datetime

from prometheus_client.core import Metric
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.metrics import Metrics, gauge_family
from libs.common.states import ATTEMPT_OUTCOMES, FINAL, TaskState
from services.core.db import accounting, stats
from services.core.db.attempts import Tally

#: what a worker's turn carried (``cairn_turns_total``)
TURN_KINDS = ("both", "claim", "report", "other")


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
            "Attempts ended, by outcome (libs/common/states.py: AttemptOutcome)",
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
        self.expired = m.counter(
            "cairn_tasks_expired_total",
            "Tasks that ended dead never started by their start_by (or queue's max wait)",
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
        self.claim_looks = m.counter(
            "cairn_claim_looks_total",
            "Looks (a pick and a lease) by waiting claims once woken, by what they found"
            " (leased, empty)",
            ["outcome"],
        )
        self.claim_picks = m.counter(
            "cairn_claim_picks_total",
            "Claims' picks by when they ran: with the turn's first round trip (first),"
            " sent then but refused and run again (again), after it (after)",
            ["when"],
        )
        self.turns = m.counter(
            "cairn_turns_total",
            "Workers' turns by what they carried: a claim and reports (both), a claim alone"
            " (claim), reports without a claim (report), neither (other: starts, progress)",
            ["kind"],
        )
        self.turn_kinds = {kind: self.turns.labels(kind) for kind in TURN_KINDS}
        self.turn_reports = m.counter(
            "cairn_turn_reports_total", "Attempt reports carried by workers' turns"
        )
        for found in ("leased", "empty"):
            self.claim_looks.labels(found)
        for when in ("first", "again", "after"):
            self.claim_picks.labels(when)
        for quota in ("waiting", "submits_per_min"):
            self.quota_refusals.labels(quota)
        for reason in ("quota", "concurrency", "rate"):
            self.claims_held.labels(reason)
        for state in (TaskState.SUCCEEDED, TaskState.DEAD, TaskState.CANCELLED):
            self.finished.labels(state.value)
        # Every outcome, so that rates over them exist before the first of each.
        for outcome in ATTEMPT_OUTCOMES:
            self.attempts_finished.labels(outcome)
        m.read_at_scrape(read_queues)
        m.read_at_scrape(read_workers)
        m.read_at_scrape(read_queue_workers)
        m.read_at_scrape(read_quotas)
        m.read_at_scrape(read_usage)

    def turned(self, claimed: bool, reports: int) -> None:
        """A worker's turn, by what it carried (``TURN_KINDS``)."""
        kind = ("both" if reports else "claim") if claimed else ("report" if reports else "other")
        self.turn_kinds[kind].inc()
        if reports:
            self.turn_reports.inc(reports)

    def lead(self, leading: Callable[[], bool]) -> None:
        """Whether this replica runs core's singleton loops (``loops.Leadership``)."""
        gauge = self.metrics.gauge(
            "cairn_core_leader", "1 while this replica leads: runs core's singleton loops"
        )
        gauge.set_function(lambda: float(leading()))

    def wait_line(self, waiting: Callable[[], int]) -> None:
        """This replica's waiting claims (``db.feed.Line``)."""
        self.metrics.gauge(
            "cairn_claims_waiting", "Claims of this replica waiting for work (long polls)"
        ).set_function(lambda: float(waiting()))

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

    def expire(self, count: int) -> None:
        """Tasks the promoter ended dead, never started by their start_by."""
        self.expired.inc(count)
        self.ended(TaskState.DEAD, count)

    def ended(self, state: TaskState, count: int = 1) -> None:
        if state in FINAL and count:
            self.finished.labels(state.value).inc(count)


async def read_queues(conn: AsyncConnection) -> list[Metric]:
    read = await stats.queues(conn)
    depth = [((d.queue, d.state.value), float(d.count)) for d in read.depth if d.state not in FINAL]
    oldest = [((queue,), age) for queue, age in read.oldest_waiting_s.items()]
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
    pools = await stats.pools(conn)

    def family(name: str, doc: str, column: str) -> Metric:
        values = [((pool,), float(getattr(read, column))) for pool, read in pools.items()]
        return gauge_family(name, doc, ["pool"], values)

    hung = [
        ((pool, kind), float(getattr(read, f"hung_source_{kind}s")))
        for pool, read in pools.items()
        for kind in ("thread", "checker")
    ]
    return [
        gauge_family(
            "cairn_workers_hung_sources",
            "What of the pool's agents hangs on file:// sources that did not answer, at"
            " their last beats: threads left to an open or read, spawn helpers' checkers",
            ["pool", "kind"],
            hung,
        ),
        family("cairn_workers_alive", "Live or draining workers per pool", "alive"),
        family("cairn_workers_cpu", "CPU the pool's live workers offer", "cpu"),
        family("cairn_workers_memory_mb", "Memory (MB) the pool's live workers offer", "memory_mb"),
        family("cairn_workers_used_cpu", "CPU the attempts placed hold, as placement counts it", "used_cpu"),
        family(
            "cairn_workers_used_memory_mb", "Memory (MB) the attempts placed hold",
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
    rows = [((queue,), float(n)) for queue, n in (await stats.live_workers_per_queue(conn)).items()]
    return [
        gauge_family("cairn_queue_workers_live", "Live workers serving each queue", ["queue"], rows)
    ]


async def read_quotas(conn: AsyncConnection) -> list[Metric]:
    values = [((name,), float(n)) for name, n in (await stats.owners_at_quota(conn)).items()]
    return [
        gauge_family("cairn_owners_at_quota", "Owners at a quota now, by quota", ["quota"], values)
    ]


async def read_usage(conn: AsyncConnection) -> list[Metric]:
    """The current month's accounting per queue (docs/sharing.md, "Usage"); owners and
    teams only through the API (a label per owner would be unbounded)."""
    month = datetime.now(UTC).date().replace(day=1)
    rows = await accounting.accounts(conn, month, "queue", MAX_USAGE_QUEUES)

    def family(name: str, doc: str, column: str) -> Metric:
        values = [((r.key,), float(getattr(r, column))) for r in rows]
        return gauge_family(name, doc, ["queue"], values)

    return [
        family("cairn_usage_attempts", "Attempts ended this month (UTC) per queue", "attempts"),
        family("cairn_usage_cpu_seconds", "CPU seconds used this month per queue", "cpu_s"),
        family(
            "cairn_usage_cpu_reserved_seconds",
            "Core-seconds reserved this month per queue (charge times wall time)",
            "cpu_reserved_s",
        ),
        family(
            "cairn_usage_memory_reserved_mb_seconds",
            "MB-seconds of memory reserved this month per queue",
            "memory_mb_s",
        ),
        await _device_usage(conn, month, [r.key for r in rows]),
    ]


async def _device_usage(conn: AsyncConnection, month: date, queues: list[str]) -> Metric:
    held = await accounting.device_seconds(conn, month, "queue", queues)
    values = [((q, name), s) for q, by_name in held.items() for name, s in sorted(by_name.items())]
    return gauge_family(
        "cairn_usage_device_seconds",
        "Device-seconds held this month per queue and device name",
        ["queue", "device"],
        values,
    )


#: the most queues the usage gauges list (the largest reservations first)
MAX_USAGE_QUEUES = 200
