"""Queues: depth per state, and pausing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from libs.common.models import QueueHistory, QueueInfo, QueueList, QueueName
from libs.common.problems import PROBLEMS
from services.core import store
from services.core.deps import AdminOnly, Announcer, Engine, Reader

router = APIRouter(prefix="/v1/queues", tags=["queues"])


@router.get("", response_model=QueueList, responses=PROBLEMS)
async def list_queues(principal: Reader, engine: Engine) -> QueueList:
    """Every queue with live work or settings: depth per state, oldest waiting age."""
    async with engine.connect() as conn:
        return QueueList(items=await store.list_queues(conn))


@router.get("/history", response_model=QueueHistory, responses=PROBLEMS)
async def queue_history(
    principal: Reader, engine: Engine, minutes: Annotated[int, Query(ge=1, le=180)] = 60
) -> QueueHistory:
    """Each queue's last ``minutes``, a value a minute: tasks submitted and finished, and
    the backlog of unfinished tasks (the dashboard's charts)."""
    async with engine.connect() as conn:
        return await store.queue_history(conn, minutes)


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
