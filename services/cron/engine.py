"""The cron engine: one leader among the replicas fires every schedule.

Leadership is the shared elector's (``libs/common/leader.py``): a PostgreSQL advisory
lock held on a connection of its own, checked every poll, and an epoch that fences every
write of the leader; the same connection LISTENs for schedule changes. A standby tries for the lock every
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

Fires of task targets with overlap ``allow`` are sent ``CAIRN_CRON_LEAD_S`` ahead of their
slot with ``run_at`` = the slot (plus the schedule's jitter), so core starts them on time
however many share the slot (``domain/ontime.py``). A change to such a schedule before the
slot withdraws what was sent ahead: the task is cancelled, the fire marked ``withdrawn``,
and the slot planned again from the changed schedule (sent under a key of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common import locks, waits
from libs.common.leader import (
    FAILED_LEAD_PAUSE_MAX_S,
    Elector,
    LeadershipLost,
    Lease,
    lead_forever,
)
from libs.common.settings import libpq_url
from services.cron import store
from services.cron.domain import ontime, timing
from services.cron.domain.fires import Result
from services.cron.fire import Made, Outgoing, Sender
from services.cron.metrics import CronMetrics
from services.cron.settings import CronSettings

log = logging.getLogger("cairn.cron")

LEADER_LOCK = locks.CRON_LEADER  # the advisory lock key the leader holds
# Cron's resolution is a minute: a slot less than this late cannot have a successor due.
_MIN_PERIOD = timedelta(seconds=60)
_PURGE_EVERY_S = 600.0
_PREFETCH = timedelta(seconds=2)
# A fire sent ahead is withdrawn only if its slot is at least this far off: nearer, core
# may be starting it already, and the change applies from the next slot.
_WITHDRAW_MARGIN = timedelta(milliseconds=200)


class Clock(Protocol):
    def now(self) -> datetime: ...

    def real(self, at: datetime) -> datetime:
        """The real instant at which this clock will read ``at``: the ``run_at`` core
        (which keeps real time) is given."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def real(self, at: datetime) -> datetime:
        return at


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

    def real(self, at: datetime) -> datetime:
        seconds = self.anchor + (at - self.virtual).total_seconds() / self.speed
        return datetime.fromtimestamp(seconds, UTC)


@dataclass
class Pending:
    """A claimed fire not yet accepted by core."""

    schedule_id: int
    fire_time: datetime
    manual: bool
    tries: int = 0
    retry_at: float = 0.0
    backfill: bool = False
    withdrawn: int = 0


@dataclass
class Ahead:
    """A fire sent before its slot: what it made, from which version of its schedule."""

    task_id: int
    version: int | None


@dataclass
class Plan:
    """What to do about one schedule that came due."""

    row: Any
    fire: list[datetime] = field(default_factory=list)
    # (slot, outcome, detail) recorded without submitting: missed or skipped.
    record: list[tuple[datetime, str, str]] = field(default_factory=list)
    through: datetime | None = None
    replace: Made | None = None
    #: the slot after ``through`` (None: no more, or it cannot be planned), and from when
    after: datetime | None = None
    next: datetime | None = None


def plan_or_fail(row: Any, now: datetime) -> Plan:
    """``plan_slots``, or for a row that cannot be planned (stored under older rules, or
    its zone gone from the tz database) a plan that fires nothing: ``fail`` says why."""
    try:
        return plan_slots(row, now)
    except Exception as exc:
        return fail(Plan(row=row, through=row.next_fire_at), exc)


