"""Queues: depth per state, and pausing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from libs.common.models import QueueHistory, QueueInfo, QueueList, QueueName, QueueSettings
from libs.common.problems import PROBLEMS
from services.core.api.deps import (
    AdminOnly,
    Announcer,
    Audit,
    BacklogCounts,
    Engine,
    Reader,
    aged,
)
from services.core.db import placement
from services.core.db import tasks as tasks_db
from services.core.ops import queues as queues_ops

router = APIRouter(prefix="/v1/queues", tags=["queues"])


@router.get("", response_model=QueueList, responses=PROBLEMS)
async def list_queues(
    principal: Reader, engine: Engine, request: Request, response: Response, read: BacklogCounts
) -> QueueList:
    """Every queue with live work or settings: depth per state, oldest waiting age, and
    its placement settings and utilisation. The depths count the whole backlog, once for
    all of this core's callers at a time: with `Cache-Control: max-age=N` a request may
    get a count up to N seconds old (the `Age` header says how old); without it, one
    counted after it came."""
    depths = await tasks_db.queue_depths(read)  # before a connection of its own
    async with engine.connect() as conn:
        items = await _queues(conn, request, depths)
    aged(response, read)
    return QueueList(items=items)


@router.get("/history", response_model=QueueHistory, responses=PROBLEMS)
async def queue_history(
    principal: Reader,
    engine: Engine,
    response: Response,
    read: BacklogCounts,
    minutes: Annotated[int, Query(ge=1, le=180)] = 60,
) -> QueueHistory:
    """Each queue's last `minutes`, a value a minute: tasks submitted and finished, and
    the backlog of unfinished tasks (the dashboard's charts). Counted as the queues'
    depths are (`Cache-Control: max-age`, `Age`); `until` is when."""
    history = await tasks_db.queue_history(read, minutes)
    aged(response, read)
    return history


async def _queues(
    conn: AsyncConnection, request: Request, depths: Sequence[Row[Any]] | None = None
) -> list[QueueInfo]:
    defaults = placement.Defaults.of(request.app.state.settings)
    return await queues_ops.read(conn, defaults, depths)


async def _one(engine: Engine, request: Request, name: str) -> QueueInfo:
    async with engine.connect() as conn:
        found = [q for q in await _queues(conn, request) if q.name == name]
    return found[0]


async def _set_paused(
    engine: Engine, notifier: Announcer, request: Request, name: str, paused: bool, record: Audit
) -> QueueInfo:
    await queues_ops.set_paused(engine, notifier, record, name, paused)
    return await _one(engine, request, name)


@router.patch("/{name}", response_model=QueueInfo, responses=PROBLEMS)
async def set_queue(
    name: QueueName,
    change: QueueSettings,
    principal: AdminOnly,
    engine: Engine,
    request: Request,
    record: Audit,
) -> QueueInfo:
    """Set the pool's overcommit ratio for preemptible work, the utilisation above
    which time-insensitive work is deferred, and its tasks' time limits: the default and
    the largest ``timeout_s``, and the longest a task may wait to start (null: the
    operator's default, or none); and its attempts' egress policy (``host``, ``none``,
    ``allow`` with a list of CIDR ranges and ports: docs/security.md, "Egress"). 422
    naming the field when the default would be above the maximum, or for a malformed
    range, a port out of range, a list too long."""
    defaults = placement.Defaults.of(request.app.state.settings)
    await queues_ops.set_pool(engine, record, defaults, name, change)
    request.app.state.sharing.invalidate()
    return await _one(engine, request, name)


@router.post("/{name}/pause", response_model=QueueInfo, responses=PROBLEMS)
async def pause_queue(
    name: QueueName,
    principal: AdminOnly,
    engine: Engine,
    notifier: Announcer,
    request: Request,
    record: Audit,
) -> QueueInfo:
    """Stop handing out the queue's work: its waiting tasks go back to ready."""
    return await _set_paused(engine, notifier, request, name, True, record)


@router.post("/{name}/resume", response_model=QueueInfo, responses=PROBLEMS)
async def resume_queue(
    name: QueueName,
    principal: AdminOnly,
    engine: Engine,
    notifier: Announcer,
    request: Request,
    record: Audit,
) -> QueueInfo:
    return await _set_paused(engine, notifier, request, name, False, record)
