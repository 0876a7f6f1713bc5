"""Webhook subscriptions as their owners change them, and the events the cron and DAG
services post; delivering them is ``ops.notify``'s."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import Delivery, NotificationEvent, Subscription, SubscriptionCreate
from services.core.db import notifications
from services.core.identity.crypto import SecretBox


async def create(
    engine: AsyncEngine, box: SecretBox, owner: str, spec: SubscriptionCreate, secret: str
) -> Subscription:
    async with engine.begin() as conn:
        return await notifications.create_subscription(conn, box, owner, spec, secret)


async def delete(engine: AsyncEngine, subscription_id: int, owner: str | None) -> None:
    async with engine.begin() as conn:
        await notifications.delete_subscription(conn, subscription_id, owner)


async def test(
    engine: AsyncEngine, subscription_id: int, owner: str | None, interval_s: float
) -> Delivery:
    """Queue a test delivery, at most one per ``interval_s`` of the owner's (else 429)."""
    async with engine.begin() as conn:
        found = await notifications.get_subscription(conn, subscription_id, owner)
        return await notifications.queue_test(conn, found, interval_s)


async def enable(engine: AsyncEngine, subscription_id: int, owner: str | None) -> Subscription:
    async with engine.begin() as conn:
        return await notifications.enable_subscription(conn, subscription_id, owner)


async def post(engine: AsyncEngine, event: NotificationEvent, at: datetime) -> int:
    """Queue a posted event for its owner's matching subscriptions; how many were queued."""
    async with engine.begin() as conn:
        return await notifications.queue_posted(conn, event, at)
