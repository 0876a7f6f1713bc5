"""Fair sharing's settings: an owner's share and quotas, a queue's policy, a concurrency
key's limits, each audited in its transaction. Every replica's book reads a change anew
(``Book.invalidate`` here, and the book's own refresh on the others)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import (
    ConcurrencyLimit,
    ConcurrencyState,
    OwnerUsage,
    QueuePolicy,
    ShareSettings,
)
from services.core.db import sharing
from services.core.db.audit import Auditor


def share_of(usage: OwnerUsage) -> dict[str, object]:
    return {"weight": usage.weight, **usage.quota.model_dump()}


def _limits(state: ConcurrencyState) -> dict[str, object]:
    return {
        "max_running": state.max_running,
        "max_starts": state.max_starts,
        "window_s": state.window_s,
    }


async def set_share(
    engine: AsyncEngine, record: Auditor, book: sharing.Book, name: str, change: ShareSettings
) -> OwnerUsage:
    async with engine.begin() as conn:
        [before] = await sharing.usage_of(conn, [name])
        await sharing.set_share(conn, name, change)
        [after] = await sharing.usage_of(conn, [name])
        await record(
            conn, "owner.share", f"owner:{name}", before=share_of(before), after=share_of(after)
        )
    book.invalidate()
    return after


async def set_policy(
    engine: AsyncEngine, record: Auditor, book: sharing.Book, name: str, policy: QueuePolicy
) -> QueuePolicy:
    async with engine.begin() as conn:
        before = await sharing.get_policy(conn, name)
        await sharing.set_policy(conn, name, policy)
        await record(
            conn,
            "queue.policy",
            f"queue:{name}",
            before=before.model_dump(mode="json") if before is not None else None,
            after=policy.model_dump(mode="json"),
        )
    book.invalidate()
    return policy


async def set_key_limit(
    engine: AsyncEngine, record: Auditor, key: str, limit: ConcurrencyLimit
) -> ConcurrencyState:
    async with engine.begin() as conn:
        before = await sharing.key_state(conn, key)
        await sharing.set_key_limit(conn, key, limit)
        after = await sharing.key_state(conn, key)
        target = f"concurrency:{key}"
        await record(
            conn, "concurrency.limit", target, before=_limits(before), after=_limits(after)
        )
    return after
