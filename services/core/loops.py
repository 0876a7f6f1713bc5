"""Core's background work. One replica at a time, the leader (``libs/common/leader.py``),
runs the singletons: the promoter (due and paused work), the reaper, the placement pass,
the retention purges, the notification matcher and deadline scan, the log archive,
the audit export and the service controller.
Their writes were made safe to run side by side (SKIP LOCKED, transaction locks), so the
moments two replicas both think they lead, while an old leader notices it lost, cost
work twice and nothing else. Every replica runs its own wake-up sweep and delivers
webhooks (leased rows)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common import locks, waits
from libs.common.database import outage
from libs.common.leader import Elector, Lease, lead_forever
from services.core.db import placement, sharing
from services.core.db.feed import Notifier, Work
from services.core.domain import limits
from services.core.objects import LogObjects
from services.core.ops import auditexport, notify, services, tasklogs, upkeep
from services.core.ops import dispatch as ops
from services.core.ops.metrics import CoreMetrics
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.loops")

PROMOTE_PARALLEL = 2


class Promoter:
    """Starts delayed work on time: a timer on the next due instant, read from the
    database (by its clock) after every pass, and set earlier by due hints: this
    replica's submissions and, through NOTIFY, every other replica's. Each replica runs
    one; at the instant all of them wake, wake the workers (a claim takes a ready task
    whose ``run_at`` has come: ``db.attempts``), and share the promotion of the due rows
    that no claim took (SKIP LOCKED), so that their state reads ``waiting``. The timer
    never sleeps longer than ``poll_s``: that bounds what a lost hint costs, or the end
    of a deferral (set by the placement pass, not hinted), or another replica's
    promotion that rolled back. Backoffs are hinted (``ops.dispatch.counted``)."""

    def __init__(
        self,
        engine: AsyncEngine,
        notifier: Notifier,
        poll_s: float,
        after_s: float = 0.0,
        meter: CoreMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.notifier = notifier
        self.meter = meter
        self.poll_s = poll_s
        self.after_s = after_s
        self._wake = asyncio.Event()
        self._deadline = -math.inf  # UNIX seconds the timer is set for; -inf mid-pass
        self._earliest = math.inf  # the earliest hint heard during a pass
        notifier.on_due = self.hint

    def hint(self, at: float) -> None:
        """Work is due at ``at`` (UNIX seconds): wake earlier than planned if need be."""
        self._earliest = min(self._earliest, at)
        if at < self._deadline:
            self._wake.set()

    async def run(self) -> None:
        failures = Failures("promoter", self.poll_s)
        while True:
            self._deadline, self._earliest = -math.inf, math.inf
            try:
                wait = await self.step()
            except Exception as exc:
                # A loop that dies stops promoting for good: log, and go on.
                wait = failures.failed(exc)
            else:
                failures.worked()
            # A hint heard during the pass may be for a task the pass did not see yet.
            due_timer = wait < self.poll_s or self._earliest < math.inf
            self._deadline = min(time.time() + wait, self._earliest)
            self._wake.clear()
            remaining = self._deadline - time.time()
            if remaining > 0:
                await waits.woken(self._wake, remaining)
            if due_timer and not self._wake.is_set():
                # The timer on a due instant rang. The claim takes due ready work itself,
                # so workers are woken now, before the promotion (bookkeeping) runs: the
                # longest waiting claim of each queue, which wakes more if it found more.
                self.notifier.announce(Work(sweep=True))

    async def step(self) -> float:
        """Promote (and park) until nothing is left; return the seconds to sleep. A burst
        (a full batch) is drained on ``PROMOTE_PARALLEL`` connections at once: SKIP
        LOCKED gives each its own rows, and the database works on them side by side."""
        moved, due = await self._pass()
        while moved >= upkeep.PROMOTE_BATCH:
            await asyncio.gather(*(self._drain() for _ in range(PROMOTE_PARALLEL)))
            moved, due = await self._pass()
        return self.poll_s if due is None else max(0.0, min(due, self.poll_s))

    async def _pass(self) -> tuple[int, float | None]:
        """One promotion, and the next due instant read in the same transaction: by the
        same ``now()``, so a task due between the two cannot fall between them."""
        return await upkeep.promote(
            self.engine, self.notifier, self.after_s, next_due=True, meter=self.meter
        )

    async def _drain(self) -> None:
        while (await upkeep.promote(self.engine, self.notifier, self.after_s, meter=self.meter))[
            0
        ] >= upkeep.PROMOTE_BATCH:
            await asyncio.sleep(0)


#: a loop whose turns keep failing says so again at most this often (with the count)
FAILED_TELL_S = 60.0
#: the longest pause a failing loop backs off to (its own interval, when longer)
FAILED_PAUSE_MAX_S = 5.0


class Failures:
    """A loop's turns failed in a row. The first is told whole (one line while the
    database is out of reach, the traceback for anything else), then once every
    ``FAILED_TELL_S`` with the count: a fault that lasts (a bug the loop meets at every
    turn, a table refusing its writes) logged a traceback every turn, thousands an hour.
    The pause after each doubles from the loop's interval up to ``FAILED_PAUSE_MAX_S``
    (or the interval, when longer); a turn that works ends the streak, saying so."""

    def __init__(
        self, name: str, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.clock = clock
        self.count = 0
        self.told_at = -math.inf

    def failed(self, exc: Exception) -> float:
        """Count (and tell, if due) a failed turn; return the pause before the next."""
        self.count += 1
        now = self.clock()
        if self.count == 1 or now - self.told_at >= FAILED_TELL_S:
            self.told_at = now
            again = "" if self.count == 1 else f" ({self.count} turns in a row)"
            if (why := outage(exc)) is not None:
                log.warning("%s failed%s; retrying: %s", self.name, again, why)
            else:
                log.error("%s failed%s; retrying", self.name, again, exc_info=exc)
        ceiling = max(self.interval_s, FAILED_PAUSE_MAX_S)
        return min(self.interval_s * 2.0 ** min(self.count - 1, 30), ceiling)

    def worked(self) -> None:
        if self.count > 1:
            log.warning("%s works again after %d failed turns", self.name, self.count)
        self.count = 0
        self.told_at = -math.inf


async def every(interval_s: float, name: str, step: Callable[[], Awaitable[int]]) -> None:
    """Run ``step`` forever, again at once while it finds work, else every ``interval_s``;
    a failed turn is logged and the loop goes on after a pause (``Failures``): a loop
    that dies stops reaping or promoting for good."""
    failures = Failures(name, interval_s)
    while True:
        try:
            moved = await step()
        except Exception as exc:
            await asyncio.sleep(failures.failed(exc))
            continue
        failures.worked()
        if moved == 0:
            await asyncio.sleep(interval_s)
        else:
            await asyncio.sleep(0)


def reap_period(settings: CoreSettings) -> float:
    """How often the reaper turns: a quarter of the shorter of the heartbeat timeout and
    the agents' hang bound, within 0.1 to 5 s."""
    bound = min(settings.heartbeat_timeout_s, settings.agent_hang_timeout_s)
    return min(5.0, max(0.1, bound / 4))


