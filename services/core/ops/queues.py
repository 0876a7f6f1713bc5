"""Queues: what they hold and their placement settings read together; pausing and
resuming one, and setting its pool's placement, each audited in its transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from libs.common.models import QueueInfo, QueueSettings
from services.core.db import placement, sharing
from services.core.db import tasks as tasks_db
from services.core.db.audit import Auditor
from services.core.db.feed import Notifier, Work
from services.core.domain import limits


async def read(
    conn: AsyncConnection,
    defaults: placement.Defaults,
    depths: Sequence[Row[Any]] | None = None,
) -> list[QueueInfo]:
    """Every queue with live work or settings: its depth (``depths`` as
    ``tasks.queue_depths`` read them, or read here on ``conn``), and its pool's placement
    settings (the operator's defaults where it has none) and utilisation."""
    items = await tasks_db.list_queues(conn, depths)
    pools = await placement.pools(conn, defaults)
    for item in items:
        pool = pools.get(item.name)
        item.overcommit = pool.overcommit if pool else defaults.overcommit
        item.defer_above = pool.defer_above if pool else defaults.defer_above
        item.utilisation = pool.utilisation if pool else None
    return items


async def set_paused(
    engine: AsyncEngine, notifier: Notifier, record: Auditor, name: str, paused: bool
) -> None:
    """Pause (its waiting tasks go back to ready) or resume the queue."""
    async with engine.begin() as conn:
        was = await tasks_db.queue_paused(conn, name)
        await tasks_db.set_paused(conn, name, paused)
        await record(
            conn,
            "queue.pause" if paused else "queue.resume",
            f"queue:{name}",
            before={"paused": was},
            after={"paused": paused},
        )
        moved = await tasks_db.promote_and_park(conn, 1000)
    notifier.announce(Work(queues={name: moved}) if moved and not paused else None)


_LIMITS = limits.LIMIT_COLUMNS


async def set_pool(
    engine: AsyncEngine,
    record: Auditor,
    defaults: placement.Defaults,
    name: str,
    change: QueueSettings,
) -> None:
    """Set the queue's placement settings, its tasks' time limits (``domain.limits``:
    a default above the maximum, as they would stand, is refused) and its attempts'
    egress policy."""
    changed = change.model_dump(exclude_unset=True)
    async with engine.begin() as conn:
        stored = await sharing.limits_for_update(conn, name)
        after = replace(stored, **{k: v for k, v in changed.items() if k in _LIMITS})
        limits.check_queue(after, set(changed))
        old = [q for q in await read(conn, defaults) if q.name == name]
        await placement.set_pool(conn, name, change)
        before = (
            {
                "overcommit": old[0].overcommit,
                "defer_above": old[0].defer_above,
                **asdict(stored),
                "egress": old[0].egress.model_dump(),
            }
            if old
            else None
        )
        await record(conn, "queue.settings", f"queue:{name}", before=before, after=changed)
