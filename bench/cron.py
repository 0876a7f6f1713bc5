"""Cron benchmark: lag with many schedules due at once, leases by real claims, the heap.

    .venv/bin/python bench/cron.py [--schedules 10000] [--rounds 2] [--lead 20] [--jitter 0]
                                   [--workers 4] [--processes 1] [--claim-max 256] [--ahead 5]
                                   [--no-confirm] [--timer-per-lease] [--agent SLOTS]
                                   [--promote-after S]
                                   [--held 100000] [--json results.json]

One run starts a fresh embedded PostgreSQL (durable settings) in a temp folder, migrates
it, and starts core as its own process (``python -m services.core``, one uvicorn worker).
The cron engine runs in this process on the real clock (core starts delayed tasks by the
database's clock, so the two must agree), with ``--lead`` seconds of lead.

1. Lag: ``--schedules`` schedules ``* * * * *`` (each with ``--jitter`` seconds of jitter,
   0: all due at the minute) owned by one person per hundred schedules are put into the
   table in bulk (one created through the store, copied), the engine takes the lead and
   builds its heap; then ``--rounds`` minute boundaries pass. Each fire's task is sent
   ahead with ``run_at`` = its start (the slot plus the jitter). ``--workers`` fake
   workers, in a process of their own (or dealt out over ``--processes``), do real HTTP turns (report what they started as
   succeeded, claim up to ``--claim-max`` more, long-polling, asking ``--ahead`` seconds
   ahead: docs/architecture.md, "Claiming ahead"). A lease with a ``start_at`` is held on
   an event-loop timer: half a second before it the worker asks core which of the
   attempts due then it still holds (one ``/starts`` request, as the agent does;
   ``--no-confirm`` skips it), and starts each at its instant; a lease without one starts
   at once. The figures are, each minus the
   task's ``run_at``,
   - eligible: the instant core would hand the task to a claim: its ``run_at``, or its
     submission's, had the fire come late (the claim takes a ready task whose ``run_at``
     has come, so no promotion stands between);
   - first move: the first event after the submission (a claim straight from ``ready``,
     or the promoter's move to ``waiting``): core acting on it;
   - leased: the start of the claim transaction that leased its attempt;
   - received: the instant the worker process read the turn's answer with it (before the
     run_at when leased ahead: negative);
   - started: the instant the worker started it, the lag the bar is about. With
     ``--agent SLOTS`` a real worker agent (``python -m services.worker``) takes the fake
     workers' place and each task's process records its own start.
   Nothing may start before its ``run_at`` and nothing may start twice: both counted.
   Every slot must be fired exactly once: the fires table and core's tasks are counted.
   Bar (DESIGN.md): p99 under 50 ms at 10,000 schedules in the same second; 1 s at
   100,000 in the same minute.
2. Heap: ``--held`` schedules are put straight into the table, and the leader's heap is
   rebuilt from it: time, and the memory the heap and its version map hold (tracemalloc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy.ext.asyncio import create_async_engine
from stack import core_stack, exit_on_sigterm

from libs.common.client import CoreClient
from libs.common.cron_models import ScheduleCreate
from libs.common.models import (
    MAX_STARTS,
    MAX_TURN_ITEMS,
    Assignment,
    AttemptReport,
    ClaimRequest,
    Turn,
    WorkerRegister,
)
from libs.common.settings import libpq_url
from services.core import admin
from services.cron import store
from services.cron.engine import CronEngine, SystemClock
from services.cron.fire import Sender
from services.cron.settings import CronSettings
from services.worker.agent import confirm_at

BAR_P99_MS = 50.0
VIRTUAL_START = datetime(2027, 1, 4, 12, 0, 0, tzinfo=UTC)
TRUE_SHA = "0" * 64


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def create_schedules(
    db_url: str, count: int, now: datetime, jitter_s: int, task: dict[str, Any] | None = None
) -> None:
    """One schedule through the store (validated, its first fire computed), copied in bulk
    to ``count``, one owner per hundred."""
    engine = create_async_engine(db_url)
    template: dict[str, Any] = {
        "name": "s0",
        "expression": "* * * * *",
        "timezone": "UTC",
        "jitter_s": jitter_s,
        "target": {
            "kind": "task",
            "task": {
                "name": "cron-bench",
                "artifact": {"uri": "file:///bin/true", "sha256": TRUE_SHA},
                "queue": "bench",
                "resources": {"cpu": 0.01, "memory_mb": 1},
                **(task or {}),
            },
        },
    }
    async with engine.begin() as conn:
        first = await store.create(conn, "user0", ScheduleCreate.model_validate(template), now, 10)
    await engine.dispose()
    columns = (
        "expression, timezone, target, misfire_policy, catch_up_limit, misfire_grace_s,"
        " overlap_policy, jitter_s, fired_through, next_fire_at"
    )
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO cron.schedules (owner, changed_by, name, {columns})"
            f" SELECT 'user' || (g / 100), 'user' || (g / 100), 's' || g, {columns}"
            "   FROM cron.schedules, generate_series(1, %(more)s) AS g WHERE id = %(id)s",
            {"more": count - 1, "id": first.id},
        )


@dataclass(frozen=True)
class Fleet:
    """What the fake workers are asked to do."""

    core_url: str
    tokens: list[str]
    claim_max: int
    ahead_s: float
    confirm: bool
    per_lease: bool = False


@dataclass
class Seen:
    """Each lease as a fake worker saw it: read (task, instant), started (task, instant)."""

    received: list[tuple[int, float]] = field(default_factory=list)
    started: list[tuple[int, float]] = field(default_factory=list)


def workers_main(fleet: Fleet, stop: Any, out: str) -> None:
    """The fake workers' process: every lease it receives and starts, with the instants."""
    seen = Seen()
    asyncio.run(_workers(fleet, stop, seen))
    Path(out).write_text(json.dumps({"received": seen.received, "started": seen.started}))


