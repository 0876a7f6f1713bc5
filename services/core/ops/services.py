"""Services' replicas (docs/services.md): an agent's report of their readiness and
where they listen, kept in one transaction."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from libs.common.models import ReplicaStatus
from services.core.db import services as services_db


async def report_replicas(
    engine: AsyncEngine, worker_id: int, items: Sequence[ReplicaStatus]
) -> list[int]:
    """Keep what the worker says of its replicas; the attempts whose status was kept
    (an attempt no longer open on it, or no longer its task's current one, is not)."""
    async with engine.begin() as conn:
        return await services_db.report(conn, worker_id, items)
