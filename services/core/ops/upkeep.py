"""Core's upkeep, as the loops run it: promoting due work, the placement pass, and the
retention purges, each in short transactions of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.core.db import accounting, audit, placement
from services.core.db import tasks as tasks_db
from services.core.db.feed import Notifier, Work
from services.core.ops.metrics import CoreMetrics
from services.core.settings import CoreSettings

PROMOTE_BATCH = 1000


async def promote(
    engine: AsyncEngine,
    notifier: Notifier,
    after_s: float = 0.0,
    *,
    next_due: bool = False,
    meter: CoreMetrics | None = None,
) -> tuple[int, float | None]:
    """End what was never started by its start_by, then promote (or park) up to a batch
    of due rows, and, with ``next_due``, read in the same transaction (by the same
    ``now()``, so that a task due between the two cannot fall between them) the seconds
    to the next due instant or start_by (None after a full batch)."""
    async with engine.begin() as conn:
        expired = await tasks_db.expire_unstarted(conn, PROMOTE_BATCH)
        moved = await tasks_db.promote_and_park(conn, PROMOTE_BATCH, after_s)
        full = max(moved, expired) >= PROMOTE_BATCH
        due = await tasks_db.next_due_in(conn, after_s) if next_due and not full else None
    if moved:
        notifier.announce(Work(any=moved))
    if expired and meter is not None:
        meter.expire(expired)
    return max(moved, expired), due


async def place(engine: AsyncEngine, notifier: Notifier, defaults: placement.Defaults) -> int:
    """One placement pass (one replica at a time); what it changed."""
    async with engine.begin() as conn:
        changed = await placement.place_once(conn, defaults)
    if changed:
        notifier.announce(Work(any=changed))
    return changed


async def in_batches(
    engine: AsyncEngine, batch: int, purge: Callable[[AsyncConnection], Awaitable[int]]
) -> int:
    """Run ``purge`` (which deletes up to ``batch`` rows) until it finds fewer, one small
    transaction each; return how many went."""
    total = 0
    while True:
        async with engine.begin() as conn:
            gone = await purge(conn)
        total += gone
        if gone < batch:
            return total
        await asyncio.sleep(0)


async def purge(engine: AsyncEngine, settings: CoreSettings) -> int:
    """Delete finished tasks and gone workers past retention."""
    age_s, batch = settings.retention_days * 86400, settings.retention_batch
    tasks = await in_batches(engine, batch, lambda c: tasks_db.purge_finished(c, age_s, batch))
    gone = await in_batches(engine, batch, lambda c: tasks_db.purge_workers(c, age_s, batch))
    return tasks + gone


async def purge_audit(engine: AsyncEngine, settings: CoreSettings) -> int:
    """Delete audit entries past their own (longer) retention; with an export configured,
    only those it has written."""
    age_s, batch = settings.audit_retention_days * 86400, settings.retention_batch
    exported_only = settings.audit_export_to is not None
    return await in_batches(
        engine, batch, lambda c: audit.purge(c, age_s, batch, exported_only=exported_only)
    )


#: feed events one roll-up transaction reads
USAGE_PAGE = 2000


async def roll_up_usage(engine: AsyncEngine, half_life_s: float) -> int:
    """Add one page of the feed's ended attempts to the monthly usage sums and the flows'
    decayed usage (``db.accounting``); the events read (a full page: ``loops.every``
    reads on at once)."""
    async with engine.begin() as conn:
        rolled = await accounting.roll_up(conn, USAGE_PAGE, half_life_s)
    return rolled.read if rolled.read >= USAGE_PAGE else 0