async def _workers(fleet: Fleet, stop: Any, seen: Seen) -> None:
    await asyncio.gather(
        *(_work(fleet, t, f"w{i}", stop, seen) for i, t in enumerate(fleet.tokens))
    )


class _Starter:
    """One fake agent's starts, as the agent does them: a lease with ``start_at`` on an
    event-loop timer; half a second before it, on the agent's grid (``confirm_at``), those
    due together are confirmed in one request, then each starts (is recorded) at its
    instant and is queued to be reported as succeeded. A lease without ``start_at``
    starts at once. Leases due at the same instant share one timer (``--timer-per-lease``: one each, as the real agent
    holds them), so that a fake agent standing for a fleet of hosts does not charge the
    lag with 10,000 timer callbacks queued on one event loop; each start is still
    stamped by its own clock read."""

    def __init__(
        self, core: CoreClient, worker_id: int, confirm: bool, seen: Seen, per_lease: bool
    ) -> None:
        self.core, self.worker_id, self.confirm, self.seen = core, worker_id, confirm, seen
        self.loop = asyncio.get_running_loop()
        self.reports: list[int] = []  # started attempts, built into reports per turn
        self.due: list[Assignment] = []
        self.flushing: asyncio.Handle | None = None
        self.asking: set[asyncio.Task[None]] = set()
        self.held = 0
        self.per_lease = per_lease
        self.timers: dict[tuple[float, Any], list[Assignment]] = {}

    def take(self, leased: list[Assignment]) -> None:
        for a in leased:
            if a.start_at is None:
                self._started(a)
                continue
            self.held += 1
            if self.confirm:
                self._at(confirm_at(a.start_at.timestamp()), self._to_confirm, a)
            else:
                self._at(a.start_at.timestamp(), self._start, a)

    def _at(self, instant: float, then: Any, a: Assignment) -> None:
        """``then(a)`` at the wall clock's ``instant`` (again if the monotonic timer rang
        a hair early)."""
        if self.per_lease:
            delay = instant - time.time()
            if delay > 0:
                self.loop.call_later(delay, self._at, instant, then, a)
            else:
                then(a)
            return
        key = (instant, then)
        if (group := self.timers.get(key)) is not None:
            group.append(a)
            return
        self.timers[key] = [a]
        self._ring(key)

    def _ring(self, key: tuple[float, Any]) -> None:
        instant, then = key
        delay = instant - time.time()
        if delay > 0:
            self.loop.call_later(delay, self._ring, key)
            return
        for a in self.timers.pop(key):
            then(a)

    def _to_confirm(self, a: Assignment) -> None:
        self.due.append(a)
        if self.flushing is None:
            self.flushing = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = None
        due, self.due = self.due, []
        task = asyncio.create_task(self._confirm(due))
        self.asking.add(task)
        task.add_done_callback(self.asking.discard)

    async def _confirm(self, due: list[Assignment]) -> None:
        for at in range(0, len(due), MAX_STARTS):
            chunk = due[at : at + MAX_STARTS]
            answer = await self.core.start_attempts(self.worker_id, [a.attempt_id for a in chunk])
            held = set(answer.held)
            for a in chunk:
                if a.attempt_id in held:
                    assert a.start_at is not None
                    self._at(a.start_at.timestamp(), self._start, a)
                else:
                    self.held -= 1

    def _start(self, a: Assignment) -> None:
        self.held -= 1
        self._started(a)

    def _started(self, a: Assignment) -> None:
        self.seen.started.append((a.task_id, time.time()))
        self.reports.append(a.attempt_id)

    def next_reports(self) -> list[AttemptReport]:
        taken = self.reports[:MAX_TURN_ITEMS]
        del self.reports[:MAX_TURN_ITEMS]
        return [AttemptReport(attempt_id=a, outcome="succeeded", exit_code=0) for a in taken]

    @property
    def busy(self) -> bool:
        return bool(self.held or self.due or self.asking or self.reports)


