"""Queues: depth per state, and pausing."""

from __future__ import annotations

from fastapi import APIRouter

from libs.common.models import QueueInfo, QueueList, QueueName
from libs.common.problems import PROBLEMS
from services.core import store
from services.core.deps import AdminOnly, Announcer, Engine, Reader

router = APIRouter(prefix="/v1/queues", tags=["queues"])


@router.get("", response_model=QueueList, responses=PROBLEMS)
async def list_queues(principal: Reader, engine: Engine) -> QueueList:
    """Every queue with live work or settings: depth per state, oldest waiting age."""
    async with engine.connect() as conn:
        return QueueList(items=await store.list_queues(conn))


async def _set_paused(engine: Engine, notifier: Announcer, name: str, paused: bool) -> QueueInfo:
    async with engine.begin() as conn:
        await store.set_paused(conn, name, paused)
        await store.promote_and_park(conn, 1000)
    notifier.announce()
    async with engine.connect() as conn:
        found = [q for q in await store.list_queues(conn) if q.name == name]
    return found[0]


@router.post("/{name}/pause", response_model=QueueInfo, responses=PROBLEMS)
async def pause_queue(
    name: QueueName, principal: AdminOnly, engine: Engine, notifier: Announcer
) -> QueueInfo:
    """Stop handing out the queue's work: its waiting tasks go back to ready."""
    return await _set_paused(engine, notifier, name, True)


@router.post("/{name}/resume", response_model=QueueInfo, responses=PROBLEMS)
async def resume_queue(
    name: QueueName, principal: AdminOnly, engine: Engine, notifier: Announcer
) -> QueueInfo:
    return await _set_paused(engine, notifier, name, False)
