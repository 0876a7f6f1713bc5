"""Fair sharing's settings: an owner's share and quotas, a queue's policy, a concurrency
key's limits. Every replica's book reads a change anew (``Book.invalidate`` here, and
the book's own refresh on the others)."""

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


async def set_share(
    engine: AsyncEngine, book: sharing.Book, name: str, change: ShareSettings
) -> OwnerUsage:
    async with engine.begin() as conn:
        await sharing.set_share(conn, name, change)
    book.invalidate()
    async with engine.connect() as conn:
        [usage] = await sharing.usage_of(conn, [name])
    return usage


async def set_policy(
    engine: AsyncEngine, book: sharing.Book, name: str, policy: QueuePolicy
) -> QueuePolicy:
    async with engine.begin() as conn:
        await sharing.set_policy(conn, name, policy)
    book.invalidate()
    return policy


async def set_key_limit(engine: AsyncEngine, key: str, limit: ConcurrencyLimit) -> ConcurrencyState:
    async with engine.begin() as conn:
        await sharing.set_key_limit(conn, key, limit)
    async with engine.connect() as conn:
        return await sharing.key_state(conn, key)