async def _work(fleet: Fleet, token: str, name: str, stop: Any, seen: Seen) -> None:
    """One fake agent with all the room it asks for: each turn reports what it started
    since and claims again (asking ``ahead_s``), long-polling when nothing is there."""
    timeout = httpx.Timeout(60, connect=5)
    async with CoreClient(fleet.core_url, token, timeout=timeout) as core:
        offer = WorkerRegister(hostname=name, queues=["bench"], cpu=4000, memory_mb=10_000_000)
        me = await core.register_worker(offer)
        room = ClaimRequest(
            cpu=4000, memory_mb=10_000_000, max=fleet.claim_max, wait=2.0, ahead_s=fleet.ahead_s
        )
        starter = _Starter(core, me.worker.id, fleet.confirm, seen, fleet.per_lease)
        while not stop.is_set():
            reports = starter.next_reports()
            try:
                answer = await core.turn(me.worker.id, Turn(reports=reports, claim=room))
            except httpx.HTTPError as exc:  # a slow answer under load: say so, go on
                print(f"{name}: turn failed ({exc!r}); again", flush=True)
                starter.reports[:0] = [r.attempt_id for r in reports]
                continue
            now = time.time()
            seen.received.extend((a.task_id, now) for a in answer.attempts)
            starter.take(answer.attempts)
        while starter.busy:  # held leases still to start, reports still to send
            if reports := starter.next_reports():
                await core.turn(me.worker.id, Turn(reports=reports))
            else:
                await asyncio.sleep(0.05)


# The real agent's task: the process writes the wall clock as its first act (bash's
# $EPOCHREALTIME: no fork), a line per start.
RECORD = '#!/bin/bash\nprintf "%s\\n" "$EPOCHREALTIME" >> "$RECORDS/$CAIRN_TASK_ID"\n'


