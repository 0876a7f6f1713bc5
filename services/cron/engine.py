"""The cron engine: one leader among the replicas fires every schedule.

Leadership is a PostgreSQL advisory lock held on a connection of the engine's own; the
same connection LISTENs for schedule changes. A standby tries for the lock every
``CAIRN_CRON_LEADER_POLL_S``; the lock goes free the moment the leader's connection dies
(a killed process closes its socket), so a standby takes over within that period.

The leader keeps a heap of ``(next fire, schedule id, version)``. It sleeps until the head
is due, a schedule changes, or ``CAIRN_CRON_TICK_S`` passes (so a wall clock that jumps is
noticed). Entries of an older version are dropped when they reach the head.

A fire is first claimed (a row in ``cron.fires``, primary key (schedule, fire time), so a
slot is claimed once however many leaders there have been), then submitted to core with the
idempotency key ``cron:<schedule>:<fire time>``, then recorded. A fire whose submission
fails because core cannot be reached stays ``pending`` and is tried again with backoff;
a restart picks pending fires up from the table. The misfire policy bounds how many fires
a schedule may have waiting, whether they wait for core or for a downtime to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.settings import libpq_url
from services.cron import store
from services.cron.domain import timing
from services.cron.fire import Made, Outgoing, Result, Sender
from services.cron.metrics import CronMetrics
from services.cron.settings import CronSettings

log = logging.getLogger("cairn.cron")

LEADER_LOCK = 0x0CA1_C709  # the advisory lock key the leader holds
# Cron's resolution is a minute: a slot less than this late cannot have a successor due.
_MIN_PERIOD = timedelta(seconds=60)
_PURGE_EVERY_S = 600.0
_PREFETCH = timedelta(seconds=2)


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class WarpedClock:
    """A wall clock that runs ``speed`` times faster than the real one and read
    ``virtual`` at the real instant ``anchor`` (UNIX seconds). For tests and rehearsals
    (``CAIRN_CRON_CLOCK_WARP``), so that processes sharing one warp agree on the time."""

    def __init__(self, anchor: float, virtual: datetime, speed: float) -> None:
        self.anchor = anchor
        self.virtual = virtual
        self.speed = speed

    @classmethod
    def parse(cls, spec: str) -> WarpedClock:
        """``"<anchor seconds>,<virtual ISO instant>,<speed>"``."""
        anchor, virtual, speed = spec.split(",")
        return cls(float(anchor), datetime.fromisoformat(virtual), float(speed))

    def now(self) -> datetime:
        return self.virtual + timedelta(seconds=(time.time() - self.anchor) * self.speed)


@dataclass
class Pending:
    """A claimed fire not yet accepted by core."""

    schedule_id: int
    fire_time: datetime
    manual: bool
    tries: int = 0
    retry_at: float = 0.0


@dataclass
class Plan:
    """What to do about one schedule that came due."""

    row: Any
    fire: list[datetime] = field(default_factory=list)
    # (slot, outcome, detail) recorded without submitting: missed or skipped.
    record: list[tuple[datetime, str, str]] = field(default_factory=list)
    through: datetime | None = None
    replace: Made | None = None


def plan_slots(row: Any, now: datetime) -> Plan:
    """Which of the slots due by ``now`` to fire, under the schedule's misfire policy."""
    plan = Plan(row=row)
    first: datetime = row.next_fire_at
    grace = timedelta(seconds=row.misfire_grace_s)
    if now - first < _MIN_PERIOD and now - first <= grace:
        plan.fire = [first]  # the usual case: one slot, on time; no croniter on this path
        plan.through = first
        return plan
    zone = timing.parse_zone(row.timezone)
    if row.misfire_policy == "catch_up":
        keep = row.catch_up_limit
    elif row.misfire_policy == "fire_once":
        keep = max(1, min(row.misfire_grace_s // 60 + 1, 1000))
    else:
        keep = min(row.misfire_grace_s // 60 + 1, 1000)
    until = now if row.ends_at is None else min(now, row.ends_at)
    # One more than needed: it tells whether older slots were left out.
    slots = timing.latest_between(row.expression, zone, row.fired_through, until, keep + 1)
    slots = [s for s in slots if s >= first] or [first]
    older = len(slots) > keep
    window = slots[-keep:]
    on_time = [s for s in window if now - s <= grace]
    if row.misfire_policy == "skip":
        fire = on_time
    elif row.misfire_policy == "fire_once":
        fire = on_time or window[-1:]
    else:
        fire = window
    if row.overlap_policy != "allow":
        fire = fire[-1:]  # fires of one batch would overlap each other
    missed = [s for s in slots if s not in fire]
    if missed or older:
        last = max(missed) if missed else slots[0]
        span = f"{first.isoformat()} .. {last.isoformat()}"
        plan.record.append(
            (last, "missed", f"missed fires {span} (misfire policy {row.misfire_policy})")
        )
    plan.fire = fire
    plan.through = max(slots)
    return plan


class CronEngine:
    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        settings: CronSettings,
        sender: Sender,
        clock: Clock | None = None,
    ) -> None:
        self.metrics = CronMetrics(lambda: self.leader)
        self.db = engine
        self.database_url = libpq_url(database_url)
        self.settings = settings
        self.sender = sender
        self.clock: Clock = clock or SystemClock()
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.leader = False
        self.heap: list[tuple[datetime, int, int]] = []
        self.versions: dict[int, int] = {}
        self.pending: dict[tuple[int, datetime], Pending] = {}
        self.changed: set[int] = set()
        self.wake = asyncio.Event()
        self._ready: dict[int, Any] = {}
        self._ready_for: datetime | None = None
        self._purged_at = 0.0
        self.on_fire: Callable[[list[Result]], None] | None = None
        self._telling: set[asyncio.Task[None]] = set()

    # --- leadership ---------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, lead while the lock is held, campaign again when it is lost."""
        while True:
            conn = await self._campaign()
            try:
                await self._lead(conn)
            except (psycopg.Error, DBAPIError, OSError) as exc:
                log.warning("cron leadership lost: %s", exc)
            finally:
                self._step_down()
                with contextlib.suppress(Exception):
                    await conn.close()
            await asyncio.sleep(self.settings.cron_leader_poll_s)

    async def _campaign(self) -> psycopg.AsyncConnection[Any]:
        while True:
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.database_url, autocommit=True, connect_timeout=5
                )
                while True:
                    cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK,))
                    row = await cur.fetchone()
                    if row and row[0]:
                        await conn.execute(f"LISTEN {store.CHANNEL}")
                        log.info("cron leader: %s", self.instance)
                        return conn
                    await asyncio.sleep(self.settings.cron_leader_poll_s)
            except (psycopg.Error, OSError) as exc:
                log.warning("cron cannot reach the database: %s", exc)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
                await asyncio.sleep(self.settings.cron_leader_poll_s)

    async def _lead(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.leader = True
        watch = asyncio.create_task(self._watch(conn), name="cron-watch")
        fire = asyncio.create_task(self._fire_loop(), name="cron-fire")
        try:
            done, _ = await asyncio.wait({watch, fire}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended it
        finally:
            for task in (watch, fire):
                task.cancel()
            for task in (watch, fire):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _watch(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Schedule changes wake the fire loop; a dead connection ends the lead."""
        while True:
            async for note in conn.notifies(timeout=self.settings.cron_leader_poll_s):
                with contextlib.suppress(ValueError):
                    self.changed.add(int(note.payload))
                self.wake.set()
            await conn.execute("SELECT 1")

    def _step_down(self) -> None:
        self.leader = False
        self.heap.clear()
        self.versions.clear()
        self.pending.clear()
        self.changed.clear()
        self._ready.clear()
        self._ready_for = None

    # --- the heap -----------------------------------------------------------------------

    async def _rebuild(self) -> None:
        """Every schedule's next fire, from the table (no croniter unless a row is behind)."""
        async with self.db.connect() as conn:
            rows = (await conn.execute(store.HEAP_ROWS)).all()
        heap = []
        self.versions = {}
        for row in rows:
            self.versions[row.id] = row.version
            heap.append((row.next_fire_at, row.id, row.version))
        heapq.heapify(heap)
        self.heap = heap
        log.info("cron heap built: %d schedules", len(heap))

    async def _load_pending(self, ids: Iterable[int] | None = None) -> None:
        async with self.db.connect() as conn:
            rows = (await conn.execute(store.PENDING)).all()
        wanted = None if ids is None else set(ids)
        for row in rows:
            if wanted is None or row.schedule_id in wanted:
                key = (row.schedule_id, row.fire_time)
                self.pending.setdefault(
                    key, Pending(row.schedule_id, row.fire_time, row.manual, row.tries)
                )

    async def _apply_changes(self) -> None:
        ids = list(self.changed)
        self.changed.clear()
        if not ids:
            return
        async with self.db.connect() as conn:
            rows = {r.id: r for r in (await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}))}
        for sid in ids:
            row = rows.get(sid)
            if row is None:
                self.versions.pop(sid, None)
                for key in [k for k in self.pending if k[0] == sid]:
                    del self.pending[key]
                continue
            if row.next_fire_at is None:
                self.versions.pop(sid, None)  # paused, ended, or never again
            else:
                self.versions[sid] = row.version
                heapq.heappush(self.heap, (row.next_fire_at, sid, row.version))
        await self._load_pending(ids)
        if len(self.heap) > 2 * len(self.versions) + 1000:
            self.heap = [e for e in self.heap if self.versions.get(e[1]) == e[2]]
            heapq.heapify(self.heap)

    def _pop_due(self, now: datetime) -> list[tuple[datetime, int, int]]:
        due = []
        while self.heap and self.heap[0][0] <= now:
            entry = heapq.heappop(self.heap)
            if self.versions.get(entry[1]) == entry[2]:
                due.append(entry)
        return due

    # --- firing -------------------------------------------------------------------------

    async def _fire_loop(self) -> None:
        await self._rebuild()
        await self._load_pending()
        loop = asyncio.get_running_loop()
        while True:
            self.wake.clear()
            await self._apply_changes()
            now = self.clock.now()
            due = self._pop_due(now)
            if due:
                await self._fire_due(due, now)
            if self.pending and min(p.retry_at for p in self.pending.values()) <= loop.time():
                await self._retry_pending()
            if loop.time() - self._purged_at > _PURGE_EVERY_S:
                await self._purge()
                self._purged_at = loop.time()
            await self._prefetch(self.clock.now())
            await self._sleep(loop)

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> None:
        timeout = self.settings.cron_tick_s
        if self.heap:
            timeout = min(timeout, (self.heap[0][0] - self.clock.now()).total_seconds())
        if self.pending:
            timeout = min(timeout, min(p.retry_at for p in self.pending.values()) - loop.time())
        if timeout <= 0:
            await asyncio.sleep(0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)

    async def _fire_due(self, due: list[tuple[datetime, int, int]], now: datetime) -> None:
        """Send what is due, then record it. Sending first is safe: a slot not yet recorded
        when this process dies is sent again by the next leader with the same idempotency
        key, and core answers with the task the first send made."""
        rows = {}
        for _, sid, version in due:
            row = self._ready.pop(sid, None)
            if row is not None and row.version == version:
                rows[sid] = row
        missing = [sid for _, sid, _ in due if sid not in rows]
        if missing:
            async with self.db.connect() as conn:
                for r in await conn.execute(store.SCHEDULES_BY_ID, {"ids": missing}):
                    rows[r.id] = r
        plans: list[Plan] = []
        for at, sid, version in due:
            row = rows.get(sid)
            if row is None or row.version != version or row.paused or row.next_fire_at != at:
                continue  # changed under us: its notification brings the new version
            plans.append(plan_slots(row, now))
        if not plans:
            return
        await self._check_overlap(plans)
        for plan in plans:
            if plan.replace is not None:
                with contextlib.suppress(Exception):
                    await self.sender.cancel(plan.replace)
        outgoing = [
            Outgoing(plan.row.id, slot, False, plan.row.owner, plan.row.target)
            for plan in plans
            for slot in plan.fire
        ]
        results = await self.sender.send(outgoing) if outgoing else []
        await self._settle(plans, results)
        await self._advance(plans)

    async def _settle(self, plans: list[Plan], results: list[Result]) -> None:
        """Record the fires and what became of them, and how far each schedule has fired,
        in one transaction. Fires core did not take wait, pending, for another try."""
        fired: list[tuple[Any, ...]] = [
            (r.schedule_id, r.fire_time, r.outcome, r.task_id, r.run_id, r.submitted_at,
             r.detail, 1)
            for r in results
        ]  # fmt: skip
        for plan in plans:
            fired.extend((plan.row.id, s, o, None, None, None, d, 0) for s, o, d in plan.record)
        throughs = [
            (p.row.id, p.row.version, p.through, p.row.next_fire_at)
            for p in plans
            if p.through is not None
        ]
        async with self.db.begin() as conn:
            if fired:
                await conn.execute(
                    store.FIRED, dict(zip(store.FIRED_COLS, store.columns(fired, 8), strict=True))
                )
            await conn.execute(
                store.ADVANCE, dict(zip(_ADVANCE_COLS, store.columns(throughs, 4), strict=True))
            )
        self.metrics.fired(
            (outcome, at, submitted) for _, at, outcome, _, _, submitted, *_ in fired
        )
        owners = {p.row.id: p.row.owner for p in plans}
        self._tell([(f[0], f[1], f[2], f[6]) for f in fired], owners)
        for sid, at, outcome, task_id, run_id, _, detail, _ in fired:
            ids = {"schedule_id": sid, "task_id": task_id, "run_id": run_id}
            level = logging.WARNING if outcome in ("failed", "pending") else logging.DEBUG
            log.log(level, "schedule %s fire %s: %s %s", sid, at, outcome, detail or "", extra=ids)
            if outcome == "pending":
                entry = self.pending.setdefault((sid, at), Pending(sid, at, False))
                entry.tries += 1
                entry.retry_at = self._backoff(entry.tries)
        if self.on_fire is not None:
            self.on_fire(results)

    async def _check_overlap(self, plans: list[Plan]) -> None:
        """Apply ``forbid`` and ``replace`` against what each schedule's previous fire made
        (a task in core, or a run in the DAG service)."""
        guarded = [p for p in plans if p.row.overlap_policy != "allow" and p.fire]
        if not guarded:
            return
        async with self.db.connect() as conn:
            last: dict[int, Made] = {
                r.schedule_id: ("task", r.task_id) if r.task_id is not None else ("run", r.run_id)
                for r in await conn.execute(
                    store.LAST_TARGETS, {"ids": [p.row.id for p in guarded]}
                )
            }
        if not last:
            return
        try:
            live = await self.sender.active(list(last.values()))
        except Exception as exc:
            # Without the previous fire's state the policy cannot be applied: the fires
            # wait, pending, and are tried again later (without the check).
            log.warning("cron overlap check failed: %s", exc)
            for plan in guarded:
                if plan.row.id in last:
                    plan.record.extend(
                        (s, "pending", f"overlap check failed: {exc}") for s in plan.fire
                    )
                    plan.fire = []
            return
        for plan in guarded:
            made = last.get(plan.row.id)
            if made is None or not live.get(made):
                continue
            if plan.row.overlap_policy == "forbid":
                plan.record.extend(
                    (s, "skipped_overlap", f"{made[0]} {made[1]} is still running")
                    for s in plan.fire
                )
                plan.fire = []
            else:
                plan.replace = made

    def _backoff(self, tries: int) -> float:
        delay: float = min(self.settings.cron_retry_max_s, 0.5 * 2.0 ** min(tries, 16))
        return asyncio.get_running_loop().time() + delay

    async def _record(self, results: list[Result]) -> None:
        for result in results:
            key = (result.schedule_id, result.fire_time)
            if result.outcome == "pending":
                entry = self.pending.get(key)
                if entry is not None:
                    entry.tries += 1
                    entry.retry_at = self._backoff(entry.tries)
            else:
                self.pending.pop(key, None)
        if results:
            async with self.db.begin() as conn:
                await store.record(conn, results)
            self.metrics.fired((r.outcome, r.fire_time, r.submitted_at) for r in results)
        if self.on_fire is not None:
            self.on_fire(results)

    async def _advance(self, plans: list[Plan]) -> None:
        """Each fired schedule's next slot: stored, and pushed on the heap. Schedules that
        share an expression, zone and last slot share the computation."""
        nexts = []
        cache: dict[tuple[Any, ...], datetime | None] = {}
        for plan in plans:
            row = plan.row
            after = max(plan.through or row.next_fire_at, row.fired_through)
            key = (row.expression, row.timezone, row.starts_at, row.ends_at, after)
            if key not in cache:
                cache[key] = store.timing_of(row).next_after(after)
            nxt = cache[key]
            nexts.append((row.id, row.version, after, nxt))
            if nxt is not None:
                heapq.heappush(self.heap, (nxt, row.id, row.version))
        async with self.db.begin() as conn:
            await conn.execute(
                store.ADVANCE, dict(zip(_ADVANCE_COLS, store.columns(nexts, 4), strict=True))
            )

    async def _prefetch(self, now: datetime) -> None:
        """Read ahead the rows of schedules due within ``_PREFETCH``, so that at the slot
        the engine goes straight to sending."""
        if not self.heap or self.heap[0][0] - now > _PREFETCH or self._ready_for == self.heap[0][0]:
            return
        self._ready_for = self.heap[0][0]
        horizon = now + _PREFETCH
        ids = [
            sid
            for at, sid, version in self.heap
            if at <= horizon and self.versions.get(sid) == version and sid not in self._ready
        ]
        if not ids:
            return
        async with self.db.connect() as conn:
            for row in await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}):
                self._ready[row.id] = row

    async def _retry_pending(self) -> None:
        """Send again the fires core did not take, within each schedule's misfire policy."""
        loop_now = asyncio.get_running_loop().time()
        ready = [p for p in self.pending.values() if p.retry_at <= loop_now]
        ids = sorted({p.schedule_id for p in ready})
        async with self.db.connect() as conn:
            rows = {r.id: r for r in (await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}))}
        now = self.clock.now()
        dropped: list[Result] = []
        outgoing: list[Outgoing] = []
        for sid in ids:
            row = rows.get(sid)
            mine = sorted(
                (p for p in self.pending.values() if p.schedule_id == sid),
                key=lambda p: p.fire_time,
            )
            if row is None:
                for p in mine:
                    del self.pending[(sid, p.fire_time)]
                continue
            keep = _keep_pending(row, [p for p in mine if not p.manual], now)
            for p in mine:
                if p.manual or p.fire_time in keep:
                    if p.retry_at <= loop_now:
                        outgoing.append(Outgoing(sid, p.fire_time, p.manual, row.owner, row.target))
                else:
                    dropped.append(
                        Result(
                            sid,
                            p.fire_time,
                            "missed",
                            detail="core was unreachable; dropped by the misfire policy "
                            f"{row.misfire_policy}",
                        )
                    )
        if dropped:
            await self._record(dropped)
        sent = await self.sender.send(outgoing) if outgoing else []
        if sent:
            await self._record(sent)
        owners = {sid: row.owner for sid, row in rows.items()}
        fires = dropped + sent
        self._tell([(r.schedule_id, r.fire_time, r.outcome, r.detail) for r in fires], owners)

    def _tell(
        self, fires: list[tuple[int, datetime, str, str | None]], owners: dict[int, str]
    ) -> None:
        """Post missed and failed fires for notifications, off the fire path."""
        told = [
            (owners[f[0]], *f) for f in fires if f[2] in ("missed", "failed") and f[0] in owners
        ]
        if told:
            task = asyncio.create_task(self.sender.notify(told), name="cairn-cron-notify")
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _purge(self) -> None:
        age_s = self.settings.cron_fire_retention_days * 86400
        async with self.db.begin() as conn:
            await conn.execute(store.PURGE_FIRES, {"age_s": age_s, "limit": 10_000})

    def status(self) -> dict[str, Any]:
        live = [e for e in self.heap if self.versions.get(e[1]) == e[2]]
        return {
            "instance": self.instance,
            "leader": self.leader,
            "schedules": len(self.versions),
            "pending_fires": len(self.pending),
            "next_fire_at": min(live)[0] if live else None,
        }


def _keep_pending(row: Any, waiting: list[Pending], now: datetime) -> set[datetime]:
    """Which waiting fires the misfire policy still wants sent."""
    times = [p.fire_time for p in waiting]
    if row.misfire_policy == "skip":
        grace = timedelta(seconds=row.misfire_grace_s)
        return {t for t in times if now - t <= grace}
    if row.misfire_policy == "fire_once":
        return set(times[-1:])
    return set(times[-row.catch_up_limit :])


_ADVANCE_COLS = ("ids", "versions", "throughs", "nexts")
