"""Core's background work: the promoter (due and paused work) and the retention purge.
Every replica runs them; SKIP LOCKED keeps replicas out of each other's way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from services.core import dispatch, notify, placement, store
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
    """Delete finished tasks past retention, one small transaction per batch."""
    total = 0
    while True:
        async with engine.begin() as conn:
            gone = await store.purge_finished(
                conn, settings.retention_days * 86400, settings.retention_batch
            )
        total += gone
        if gone < settings.retention_batch:
            return total
        await asyncio.sleep(0)


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


async def reap_once(
    engine: AsyncEngine, notifier: Notifier, timeout_s: float, meter: CoreMetrics | None = None
) -> int:
    tally = dispatch.Tally()
    async with engine.begin() as conn:
        changed = await dispatch.reap(conn, timeout_s, tally)
    if meter is not None:
        meter.count(tally)
    if changed:
        notifier.announce()
    return changed


def start(
    engine: AsyncEngine, notifier: Notifier, settings: CoreSettings, meter: CoreMetrics
) -> list[asyncio.Task[None]]:
    return [
        asyncio.create_task(
            every(settings.promote_interval_s, "promoter", lambda: promote_once(engine, notifier)),
            name="cairn-promoter",
        ),
        asyncio.create_task(
            every(
                min(5.0, max(0.1, settings.heartbeat_timeout_s / 4)),
                "reaper",
                lambda: reap_once(engine, notifier, settings.heartbeat_timeout_s, meter),
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
        *notification_loops(engine, settings),
    ]


async def _purge_step(engine: AsyncEngine, settings: CoreSettings) -> int:
    await purge_once(engine, settings)
    return 0


# --- notifications (docs/notifications.md) ------------------------------------------------


def notification_loops(engine: AsyncEngine, settings: CoreSettings) -> list[asyncio.Task[None]]:
    """The matcher and the deadline scan (one replica at a time each, by advisory lock),
    webhook delivery (every replica, leased rows) and the outbox's retention."""
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
        asyncio.create_task(_deliveries(engine, settings), name="cairn-notify-delivery"),
        asyncio.create_task(
            every(
                settings.retention_interval_s,
                "notify-retention",
                lambda: notify.purge_once(engine, settings),
            ),
            name="cairn-notify-retention",
        ),
    ]


async def _deliveries(engine: AsyncEngine, settings: CoreSettings) -> None:
    deliverer = notify.Deliverer.of(engine, settings)
    try:
        await every(settings.notify_interval_s, "notify-delivery", deliverer.deliver_once)
    finally:
        await deliverer.aclose()