def _agent_task(root: Path, records: Path) -> dict[str, Any]:
    records.mkdir()
    records.chmod(0o1777)  # the attempts' own uids write here
    script = root / "record-start.sh"
    script.write_text(RECORD)
    script.chmod(0o755)
    for parent in script.parents:  # an unprivileged attempt must reach it
        parent.chmod(parent.stat().st_mode | 0o001)
    digest = hashlib.sha256(RECORD.encode()).hexdigest()
    return {
        "artifact": {"uri": f"file://{script}", "sha256": digest},
        "env": {"RECORDS": str(records)},
        "resources": {"cpu": 0.01, "memory_mb": 16},
    }


def _start_agent(
    core_url: str, token: str, home: Path, slots: int, ahead_s: float
) -> subprocess.Popen[bytes]:
    """A real worker agent (``python -m services.worker``) for the bench's queue."""
    env = {
        **os.environ,
        "CAIRN_URL": core_url,
        "CAIRN_TOKEN": token,
        "CAIRN_HOME": str(home),
        "CAIRN_WORKER_QUEUES": "bench",
        "CAIRN_WORKER_SLOTS": str(slots),
        "CAIRN_WORKER_CPU": str(max(1.0, slots * 0.01)),
        "CAIRN_WORKER_MEMORY_MB": str(slots * 16 + 64),
        "CAIRN_WORKER_CLAIM_AHEAD_S": str(ahead_s),
        "CAIRN_WORKER_DRAIN_GRACE_S": "2",
        "CAIRN_LOG_LEVEL": "warning",
    }
    env.pop("CAIRN_DATABASE_URL", None)
    return subprocess.Popen([sys.executable, "-m", "services.worker"], env=env)


def _process_starts(records: Path) -> list[tuple[int, float]]:
    return [
        (int(entry.name), float(line))
        for entry in records.iterdir()
        if entry.name.isdigit()
        for line in entry.read_text().split()
    ]


def held_schedules(db_url: str, count: int) -> None:
    """``count`` schedules straight into the table, spread over the next hour."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO cron.schedules (owner, changed_by, name, expression, timezone, target,
                misfire_policy, catch_up_limit, misfire_grace_s, overlap_policy,
                fired_through, next_fire_at)
            SELECT 'held' || (g %% 1000), 'held' || (g %% 1000), 'h' || g,
                   (g %% 60) || ' * * * *', 'UTC',
                   '{"kind": "task", "task": {"name": "x"}}'::jsonb, 'fire_once', 10, 60,
                   'allow', %(now)s, %(now)s + make_interval(mins => 60 + g %% 60)
              FROM generate_series(1, %(count)s) AS g
            """,
            {"count": count, "now": VIRTUAL_START},
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {"CAIRN_HEARTBEAT_TIMEOUT_S": "600", "CAIRN_CLAIM_AHEAD_MAX_S": str(args.ahead)}
    if args.promote_after is not None:
        env["CAIRN_PROMOTE_AFTER_S"] = str(args.promote_after)
    with core_stack("cairn-bench-cron-", **env) as stack:
        return await measure(args, stack.root, stack.database_url, stack.core_url)


def _lags(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": round(_pct(values, 50), 1),
        "p99_ms": round(_pct(values, 99), 1),
        "max_ms": round(max(values), 1),
    }


# Each task of the measured slots: its start, its submission, its first move after it, its
# lease (the claim's transaction start), and the state it was claimed from.
TIMES = """
SELECT t.id, (t.labels->>'cairn.cron/fire-time')::timestamptz AS slot, t.run_at,
       (SELECT e.at FROM core.task_events e WHERE e.task_id = t.id AND e.seq = 1) AS submitted,
       (SELECT e.at FROM core.task_events e WHERE e.task_id = t.id AND e.seq = 2) AS moved,
       (SELECT min(e.at) FROM core.task_events e
         WHERE e.task_id = t.id AND e.op = 'claim') AS leased,
       (SELECT e.from_state FROM core.task_events e
         WHERE e.task_id = t.id AND e.op = 'claim' ORDER BY e.seq LIMIT 1) AS claimed_from
  FROM core.tasks t
 WHERE (t.labels->>'cairn.cron/fire-time')::timestamptz BETWEEN %s AND %s
"""