def hearing_gap(settings: CoreSettings) -> float:
    """The longest break between the reaper's answers from the database that still counts
    as hearing (docs/faults.md). A deafness of ``d`` hides a healthy worker's beats for up
    to ``d`` plus an interval, so past ``timeout - interval`` it could bury a healthy
    worker and must restart the count; half the timeout stays below that with room for
    slow beats. The floor is three reaper turns: below it, a loaded machine's slow turns
    would restart the count over and over, excusing real deaths and delaying them. Half
    the agents' hang bound at most, too: a healthy agent's stored turn lags by up to an
    eighth (its keep-alive) and a quarter (the turn's freshness) of it."""
    timeout, interval = settings.heartbeat_timeout_s, settings.heartbeat_interval_s
    hang = settings.agent_hang_timeout_s
    return max(3 * reap_period(settings), min(timeout / 2, timeout - interval, hang / 2))


class Hearing:
    """How long this replica has been able to hear its workers: since when its reaper has
    reached the database at least every ``gap_s``. A replica that just started, or whose
    database was away, has heard nothing yet, whatever the workers' last beats say."""

    def __init__(self, gap_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.gap_s = gap_s
        self.clock = clock
        self.since: float | None = None
        self.last: float | None = None

    @classmethod
    def of(cls, settings: CoreSettings, clock: Callable[[], float] = time.monotonic) -> Hearing:
        return cls(hearing_gap(settings), clock)

    def heard(self) -> float:
        """Record that the database answered now; return how long hearing has lasted."""
        now = self.clock()
        if self.last is None or now - self.last > self.gap_s or self.since is None:
            self.since = now
        self.last = now
        return now - self.since


async def reap_once(
    engine: AsyncEngine,
    notifier: Notifier,
    settings: CoreSettings,
    hearing: Hearing,
    meter: CoreMetrics | None = None,
) -> int:
    return await ops.reap(
        engine,
        notifier,
        settings.heartbeat_timeout_s,
        hearing.heard,
        meter,
        settings.agent_hang_timeout_s,
    )


def start(
    engine: AsyncEngine,
    notifier: Notifier,
    settings: CoreSettings,
    meter: CoreMetrics,
    liveness: AsyncEngine | None = None,
    *,
    webhooks: notify.Webhooks,
    objects: LogObjects | None = None,
    database_url: str | None = None,
    book: sharing.Book | None = None,
) -> tuple[Leadership, list[asyncio.Task[None]]]:
    """Core's loops: the leadership (which runs the singletons while it leads, on
    ``database_url``'s elector; without one, this process always leads), the wake-up
    sweep and webhook delivery. The reaper runs on ``liveness`` (the heartbeats' own
    pool, else ``engine``): what it hears of the database is what the heartbeats meet."""

    def singletons() -> list[asyncio.Task[None]]:
        return singleton_loops(engine, notifier, settings, meter, liveness, objects, book)

    elector = None
    if database_url is not None:
        elector = Elector(
            database_url,
            name="core",
            key=locks.CORE_LEADER,
            table="core.leader",
            poll_s=settings.leader_poll_s,
        )
    leadership = Leadership(elector, singletons, settings.leader_poll_s)
    return leadership, [
        asyncio.create_task(leadership.run(), name="cairn-leadership"),
        asyncio.create_task(sweep(notifier, settings.claim_sweep_s), name="cairn-claim-sweep"),
        asyncio.create_task(_deliveries(engine, settings, webhooks), name="cairn-notify-delivery"),
    ]


def singleton_loops(
    engine: AsyncEngine,
    notifier: Notifier,
    settings: CoreSettings,
    meter: CoreMetrics,
    liveness: AsyncEngine | None = None,
    objects: LogObjects | None = None,
    book: sharing.Book | None = None,
) -> list[asyncio.Task[None]]:
    """What one replica at a time runs: the leader's loops."""
    reaping = liveness or engine
    reap_every = reap_period(settings)
    hearing = Hearing.of(settings)
    return [
        asyncio.create_task(
            Promoter(
                engine, notifier, settings.promote_interval_s, settings.promote_after_s, meter
            ).run(),
            name="cairn-promoter",
        ),
        asyncio.create_task(
            every(
                reap_every,
                "reaper",
                lambda: reap_once(reaping, notifier, settings, hearing, meter),
            ),
            name="cairn-reaper",
        ),
        asyncio.create_task(
            every(
                settings.placement_interval_s,
                "placement",
                lambda: upkeep.place(engine, notifier, placement.Defaults.of(settings)),
            ),
            name="cairn-placement",
        ),
        asyncio.create_task(
            every(
                settings.retention_interval_s,
                "retention",
                lambda: _purge_step(engine, settings),
            ),
            name="cairn-retention",
        ),
        asyncio.create_task(
            every(
                settings.usage_interval_s,
                "usage",
                lambda: upkeep.roll_up_usage(engine, settings.fair_share_half_life_s),
            ),
            name="cairn-usage",
        ),
        *notification_loops(engine, settings),
        *audit_export_loops(engine, settings),
        *service_loops(engine, notifier, settings, meter, book),
        *log_loops(
            engine,
            objects,
            settings.log_archive_interval_s,
            settings.log_late_s,
            settings.retention_days * 86400,
            settings.retention_interval_s,
            settings.retention_batch,
        ),
    ]


class LoopEnded(Exception):
    """A singleton loop ended while its replica led (a loop ends only by a fault that
    escaped it: a stray ``CancelledError``, a ``BaseException``, a bug in the loop's own
    frame)."""


class Leadership:
    """Runs the singleton loops while this replica leads: campaigns, starts them once it
    wins, checks the lead every ``check_s``, and stops them (then campaigns again) the
    moment it is lost. A singleton loop that ended on its own fails the lead: the replica
    steps down, so another (or this one, after the failed lead's pause) leads with every
    loop started again, instead of leading on without it, unseen. Without an elector it
    always leads (one process, tests), starting the loops again after the same pause."""

    def __init__(
        self,
        elector: Elector | None,
        loops: Callable[[], list[asyncio.Task[None]]],
        check_s: float,
    ) -> None:
        self.elector = elector
        self.loops = loops
        self.check_s = check_s
        self.leading = False
        self.running: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        if self.elector is not None:
            await lead_forever(self.elector, self._lead, pause_s=self.check_s)
            return
        failures = Failures("leadership", self.check_s)
        while True:
            try:
                await self._lead(None)
            except LoopEnded as exc:
                await asyncio.sleep(failures.failed(exc))

    async def _lead(self, lease: Lease | None) -> None:
        self.running = self.loops()
        self.leading = True
        try:
            while True:
                await asyncio.sleep(self.check_s)
                if lease is not None:
                    await lease.check()
                self._check_running()
        finally:
            self.leading = False
            # Not raised here, what a loop ended by (a BaseException too): past the
            # elector's step-down. A loop that lost its cancel is cancelled again.
            await waits.stop(*self.running)
            self.running = []

    def _check_running(self) -> None:
        """Raise ``LoopEnded`` if a singleton loop has ended, naming it and why."""
        ended = [task for task in self.running if task.done()]
        if not ended:
            return
        why = {task: None if task.cancelled() else task.exception() for task in ended}
        names = ", ".join(
            f"{task.get_name()} ("
            + ("cancelled" if task.cancelled() else repr(why[task]) if why[task] else "returned")
            + ")"
            for task in ended
        )
        first = next((exc for exc in why.values() if exc is not None), None)
        raise LoopEnded(f"singleton loops ended while leading: {names}") from first


def service_loops(
    engine: AsyncEngine,
    notifier: Notifier,
    settings: CoreSettings,
    meter: CoreMetrics,
    book: sharing.Book | None,
) -> list[asyncio.Task[None]]:
    """The service controller (docs/services.md): replicas kept, rollouts moved on."""
    controller = services.Controller(
        engine,
        notifier,
        meter,
        book or sharing.Book(settings.sharing_cache_s),
        float(settings.fair_quantum_s),
        limits.Defaults(settings.default_timeout_s, settings.poison_window_s),
    )
    step = every(settings.services_interval_s, "services", controller.run_pass)
    return [asyncio.create_task(step, name="cairn-services")]


async def sweep(notifier: Notifier, interval_s: float) -> None:
    """This replica's floor under lost wake-ups (``Notifier.sweep``)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            notifier.sweep()
        except Exception:
            log.exception("claim sweep failed; going on")


async def _purge_step(engine: AsyncEngine, settings: CoreSettings) -> int:
    await upkeep.purge(engine, settings)
    await upkeep.purge_audit(engine, settings)
    return 0


def audit_export_loops(engine: AsyncEngine, settings: CoreSettings) -> list[asyncio.Task[None]]:
    """The audit export (docs/security.md), when ``CAIRN_AUDIT_EXPORT_TO`` is set."""
    if settings.audit_export_to is None:
        return []
    sink = auditexport.sink_for(settings.audit_export_to, settings.audit_export_s3_endpoint_url)
    batch = settings.audit_export_batch
    return [
        asyncio.create_task(
            every(
                settings.audit_export_interval_s,
                "audit export",
                lambda: auditexport.export_once(engine, sink, batch),
            ),
            name="cairn-audit-export",
        )
    ]


# --- notifications (docs/notifications.md) ------------------------------------------------


def notification_loops(engine: AsyncEngine, settings: CoreSettings) -> list[asyncio.Task[None]]:
    """The matcher, the deadline scan (each also under an advisory lock of its own) and
    the outbox's retention; webhook delivery runs in every replica (``_deliveries``)."""
    interval = settings.notify_interval_s
    batch = settings.notify_batch * 10
    return [
        asyncio.create_task(
            every(interval, "notify-matcher", lambda: notify.match_once(engine, batch)),
            name="cairn-notify-matcher",
        ),
        asyncio.create_task(
            every(interval, "notify-deadlines", lambda: notify.deadlines_once(engine, batch)),
            name="cairn-notify-deadlines",
        ),
        asyncio.create_task(
            every(
                settings.retention_interval_s,
                "notify-retention",
                lambda: notify.purge_once(engine, settings),
            ),
            name="cairn-notify-retention",
        ),
    ]


async def _deliveries(
    engine: AsyncEngine, settings: CoreSettings, webhooks: notify.Webhooks
) -> None:
    deliverer = notify.Deliverer.of(engine, settings, webhooks)
    try:
        await every(settings.notify_interval_s, "notify-delivery", deliverer.deliver_once)
    finally:
        await deliverer.aclose()


def log_loops(
    engine: AsyncEngine,
    objects: LogObjects | None,
    archive_interval_s: float,
    late_s: float,
    retention_s: float,
    retention_interval_s: float,
    batch: int,
) -> list[asyncio.Task[None]]:
    """The object store's loops (none without one)."""
    if objects is None:
        return []
    store = objects
    return [
        asyncio.create_task(
            every(
                archive_interval_s,
                "log archive",
                lambda: tasklogs.archive_once(engine, store, late_s),
            ),
            name="cairn-log-archive",
        ),
        asyncio.create_task(
            every(
                retention_interval_s,
                "log object retention",
                lambda: tasklogs.purge_objects_once(engine, store, retention_s, batch),
            ),
            name="cairn-log-retention",
        ),
    ]
