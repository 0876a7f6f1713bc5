"""Core's background work: the promoter (due and paused work) and the retention purge.
Every replica runs them; SKIP LOCKED keeps replicas out of each other's way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.core import dispatch, placement, store
from services.core.feed import Notifier
from services.core.metrics import CoreMetrics
from services.core.settings import CoreSettings

log = logging.getLogger("cairn.core.loops")

PROMOTE_BATCH = 1000


async def promote_once(engine: AsyncEngine, notifier: Notifier) -> int:
    async with engine.begin() as conn:
        moved = await store.promote_and_park(conn, PROMOTE_BATCH)
    if moved:
        notifier.announce()
    return moved


async def purge_once(engine: AsyncEngine, settings: CoreSettings) -> int:
    """Delete finished tasks and gone workers past retention, one small transaction per
    batch."""
    total = 0
    for purge in (store.purge_finished, store.purge_workers):
        while True:
            async with engine.begin() as conn:
                gone = await purge(conn, settings.retention_days * 86400, settings.retention_batch)
            total += gone
            if gone < settings.retention_batch:
                break
            await asyncio.sleep(0)
    return total


async def every(interval_s: float, name: str, step: Callable[[], Awaitable[int]]) -> None:
    """Run ``step`` forever, again at once while it finds work, else every ``interval_s``."""
    while True:
        try:
            moved = await step()
        except Exception:
            # A loop that dies stops reaping or promoting for good: log, and go on.
            log.exception("%s failed; retrying", name)
            moved = 0
        if moved == 0:
            await asyncio.sleep(interval_s)
        else:
            await asyncio.sleep(0)


async def place_once(engine: AsyncEngine, notifier: Notifier, defaults: placement.Defaults) -> int:
    async with engine.begin() as conn:
        changed = await placement.place_once(conn, defaults)
    if changed:
        notifier.announce()
    return changed


class Hearing:
    """How long this replica has been able to hear its workers: since when its reaper has
    reached the database at least every ``gap_s``. A replica that just started, or whose
    database was away, has heard nothing yet, whatever the workers' last beats say."""

    def __init__(self, gap_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.gap_s = gap_s
        self.clock = clock
        self.since: float | None = None
        self.last: float | None = None

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
    tally = dispatch.Tally()
    async with engine.begin() as conn:
        await conn.execute(text("SELECT 1"))
        changed = await dispatch.reap(
            conn,
            settings.heartbeat_timeout_s,
            tally,
            heard_for_s=hearing.heard(),
        )
    if meter is not None:
        meter.count(tally)
    if changed:
        notifier.announce()
    return changed


def start(
    engine: AsyncEngine, notifier: Notifier, settings: CoreSettings, meter: CoreMetrics
) -> list[asyncio.Task[None]]:
    reap_every = min(5.0, max(0.1, settings.heartbeat_timeout_s / 4))
    # A reaper turn that misses this long means core could not hear for a while.
    hearing = Hearing(gap_s=max(settings.heartbeat_interval_s, 3 * reap_every))
    return [
        asyncio.create_task(
            every(settings.promote_interval_s, "promoter", lambda: promote_once(engine, notifier)),
            name="cairn-promoter",
        ),
        asyncio.create_task(
            every(
                reap_every,
                "reaper",
                lambda: reap_once(engine, notifier, settings, hearing, meter),
            ),
            name="cairn-reaper",
        ),
        asyncio.create_task(
            every(
                settings.placement_interval_s,
                "placement",
                lambda: place_once(engine, notifier, placement.Defaults.of(settings)),
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
    ]


async def _purge_step(engine: AsyncEngine, settings: CoreSettings) -> int:
    await purge_once(engine, settings)
    return 0