async def measure(args: argparse.Namespace, root: Path, url: str, core_url: str) -> dict[str, Any]:
    service = await asyncio.to_thread(admin.create_token, url, "cron", "service")
    tokens = [
        await asyncio.to_thread(admin.create_token, url, f"bench-worker-{i}", "worker")
        for i in range(args.workers)
    ]
    # The first boundary far enough away that every fire can go ahead (a fire is sent the
    # lead, or its jitter if longer, before its start), and the schedules' first slot.
    now = datetime.now(UTC)
    first = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while first - now < timedelta(seconds=max(args.lead, args.jitter) + 15):
        first += timedelta(minutes=1)
    last = first + timedelta(minutes=args.rounds - 1)
    print(f"creating {args.schedules} schedules ...", flush=True)
    began = time.perf_counter()
    records = root / "records"
    task = _agent_task(root, records) if args.agent else None
    await create_schedules(url, args.schedules, first - timedelta(seconds=1), args.jitter, task)
    created_s = time.perf_counter() - began

    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    outs = [root / f"received-{n}.json" for n in range(args.processes)]
    workers: Any
    fleets: list[Any] = []
    if args.agent:
        workers = _start_agent(core_url, tokens[0], root / "agent", args.agent, args.ahead)
    else:  # the fake workers, dealt out over ``--processes`` processes
        for n, out in enumerate(outs):
            fleet = Fleet(
                core_url,
                tokens[n :: len(outs)],
                args.claim_max,
                args.ahead,
                args.confirm,
                args.timer_per_lease,
            )
            fleets.append(spawn.Process(target=workers_main, args=(fleet, stop, str(out))))
            fleets[-1].start()

    settings = CronSettings(
        database_url=url,
        url=core_url,
        token=service,
        home=root / "home",
        env="development",
        cron_lead_s=args.lead,
    )
    clock = SystemClock()
    db = create_async_engine(url, pool_size=10, max_overflow=0)
    core = CoreClient(core_url, service, timeout=httpx.Timeout(60.0, connect=5.0))
    engine = CronEngine(db, url, settings, Sender(core, settings.cron_submit_chunk), clock)
    runner = asyncio.create_task(engine.run())
    settle = timedelta(seconds=args.jitter + 10)
    print(f"slots {first.isoformat()} .. {last.isoformat()}", flush=True)
    try:
        # Until the last slot's tasks have had their time (fires still owed then are
        # counted as missing, not waited for), with a line of progress every 10 s.
        while (left := (last + settle - clock.now()).total_seconds()) > 0:
            await asyncio.sleep(min(10.0, left))
            print(f"  {clock.now():%H:%M:%S} {engine.status()}", flush=True)
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await core.aclose()
        await db.dispose()
        stop.set()
        if args.agent:
            workers.terminate()  # SIGTERM: it drains (nothing is left running by now)
            await asyncio.to_thread(workers.wait, 60)
        for process in fleets:
            await asyncio.to_thread(process.join, 120)
            if process.is_alive():
                process.terminate()
    seen: dict[str, list[Any]] = {"received": [], "started": []}
    if args.agent:  # each process's own record of its start, one line per start
        seen["started"] = _process_starts(records)
    for out in outs if not args.agent else []:
        if out.exists():
            for key, values in json.loads(out.read_text()).items():
                seen[key].extend(values)
    received = dict(seen["received"])
    started = dict(seen["started"])
    started_twice = len(seen["started"]) - len(started)

    with psycopg.connect(libpq_url(url)) as conn:
        fires = conn.execute(
            "SELECT fire_time, outcome, submitted_at FROM cron.fires"
            " WHERE fire_time BETWEEN %s AND %s ORDER BY fire_time",
            (first, last),
        ).fetchall()
        times = conn.cursor(row_factory=namedtuple_row).execute(TIMES, (first, last)).fetchall()
        tasks = conn.execute("SELECT count(*) FROM core.tasks").fetchone()
        dupes = conn.execute(
            "SELECT count(*) FROM (SELECT idempotency_key FROM core.tasks"
            " GROUP BY owner, idempotency_key HAVING count(*) > 1) d"
        ).fetchone()
        leases = conn.execute(
            "SELECT count(*), count(DISTINCT task_id) FROM core.attempts"
        ).fetchone()

    def ms(later: datetime, start: datetime) -> float:
        return (later - start).total_seconds() * 1000

    rounds: list[dict[str, Any]] = []
    by_slot: dict[datetime, list[Any]] = {}
    for row in times:
        by_slot.setdefault(row.slot, []).append(row)
    every: dict[str, list[float]] = {
        "eligible": [], "moved": [], "leased": [], "received": [], "started": []
    }  # fmt: skip
    ahead = early = sent_ahead = direct = 0
    for slot, rows in sorted(by_slot.items()):
        lags: dict[str, list[float]] = {key: [] for key in every}
        for r in rows:
            sent_ahead += r.submitted < r.run_at
            lags["eligible"].append(max(0.0, ms(r.submitted, r.run_at)))
            if r.moved is not None:
                lags["moved"].append(ms(r.moved, r.run_at))
            if r.leased is not None:
                lags["leased"].append(ms(r.leased, r.run_at))
                ahead += r.leased < r.run_at
                direct += r.claimed_from == "ready"
            if r.id in received:
                lags["received"].append(received[r.id] * 1000 - r.run_at.timestamp() * 1000)
            if r.id in started:
                lags["started"].append(started[r.id] * 1000 - r.run_at.timestamp() * 1000)
                early += started[r.id] < r.run_at.timestamp()
        for key, values in lags.items():
            every[key].extend(values)
        rounds.append(
            {
                "slot": slot.isoformat(),
                "tasks": len(rows),
                "leases": len(lags["leased"]),
                "starts": len(lags["started"]),
                **{key: _lags(values) for key, values in lags.items()},
            }
        )
    submit_lead = [
        (slot - submitted_at).total_seconds() for slot, outcome, submitted_at in fires
        if outcome == "submitted"
    ]  # fmt: skip
    load = os.getloadavg()

    print(f"holding {args.held} schedules ...", flush=True)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("DELETE FROM cron.fires")
        conn.execute("DELETE FROM cron.schedules")
    held_schedules(url, args.held)
    db = create_async_engine(url, pool_size=2, max_overflow=0)
    core = CoreClient(core_url, service)
    engine = CronEngine(db, url, settings, Sender(core, 500), clock)
    builds = []
    for _ in range(3):
        began = time.perf_counter()
        await engine._rebuild()
        builds.append(time.perf_counter() - began)
    # Memory apart: tracemalloc slows every allocation, so it is not timed.
    engine.heap, engine.versions = [], {}
    tracemalloc.start()
    await engine._rebuild()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    held_in_heap = len(engine.heap)
    await core.aclose()
    await db.dispose()
    return {
        "schedules": args.schedules,
        "jitter_s": args.jitter,
        "workers": args.workers,
        "processes": args.processes,
        "promote_after_s": args.promote_after,
        "claim_max": args.claim_max,
        "ahead_s": args.ahead,
        "confirm": args.confirm,
        "timer_per_lease": args.timer_per_lease,
        "agent_slots": args.agent,
        "create_s": round(created_s, 1),
        "rounds": rounds,
        "fires": len(fires),
        "fires_expected": args.schedules * args.rounds,
        "sent_ahead": sent_ahead,
        "lead_s": args.lead,
        "submitted_before_slot_s_min": round(min(submit_lead), 2) if submit_lead else None,
        "tasks_in_core": tasks[0] if tasks else 0,
        "duplicate_keys": dupes[0] if dupes else 0,
        "attempts": leases[0] if leases else 0,
        "tasks_leased_twice": (leases[0] - leases[1]) if leases else 0,
        "leased_ahead": ahead,
        "started_before_run_at": early,
        "started_twice": started_twice,
        "claimed_from_ready": direct,
        **{key: _lags(values) for key, values in every.items()},
        "bar_p99_ms": BAR_P99_MS,
        "load_after": [round(x, 2) for x in load],
        "held": args.held,
        "held_in_heap": held_in_heap,
        "rebuild_s_median": round(statistics.median(builds), 3),
        "rebuild_s": [round(b, 3) for b in builds],
        "heap_memory_mb": round(memory / 1e6, 1),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lead", type=float, default=20.0)
    parser.add_argument("--held", type=int, default=100_000)
    parser.add_argument("--jitter", type=int, default=0, help="each schedule's jitter_s")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--processes", type=int, default=1, help="processes the fake workers are dealt out over"
    )
    parser.add_argument("--claim-max", type=int, default=256)
    parser.add_argument(
        "--ahead", type=float, default=5.0, help="the workers' ahead_s (0: no lease ahead)"
    )
    parser.add_argument(
        "--confirm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask core (one /starts request) before starting what was held, as the agent does",
    )
    parser.add_argument(
        "--timer-per-lease",
        action="store_true",
        help="a timer for each held lease, as the real agent holds them (default: one per "
        "instant for the leases due then, as a fleet of hosts would start them)",
    )
    parser.add_argument(
        "--promote-after", type=float, help="core's CAIRN_PROMOTE_AFTER_S (default: its own)"
    )
    parser.add_argument(
        "--agent",
        type=int,
        default=0,
        metavar="SLOTS",
        help="a real worker agent with this many slots instead of the fake workers; each "
        "process records its own start",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print()
    print(
        f"lag behind run_at, {result['schedules']} schedules each minute, jitter "
        f"{result['jitter_s']} s, {result['workers']} workers, ahead {result['ahead_s']} s"
        f"{' (confirmed)' if result['confirm'] else ''} (bar: started p99 < {BAR_P99_MS} ms)"
    )
    columns = ("eligible", "moved", "leased", "received", "started")
    head = f"{'slot':<27}{'tasks':>7}{'leased':>8}{'started':>8}"
    print(head + "".join(f"{k + ' p50/p99/max ms':>28}" for k in columns))
    for r in result["rounds"]:
        cells = "".join(f"{'{p50_ms}/{p99_ms}/{max_ms}'.format(**r[k]):>28}" for k in columns)
        print(f"{r['slot']:<27}{r['tasks']:>7}{r['leases']:>8}{r['starts']:>8}{cells}")
    for key in columns:
        print(f"all {key}: {result[key]}")
    print(
        f"fires {result['fires']}/{result['fires_expected']}, tasks in core "
        f"{result['tasks_in_core']}, duplicate keys {result['duplicate_keys']}, attempts "
        f"{result['attempts']} (tasks leased twice {result['tasks_leased_twice']}), leased "
        f"ahead {result['leased_ahead']}, started before run_at "
        f"{result['started_before_run_at']}, started twice {result['started_twice']}, "
        f"claimed straight from ready "
        f"{result['claimed_from_ready']}; sent ahead {result['sent_ahead']}, the last "
        f"{result['submitted_before_slot_s_min']} s before its slot (lead {result['lead_s']} s)"
    )
    print(
        f"heap: {result['held_in_heap']} schedules rebuilt in {result['rebuild_s_median']} s "
        f"(median of 3: {result['rebuild_s']}), {result['heap_memory_mb']} MB; load after "
        f"{result['load_after']}"
    )


if __name__ == "__main__":
    main()