def fail(plan: Plan, exc: Exception) -> Plan:
    """The plan of a schedule that cannot be planned: what it would fire (its due slot if
    nothing) is recorded ``failed`` naming why, and it has no next fire, so it waits until
    it is changed. Any other schedule due with it fires all the same."""
    row = plan.row
    log.warning("schedule %s cannot be planned; it waits until changed: %r", row.id, exc)
    why = f"the schedule cannot be planned, and waits until it is changed: {exc}"[:500]
    slots = plan.fire or [row.next_fire_at]
    plan.record = [r for r in plan.record if r[0] not in slots]  # one row a slot
    plan.record.extend((s, "failed", why) for s in slots)
    plan.fire, plan.next = [], None
    plan.after = max(plan.through or row.next_fire_at, row.fired_through)
    return plan


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
        self.elector = Elector(
            database_url,
            name="cron",
            key=LEADER_LOCK,
            table="cron.leader",
            poll_s=settings.cron_leader_poll_s,
        )
        self.lease: Lease | None = None
        self.heap: list[tuple[datetime, int, int, datetime]] = []
        self.lead = timedelta(seconds=settings.cron_lead_s)
        self.ahead: dict[int, dict[datetime, Ahead]] = {}
        self.withdrawn: dict[tuple[int, datetime], int] = {}
        self.versions: dict[int, int] = {}
        self.pending: dict[tuple[int, datetime], Pending] = {}
        self.changed: set[int] = set()
        self.wake = asyncio.Event()
        self._ready: dict[int, Any] = {}
        self._ready_for: datetime | None = None
        self._purged_at = 0.0
        self.on_fire: Callable[[list[Result]], None] | None = None
        self.turned_at: float | None = None  # loop time of the fire loop's last turn
        #: (first, last) loop time and kind of the leads that failed one after another
        #: (``lead_forever``'s ``failed``); a fire loop turn that completes clears it
        self.failing: tuple[float, float, str] | None = None
        self._telling: set[asyncio.Task[None]] = set()

    # --- leadership ---------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, lead while the lock is held, campaign again when it is lost."""

        async def lead(lease: Lease) -> None:
            await store.listen(lease.conn)
            self.lease = lease
            await self._lead(lease)

        await lead_forever(
            self.elector,
            lead,
            pause_s=self.settings.cron_leader_poll_s,
            stepped_down=self._step_down,
            failed=self._lead_failed,
        )

    def _lead_failed(self, exc: Exception) -> None:
        now = asyncio.get_running_loop().time()
        first = now if self.failing is None else self.failing[0]
        self.failing = (first, now, type(exc).__name__)

    async def _lead(self, lease: Lease) -> None:
        self.leader = True
        self.turned_at = asyncio.get_running_loop().time()
        watch = asyncio.create_task(self._watch(lease), name="cron-watch")
        fire = asyncio.create_task(self._fire_loop(), name="cron-fire")
        try:
            done, _ = await asyncio.wait({watch, fire}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended it
        finally:
            # Not ``await task`` under suppress(CancelledError): a stop of the engine
            # that came while it waited here was swallowed, and it campaigned again.
            await waits.stop(watch, fire)

    async def _watch(self, lease: Lease) -> None:
        """Schedule changes wake the fire loop; a lost lock or epoch ends the lead."""
        while True:
            async for note in lease.conn.notifies(timeout=self.settings.cron_leader_poll_s):
                with contextlib.suppress(ValueError):
                    self.changed.add(int(note.payload))
                self.wake.set()
            await lease.check()

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """A write transaction of the leader, fenced by its epoch."""
        lease = self.lease
        if lease is None:
            raise LeadershipLost("cron writes fires only while it leads")
        async with self.db.begin() as conn:
            await lease.fence(conn)
            yield conn

    def _step_down(self) -> None:
        self.leader = False
        self.lease = None
        self.turned_at = None
        self.heap.clear()
        self.versions.clear()
        self.pending.clear()
        self.changed.clear()
        self._ready.clear()
        self._ready_for = None
        self.ahead.clear()
        self.withdrawn.clear()

    # --- the heap -----------------------------------------------------------------------

    def _entry(self, row: Any, slot: datetime) -> tuple[datetime, int, int, datetime]:
        """A heap entry: (when to send, schedule, version, slot)."""
        kind = row.target.get("kind", "task") if isinstance(row.target, dict) else "task"
        return self._entry_of(row.id, row.version, slot, kind, row.overlap_policy, row.jitter_s)

    def _entry_of(
        self, sid: int, version: int, slot: datetime, kind: str, overlap: str, jitter_s: int
    ) -> tuple[datetime, int, int, datetime]:
        if jitter_s == 0 and not ontime.sent_ahead(kind, overlap, self.lead):
            return (slot, sid, version, slot)  # the common case without a lead: no hashing
        return (ontime.send_at(slot, sid, kind, overlap, jitter_s, self.lead), sid, version, slot)

    def _run_at(self, row: Any, slot: datetime) -> datetime | None:
        """When core may start the task of ``slot``'s fire: the slot plus the jitter, for
        fires sent ahead; at once for the others (they are sent at that instant)."""
        if not ontime.sent_ahead(row.target.get("kind", "task"), row.overlap_policy, self.lead):
            return None
        return self.clock.real(slot + ontime.jitter(row.id, row.jitter_s))

    def _outgoing(
        self, row: Any, slot: datetime, manual: bool = False, backfill: bool = False
    ) -> Outgoing:
        return Outgoing(
            row.id,
            slot,
            manual,
            row.owner,
            row.target,
            run_at=None if manual else self._run_at(row, slot),
            backfill=backfill,
            withdrawn=0 if manual else self.withdrawn.get((row.id, slot), 0),
            changed_by=row.changed_by,
        )

    async def _rebuild(self) -> None:
        """Every schedule's next fire, from the table (no croniter unless a row is behind)."""
        async with self.db.connect() as conn:
            rows = (await conn.execute(store.HEAP_ROWS)).all()
            ahead = (await conn.execute(store.AHEAD, {"now": self.clock.now()})).all()
        heap = []
        self.versions = versions = {}
        entry_of = self._entry_of
        for sid, version, slot, _, overlap, jitter_s, kind in rows:
            versions[sid] = version
            heap.append(entry_of(sid, version, slot, kind, overlap, jitter_s))
        heapq.heapify(heap)
        self.heap = heap
        self.ahead, self.withdrawn = {}, {}
        for f in ahead:
            if f.withdrawn:
                self.withdrawn[(f.schedule_id, f.fire_time)] = f.withdrawn
            if f.outcome == "submitted" and f.task_id is not None:
                self.ahead.setdefault(f.schedule_id, {})[f.fire_time] = Ahead(f.task_id, f.version)
        log.info("cron heap built: %d schedules", len(heap))
        # A change made while no engine led is found the same way as a notified one.
        self.changed.update(self.ahead)

    async def _load_pending(self, ids: Iterable[int] | None = None) -> None:
        async with self.db.connect() as conn:
            rows = (await conn.execute(store.PENDING)).all()
        wanted = None if ids is None else set(ids)
        now = asyncio.get_running_loop().time()
        paced = 0
        for row in rows:
            if wanted is None or row.schedule_id in wanted:
                key = (row.schedule_id, row.fire_time)
                if key in self.pending:
                    continue
                entry = Pending(
                    row.schedule_id,
                    row.fire_time,
                    row.manual,
                    row.tries,
                    backfill=row.backfill,
                    withdrawn=row.withdrawn,
                )
                if row.withdrawn:
                    self.withdrawn[key] = row.withdrawn
                if row.backfill:  # paced: a backfill of a year does not flood core
                    entry.retry_at = now + paced / self.settings.cron_backfill_rate
                    paced += 1
                self.pending[key] = entry

    async def _apply_changes(self) -> None:
        ids = list(self.changed)
        self.changed.clear()
        if not ids:
            return
        async with self.db.connect() as conn:
            rows = {r.id: r for r in (await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}))}
        await self._withdraw(ids, rows)
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
                heapq.heappush(self.heap, self._entry(row, row.next_fire_at))
        await self._load_pending(ids)
        if len(self.heap) > 2 * len(self.versions) + 1000:
            self.heap = [e for e in self.heap if self.versions.get(e[1]) == e[2]]
            heapq.heapify(self.heap)

    async def _withdraw(self, ids: list[int], rows: dict[int, Any]) -> None:
        """Withdraw the fires sent ahead from an older version of a changed schedule (or
        of one paused or deleted): cancel their tasks, mark them ``withdrawn``, and wind
        the schedule back so those slots are planned again from what it is now. A task
        that could not be cancelled (core down) keeps its schedule in ``changed``."""
        cutoff = self.clock.now() + _WITHDRAW_MARGIN
        stale = [
            (sid, slot)
            for sid in ids
            for slot, fire in self.ahead.get(sid, {}).items()
            if slot > cutoff and _outdated(rows.get(sid), fire)
        ]
        withdrawn: list[tuple[int, datetime]] = []
        for sid, slot in stale:
            try:
                gone = await self.sender.withdraw(self.ahead[sid][slot].task_id)
            except Exception as exc:
                log.warning("cron cannot withdraw schedule %s fire %s: %s", sid, slot, exc)
                self.changed.add(sid)
                continue
            if gone:
                withdrawn.append((sid, slot))
            else:  # core started it already: it is the slot's run
                del self.ahead[sid][slot]
        if withdrawn:
            await self._store_withdrawals(withdrawn, rows, cutoff)

    async def _store_withdrawals(
        self, withdrawn: list[tuple[int, datetime]], rows: dict[int, Any], cutoff: datetime
    ) -> None:
        rewind: list[tuple[int, int, datetime, datetime | None]] = []
        paused: list[int] = []
        for sid in {sid for sid, _ in withdrawn}:
            row = rows.get(sid)
            if row is None:
                continue
            kept = [s for s in self.ahead[sid] if (sid, s) not in withdrawn]
            through = max([cutoff, *kept])
            if row.paused:
                paused.append(sid)
            else:
                after = min(row.fired_through, through)
                rewind.append((sid, row.version, through, store.timing_of(row).next_after(after)))
        async with self._write() as conn:
            counts = await conn.execute(
                store.WITHDRAW,
                {"ids": [sid for sid, _ in withdrawn], "times": [s for _, s in withdrawn]},
            )
            for sid, slot, count in counts:
                self.withdrawn[(sid, slot)] = count
            if rewind:
                await conn.execute(
                    store.REWIND, dict(zip(_ADVANCE_COLS, store.columns(rewind, 4), strict=True))
                )
            if paused:
                await conn.execute(store.REWIND_PAUSED, {"ids": paused, "through": cutoff})
        for sid, slot in withdrawn:
            del self.ahead[sid][slot]
            log.info("schedule %s fire %s withdrawn: changed before its slot", sid, slot)
        # The rows changed under the notification: read them again, at once.
        self.changed.update(sid for sid, _, _, _ in rewind)
        self.wake.set()
        self.metrics.withdrawn(len(withdrawn))

    def _pop_due(self, now: datetime) -> list[tuple[datetime, int, int, datetime]]:
        """The live entries due by ``now``, each once: a schedule read again after a
        change may have pushed the same entry twice. (Of two entries of one version with
        different slots, ``_fire_due`` keeps the one its row names.)"""
        due = []
        seen: set[tuple[datetime, int, int, datetime]] = set()
        while self.heap and self.heap[0][0] <= now:
            entry = heapq.heappop(self.heap)
            if self.versions.get(entry[1]) == entry[2] and entry not in seen:
                seen.add(entry)
                due.append(entry)
        return due

    # --- firing -------------------------------------------------------------------------

    async def _fire_loop(self) -> None:
        await self._rebuild()
        await self._load_pending()
        loop = asyncio.get_running_loop()
        scanned = loop.time()
        while True:
            self.turned_at = loop.time()
            self.wake.clear()
            await self._apply_changes()
            now = self.clock.now()
            due = self._pop_due(now)
            if due:
                await self._fire_due(due, now)
            if loop.time() - scanned > self.settings.cron_pending_scan_s:
                await self._load_pending()
                scanned = loop.time()
            if self.pending and min(p.retry_at for p in self.pending.values()) <= loop.time():
                await self._retry_pending()
            if loop.time() - self._purged_at > _PURGE_EVERY_S:
                await self._purge()
                self._forget_past(now)
                self._purged_at = loop.time()
            await self._prefetch(self.clock.now())
            self.failing = None  # a turn went through
            await self._sleep(loop)

    def _forget_past(self, now: datetime) -> None:
        """Fires sent ahead whose slot has passed cannot be withdrawn any more."""
        for sid in list(self.ahead):
            fires = {s: f for s, f in self.ahead[sid].items() if s > now}
            if fires:
                self.ahead[sid] = fires
            else:
                del self.ahead[sid]
        self.withdrawn = {k: v for k, v in self.withdrawn.items() if k[1] > now - _MIN_PERIOD}

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> None:
        timeout = self.settings.cron_tick_s
        if self.heap:
            timeout = min(timeout, (self.heap[0][0] - self.clock.now()).total_seconds())
        if self.pending:
            timeout = min(timeout, min(p.retry_at for p in self.pending.values()) - loop.time())
        if timeout <= 0:
            await asyncio.sleep(0)
            return
        await waits.woken(self.wake, timeout)

    async def _fire_due(
        self, due: list[tuple[datetime, int, int, datetime]], now: datetime
    ) -> None:
        """Send what is due, then record it. Sending first is safe: a slot not yet recorded
        when this process dies is sent again by the next leader with the same idempotency
        key, and core answers with the task the first send made."""
        rows = {}
        for _, sid, version, _ in due:
            row = self._ready.pop(sid, None)
            if row is not None and row.version == version:
                rows[sid] = row
        missing = [sid for _, sid, _, _ in due if sid not in rows]
        if missing:
            async with self.db.connect() as conn:
                for r in await conn.execute(store.SCHEDULES_BY_ID, {"ids": missing}):
                    rows[r.id] = r
        plans: list[Plan] = []
        for _, sid, version, slot in due:
            row = rows.get(sid)
            if row is None or row.version != version or row.paused or row.next_fire_at != slot:
                continue  # changed under us: its notification brings the new version
            plans.append(plan_or_fail(row, now))
        if not plans:
            return
        _next_slots(plans)  # before sending: a schedule whose next slot fails sends nothing
        await self._check_overlap(plans)
        for plan in plans:
            if plan.replace is not None:
                with contextlib.suppress(Exception):
                    await self.sender.cancel(plan.replace)
        outgoing = [self._outgoing(plan.row, slot) for plan in plans for slot in plan.fire]
        results = await self.sender.send(outgoing) if outgoing else []
        await self._settle(plans, results, now)

    async def _settle(self, plans: list[Plan], results: list[Result], now: datetime) -> None:
        """Record the fires and what became of them, and each schedule's next slot, in one
        transaction (so a slot is never recorded without the schedule moving past it);
        then push the next slots on the heap. Fires core did not take wait, pending, for
        another try. Schedules that share an expression, zone and last slot share the
        croniter computation."""
        versions = {p.row.id: p.row.version for p in plans}
        fired: list[tuple[Any, ...]] = [
            (r.schedule_id, r.fire_time, r.outcome, r.task_id, r.run_id, r.submitted_at,
             r.detail, 1, versions.get(r.schedule_id))
            for r in results
        ]  # fmt: skip
        for plan in plans:
            fired.extend(
                (plan.row.id, s, o, None, None, None, d, 0, plan.row.version)
                for s, o, d in plan.record
            )
        nexts = [(p.row.id, p.row.version, p.after, p.next) for p in plans]
        async with self._write() as conn:
            if fired:
                await conn.execute(
                    store.FIRED, dict(zip(store.FIRED_COLS, store.columns(fired, 9), strict=True))
                )
            await conn.execute(
                store.ADVANCE, dict(zip(_ADVANCE_COLS, store.columns(nexts, 4), strict=True))
            )
        for plan, (_, _, _, nxt) in zip(plans, nexts, strict=True):
            if nxt is not None:
                heapq.heappush(self.heap, self._entry(plan.row, nxt))
        self.metrics.fired(
            (outcome, at, submitted) for _, at, outcome, _, _, submitted, *_ in fired
        )
        owners = {p.row.id: p.row.owner for p in plans}
        self._tell([(f[0], f[1], f[2], f[6]) for f in fired], owners)
        for sid, at, outcome, task_id, run_id, _, detail, _, version in fired:
            ids = {"schedule_id": sid, "task_id": task_id, "run_id": run_id}
            level = logging.WARNING if outcome in ("failed", "pending") else logging.DEBUG
            log.log(level, "schedule %s fire %s: %s %s", sid, at, outcome, detail or "", extra=ids)
            if outcome == "pending":
                waiting = self.pending.setdefault((sid, at), Pending(sid, at, False))
                waiting.tries += 1
                waiting.retry_at = self._backoff(waiting.tries)
            elif outcome == "submitted" and task_id is not None and at > now:
                self.ahead.setdefault(sid, {})[at] = Ahead(task_id, version)
        if self.on_fire is not None:
            self.on_fire(results)

    async def _check_overlap(self, plans: list[Plan]) -> None:
        """Apply ``forbid`` and ``replace`` against what each schedule's previous fire made
        (a task in core, or a run in the DAG service)."""
        guarded = [p for p in plans if p.row.overlap_policy != "allow" and p.fire]
        if not guarded:
            return
        last = await self._previous([(p.row.id, min(p.fire)) for p in guarded])
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

    async def _previous(self, slots: list[tuple[int, datetime]]) -> dict[int, Made]:
        """For each (schedule, slot): what the schedule's fire before that slot made."""
        async with self.db.connect() as conn:
            return {
                r.schedule_id: ("task", r.task_id) if r.task_id is not None else ("run", r.run_id)
                for r in await conn.execute(
                    store.LAST_TARGETS,
                    {"ids": [sid for sid, _ in slots], "slots": [at for _, at in slots]},
                )
            }

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
            async with self._write() as conn:
                await store.record(conn, results)
            self.metrics.fired((r.outcome, r.fire_time, r.submitted_at) for r in results)
        if self.on_fire is not None:
            self.on_fire(results)

    async def _prefetch(self, now: datetime) -> None:
        """Read ahead the rows of schedules due within ``_PREFETCH``, so that at the slot
        the engine goes straight to sending."""
        if not self.heap or self.heap[0][0] - now > _PREFETCH or self._ready_for == self.heap[0][0]:
            return
        self._ready_for = self.heap[0][0]
        horizon = now + _PREFETCH
        ids = [
            sid
            for at, sid, version, _ in self.heap
            if at <= horizon and self.versions.get(sid) == version and sid not in self._ready
        ]
        if not ids:
            return
        async with self.db.connect() as conn:
            for row in await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}):
                self._ready[row.id] = row

    async def _retry_pending(self) -> None:
        """Send the fires waiting in ``pending``: those core did not take (within each
        schedule's misfire policy), manual triggers, and backfills (paced, and one at a
        time for a schedule whose overlap policy is not ``allow``)."""
        loop_now = asyncio.get_running_loop().time()
        ids = sorted({p.schedule_id for p in self.pending.values() if p.retry_at <= loop_now})
        async with self.db.connect() as conn:
            rows = {r.id: r for r in (await conn.execute(store.SCHEDULES_BY_ID, {"ids": ids}))}
        now = self.clock.now()
        dropped: list[Result] = []
        outgoing: list[Outgoing] = []
        sequential: list[Pending] = []
        for sid in ids:
            mine = sorted(
                (p for p in self.pending.values() if p.schedule_id == sid),
                key=lambda p: p.fire_time,
            )
            row = rows.get(sid)
            if row is None:
                for p in mine:
                    del self.pending[(sid, p.fire_time)]
                continue
            backfills = [p for p in mine if p.backfill]
            if backfills and row.overlap_policy != "allow":
                sequential.append(backfills[0])  # one at a time: see _next_in_line
            self._sort_pending(row, mine, now, loop_now, outgoing, dropped)
        if sequential:
            outgoing.extend(await self._next_in_line(sequential, rows))
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

    def _sort_pending(
        self,
        row: Any,
        mine: list[Pending],
        now: datetime,
        loop_now: float,
        outgoing: list[Outgoing],
        dropped: list[Result],
    ) -> None:
        """One schedule's waiting fires that are due a try: to send, or to drop."""
        keep = _keep_pending(row, [p for p in mine if not p.manual and not p.backfill], now)
        for p in mine:
            if p.retry_at > loop_now:
                continue
            if p.manual:
                outgoing.append(self._outgoing(row, p.fire_time, manual=True))
            elif p.backfill:
                if row.overlap_policy == "allow":
                    outgoing.append(self._outgoing(row, p.fire_time, backfill=True))
            elif p.fire_time in keep:
                outgoing.append(self._outgoing(row, p.fire_time))
            else:
                dropped.append(
                    Result(
                        row.id,
                        p.fire_time,
                        "missed",
                        detail="core was unreachable; dropped by the misfire policy "
                        f"{row.misfire_policy}",
                    )
                )

    async def _next_in_line(self, heads: list[Pending], rows: dict[int, Any]) -> list[Outgoing]:
        """The earliest backfill fire of each schedule that forbids overlap, once the
        fire before it is over; the others wait a second and look again."""
        ready = [p for p in heads if p.retry_at <= asyncio.get_running_loop().time()]
        if not ready:
            return []
        loop = asyncio.get_running_loop()
        last = await self._previous([(p.schedule_id, p.fire_time) for p in ready])
        try:
            live = await self.sender.active(list(last.values())) if last else {}
        except Exception as exc:
            log.warning("cron overlap check of a backfill failed: %s", exc)
            for p in ready:
                p.retry_at = loop.time() + 1.0
            return []
        out = []
        for p in ready:
            made = last.get(p.schedule_id)
            if made is not None and live.get(made):
                p.retry_at = loop.time() + 1.0
            else:
                out.append(self._outgoing(rows[p.schedule_id], p.fire_time, backfill=True))
        return out

    async def _purge(self) -> None:
        age_s = self.settings.cron_fire_retention_days * 86400
        async with self._write() as conn:
            await conn.execute(store.PURGE_FIRES, {"age_s": age_s, "limit": 10_000})

    def unready(self, runner: asyncio.Task[None] | None) -> str | None:
        """Why this replica's engine cannot fire (for ``/readyz``), or None: its task
        ended, or it leads and its fire loop has not turned for a minute, or its leads
        have failed one after another for as long (and the last failed within the
        longest pause between them: a replica another one relieved is ready again)."""
        if runner is None or runner.done():
            return "the cron engine is not running"
        if self.failing is not None:
            first, last, kind = self.failing
            recent = FAILED_LEAD_PAUSE_MAX_S + 2 * self.settings.cron_leader_poll_s
            now = asyncio.get_running_loop().time()
            if last - first >= self.settings.cron_stall_s and now - last <= recent:
                return (
                    f"the cron engine's leads have failed for {last - first:.0f} s ({kind});"
                    " see its log"
                )
        if self.leader and self.turned_at is not None:  # set when the lead begins
            stalled = asyncio.get_running_loop().time() - self.turned_at
            if stalled > self.settings.cron_stall_s:
                return f"the leading cron engine has not turned for {stalled:.0f} s"
        return None

    def status(self) -> dict[str, Any]:
        live = [e for e in self.heap if self.versions.get(e[1]) == e[2]]
        return {
            "instance": self.instance,
            "leader": self.leader,
            "schedules": len(self.versions),
            "pending_fires": len(self.pending),
            "next_fire_at": min(e[3] for e in live) if live else None,
        }


def _outdated(row: Any, fire: Ahead) -> bool:
    """Whether a fire sent ahead no longer stands for its (changed) schedule."""
    return row is None or bool(row.paused) or row.version != fire.version


def _next_slots(plans: list[Plan]) -> None:
    """Set each plan's ``after`` (fired through) and ``next`` slot; a schedule whose next
    slot cannot be computed ``fail``s. Schedules that share an expression, zone and last
    slot share the croniter computation."""
    cache: dict[tuple[Any, ...], datetime | None] = {}
    for plan in plans:
        row = plan.row
        if plan.after is not None:
            continue  # failed already
        after = max(plan.through or row.next_fire_at, row.fired_through)
        key = (row.expression, row.timezone, row.starts_at, row.ends_at, after)
        if key not in cache:
            try:
                cache[key] = store.timing_of(row).next_after(after)
            except Exception as exc:
                fail(plan, exc)
                continue
        plan.after, plan.next = after, cache[key]


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
